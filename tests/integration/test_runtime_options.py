"""transformers' run-time options, one CPU process: dataloader_drop_last and train_sampling_strategy (SFT and
GRPO), logging_strategy,
log_level, full_determinism, tf32 and the process-group checks of ddp_backend / ddp_timeout. The DDP options themselves are tested with 2
processes in tests/distributed/test_ddp_options.py."""

import os

import pytest
import torch

import trainers.loop.base
import trainers.config.training
from tests.conftest import step_records
from trainers import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer
from trainers.errors import ConfigError, DistributedError
from trainers.cli.tiny import as_sft_rows, reverse_digits_rows

ROWS = as_sft_rows(reverse_digits_rows(20))


def sft_config(tmp_path, **overrides):
    base = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, learning_rate=1e-3,
                num_train_epochs=1, save_strategy="no", disable_tqdm=True, seed=0, logging_steps=1)
    return SFTConfig(**{**base, **overrides})


def reward_length(completions, **kwargs):
    return [float(len(c)) for c in completions]


@pytest.mark.parametrize("drop_last,steps", [(False, 3), (True, 2)])
def test_sft_drop_last_trains_whole_global_batches_only(tiny_model_dir, tmp_path, drop_last, steps):
    trainer = SFTTrainer(model=tiny_model_dir, train_dataset=ROWS,
                         args=sft_config(tmp_path, dataloader_drop_last=drop_last))
    assert trainer.max_steps == steps  # 20 rows in global batches of 8: 2 whole ones and 4 rows left
    rows = [r for step in range(steps) for r in trainer.sampler.batch(step)]
    assert len(rows) == 8 * steps
    assert len(set(rows)) == (20 if not drop_last else 16)  # topped up with 4 repeats, or 4 rows left out
    trainer.train()
    assert trainer.state.global_step == steps and trainer.state.epoch == 1.0


def test_sft_drop_last_with_fewer_rows_than_a_batch_is_named(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match=r"`dataloader_drop_last=True`.*train_dataset's 5 rows are fewer than "
                                          r"one global batch \(8 rows\)"):
        SFTTrainer(model=tiny_model_dir, train_dataset=ROWS[:5], args=sft_config(tmp_path, dataloader_drop_last=True))


@pytest.mark.parametrize("drop_last,rounds", [(False, 2), (True, 1)])
def test_grpo_drop_last_drops_the_incomplete_generation_round_as_trl(tiny_model_dir, tmp_path, drop_last, rounds):
    prompts = [{"prompt": f"count {i}"} for i in range(6)]
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=16, num_generations=4,
                      max_completion_length=4, num_train_epochs=1, disable_tqdm=True, save_strategy="no",
                      dataloader_drop_last=drop_last)
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=reward_length, args=args, train_dataset=prompts)
    assert trainer.prompts_per_round == 4 and trainer.max_steps == rounds
    first = trainer.prompt_sampler.batch(0)
    assert len(set(first)) == 4
    if not drop_last:  # the second round holds the 2 prompts left and 2 from the epoch's start
        assert sorted(set(first) | set(trainer.prompt_sampler.batch(1))) == list(range(6))


def test_train_sampling_strategy_orders_the_rows(tiny_model_dir, tmp_path):
    rows = [{"text": "x" * (1 + (i * 7) % 60)} for i in range(256)]  # mixed lengths

    def padded_positions(trainer):  # over one epoch: what the micro-batches hold, padding included
        return sum(int(trainer.micro_batch(step, 0).input_ids.numel()) for step in range(trainer.steps_per_epoch))

    trainers = {strategy: SFTTrainer(model=tiny_model_dir, train_dataset=rows, args=sft_config(
        tmp_path / strategy, train_sampling_strategy=strategy, max_steps=2))
        for strategy in ("random", "sequential", "group_by_length")}
    assert trainers["sequential"].sampler.batch(0) == list(range(8))
    assert trainers["random"].sampler.batch(0) != list(range(8))
    grouped, shuffled = padded_positions(trainers["group_by_length"]), padded_positions(trainers["random"])
    assert grouped < 0.75 * shuffled, (grouped, shuffled)
    trainers["group_by_length"].train()  # and it trains
    # GRPO groups prompts by their length
    prompts = [{"prompt": "n" * (1 + (i * 5) % 30)} for i in range(32)]
    args = GRPOConfig(output_dir=str(tmp_path / "grpo"), per_device_train_batch_size=16, num_generations=4,
                      max_completion_length=4, max_steps=1, disable_tqdm=True, save_strategy="no",
                      train_sampling_strategy="group_by_length")
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=reward_length, args=args, train_dataset=prompts)
    assert trainer.prompt_sampler.lengths == [len(ids) for ids in trainer.train_prompt_ids]  # tokenized prompts
    first = [len(trainer.train_prompt_ids[i]) for i in trainer.prompt_sampler.batch(0)]
    assert max(first) == max(trainer.prompt_sampler.lengths)  # the longest round first, as transformers
    with pytest.raises(ConfigError, match="`train_sampling_strategy='batch_rebalance'`"):
        SFTConfig(train_sampling_strategy="batch_rebalance")


@pytest.mark.parametrize("strategy,first,logged", [
    ("steps", True, [1, 3, 6]), ("epoch", False, [3, 6, 7]), ("epoch", True, [1, 3, 6, 7]), ("no", False, []),
    ("no", True, [1])])
def test_logging_strategy_picks_the_logged_steps(tiny_model_dir, tmp_path, strategy, first, logged):
    """20 rows in global batches of 8: 3 steps per epoch; 7 steps end mid-epoch. As transformers: "steps" logs the
    multiples of logging_steps only (step 7 goes into train()'s closing record), "epoch" each epoch's end, the cut
    short last one's included. Each record averages the steps since the previous one."""
    trainer = SFTTrainer(model=tiny_model_dir, train_dataset=ROWS, args=sft_config(
        tmp_path, max_steps=7, logging_strategy=strategy, logging_steps=3, logging_first_step=first))
    trainer.train()
    history = step_records(trainer)
    assert [r["step"] for r in history] == logged
    if strategy == "epoch":
        assert [r["epoch"] for r in history][-3:] == [1.0, 2.0, pytest.approx(7 / 3, abs=1e-4)]
    assert trainer.state.global_step == 7
    with open(tmp_path / "out" / "metrics.jsonl") as f:
        assert len(f.readlines()) == len(logged) + 1  # and train()'s closing summary
    with pytest.raises(ConfigError, match="`logging_strategy='best'`"):
        SFTConfig(logging_strategy="best")


def test_log_level_sets_this_projects_and_transformers_loggers(tiny_model_dir, tmp_path):
    import logging

    from transformers.utils import logging as hf_logging

    ours, theirs = logging.getLogger("trainers").level, hf_logging.get_verbosity()
    try:
        SFTTrainer(model=tiny_model_dir, train_dataset=ROWS, args=sft_config(tmp_path))  # "passive": unchanged
        assert (logging.getLogger("trainers").level, hf_logging.get_verbosity()) == (ours, theirs)
        # the main process takes log_level; log_level_replica is for the others
        SFTTrainer(model=tiny_model_dir, train_dataset=ROWS,
                   args=sft_config(tmp_path, log_level="error", log_level_replica="debug"))
        assert logging.getLogger("trainers").level == hf_logging.get_verbosity() == logging.ERROR
    finally:
        logging.getLogger("trainers").setLevel(ours)
        hf_logging.set_verbosity(theirs)
    with pytest.raises(ConfigError, match="`log_level='loud'`"):
        GRPOConfig(log_level="loud")


@pytest.fixture
def restores_determinism(monkeypatch):
    """enable_full_determinism changes process-wide state: put it back after the test."""
    for name in ("CUDA_LAUNCH_BLOCKING", "CUBLAS_WORKSPACE_CONFIG", "ASCEND_LAUNCH_BLOCKING", "HCCL_DETERMINISTIC",
                 "FLASH_ATTENTION_DETERMINISTIC"):
        monkeypatch.delenv(name, raising=False)  # restored (or removed again) at teardown
    yield
    torch.use_deterministic_algorithms(False)


def test_full_determinism_turns_on_deterministic_algorithms_and_trains_equal_runs(tiny_model_dir, tmp_path,
                                                                                  restores_determinism):
    assert not torch.are_deterministic_algorithms_enabled()
    finals = []
    for run in range(2):
        trainer = SFTTrainer(model=tiny_model_dir, train_dataset=ROWS,
                             args=sft_config(tmp_path / str(run), full_determinism=True, max_steps=2))
        assert torch.are_deterministic_algorithms_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
        trainer.train()
        finals.append([p.detach().clone() for p in trainer.model.parameters()])
    for a, b in zip(*finals):
        assert torch.equal(a, b)
    # GRPO's sampling engine and log-probs run with deterministic algorithms enforced
    args = GRPOConfig(output_dir=str(tmp_path / "grpo"), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=4, max_steps=1, disable_tqdm=True, save_strategy="no",
                      full_determinism=True)
    GRPOTrainer(model=tiny_model_dir, reward_funcs=reward_length, args=args,
                train_dataset=[{"prompt": "count"}] * 4).train()


def test_tf32_is_refused_without_a_gpu_for_it_and_set_where_there_is_one(tiny_model_dir, tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"`tf32=True`.*Ampere"):
        SFTConfig(tf32=True)
    calls = []
    monkeypatch.setattr(trainers.loop.base, "enable_tf32", calls.append)
    SFTTrainer(model=tiny_model_dir, train_dataset=ROWS, args=sft_config(tmp_path, tf32=False))
    assert calls == []  # nothing to switch off on a CPU
    monkeypatch.setattr(trainers.config.training, "tf32_available", lambda: True)  # as on an Ampere GPU
    monkeypatch.setattr(trainers.loop.base, "tf32_available", lambda: True)
    SFTTrainer(model=tiny_model_dir, train_dataset=ROWS, args=sft_config(tmp_path, tf32=True))
    assert calls == [True]


def test_process_group_options_are_checked(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="`ddp_backend='tcp'`"):
        SFTConfig(ddp_backend="tcp")
    with pytest.raises(ConfigError, match="`ddp_timeout=0`"):
        GRPOConfig(ddp_timeout=0)
    with pytest.raises(ConfigError, match="`ddp_bucket_cap_mb=-1`"):
        SFTConfig(ddp_bucket_cap_mb=-1)
    with pytest.raises(DistributedError, match="ddp_backend='nccl' needs CUDA GPUs"):
        SFTTrainer(model=tiny_model_dir, train_dataset=ROWS, args=sft_config(tmp_path, ddp_backend="nccl"))
    assert SFTConfig(ddp_find_unused_parameters=False, ddp_static_graph=True).ddp_kwargs == {
        "find_unused_parameters": False, "static_graph": True}
