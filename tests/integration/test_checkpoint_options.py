"""transformers' checkpoint and evaluation options, end to end on a tiny model (one CPU process):
metric_for_best_model / greater_is_better / load_best_model_at_end, save_strategy="best", save_only_model,
include_num_input_tokens_seen, eval_delay, data_seed, torch_empty_cache_steps and eval_packing."""

import json
import os
import signal

import pytest
import torch
from peft import LoraConfig
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, TrainerCallback

import trainers.loop.base
from tests.conftest import config_factory, step_records
from trainers import SFTConfig, SFTTrainer
from trainers.errors import CheckpointError, ConfigError
from trainers.cli.tiny import as_sft_rows, reverse_digits_rows

ROWS = as_sft_rows(reverse_digits_rows(64))


config = config_factory(SFTConfig, per_device_train_batch_size=8, learning_rate=1e-3, max_steps=6)


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def checkpoints(tmp_path) -> list[str]:
    return sorted(name for name in os.listdir(tmp_path / "out") if name.startswith("checkpoint-"))


def saved_state(folder) -> dict:
    with open(os.path.join(folder, "trainer_state.json")) as f:
        return json.load(f)


@pytest.mark.parametrize("save_only_model,peft", [(False, False), (True, False), (True, True)])
def test_load_best_model_at_end_restores_the_best_checkpoint(tiny_model_dir, tmp_path, save_only_model, peft):
    # The eval loss falls at every evaluation, so "greater is better" makes the first one (step 2) the best:
    # the end of training must go back to it, and save_total_limit=1 keeps it (and drops the newest at the end).
    args = config(tmp_path, eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2,
                  save_total_limit=1, load_best_model_at_end=True, greater_is_better=True,
                  save_only_model=save_only_model)
    assert args.metric_for_best_model == "loss"  # transformers' default with load_best_model_at_end
    lora = LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM") if peft else None
    trainer = SFTTrainer(model=tiny_model_dir, args=args, train_dataset=ROWS, eval_dataset=ROWS[:16],
                         peft_config=lora)
    trainer.train()
    evals = [r["eval_loss"] for r in trainer.state.log_history if "eval_loss" in r]
    assert len(evals) == 3 and evals[0] > evals[1] > evals[2]
    assert trainer.state.best_global_step == 2
    assert trainer.state.best_metric == pytest.approx(evals[0], rel=1e-5)  # the log rounds to 6 digits
    assert trainer.state.best_model_checkpoint == str(tmp_path / "out" / "checkpoint-2")
    assert checkpoints(tmp_path) == ["checkpoint-2"]
    assert trainer.evaluate()["eval_loss"] == pytest.approx(trainer.state.best_metric, rel=1e-6)
    if peft:  # the checkpoint holds the adapter alone
        assert "adapter_model.safetensors" in os.listdir(tmp_path / "out" / "checkpoint-2")
        return
    if save_only_model:  # a Hugging Face folder: from_pretrained loads the same weights the trainer went back to
        best = weights(AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "checkpoint-2"))
    else:
        best = load_file(tmp_path / "out" / "checkpoint-2" / "model.safetensors")
    current = weights(trainer.unwrapped_model)
    for key, value in best.items():
        assert torch.equal(current[key], value), key


def test_the_best_checkpoint_survives_rotation_during_training(tiny_model_dir, tmp_path):
    args = config(tmp_path, eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2,
                  save_total_limit=1, metric_for_best_model="eval_loss", greater_is_better=True)
    trainer = SFTTrainer(model=tiny_model_dir, args=args, train_dataset=ROWS, eval_dataset=ROWS[:16])
    trainer.train()
    # without load_best_model_at_end the weights stay the last step's; the best and the newest are both kept
    # during training, and once it is over the newest goes (as in transformers)
    # (without the protection, save_total_limit=1 would have removed checkpoint-2 at step 4)
    assert checkpoints(tmp_path) == ["checkpoint-2"]
    assert trainer.evaluate()["eval_loss"] < trainer.state.best_metric


def test_save_strategy_best_saves_only_on_a_new_best(tiny_model_dir, tmp_path):
    args = config(tmp_path, eval_strategy="steps", eval_steps=2, save_strategy="best", metric_for_best_model="loss",
                  greater_is_better=True)  # only the first evaluation is a new best
    SFTTrainer(model=tiny_model_dir, args=args, train_dataset=ROWS, eval_dataset=ROWS[:16]).train()
    assert checkpoints(tmp_path) == ["checkpoint-2"]
    state = saved_state(tmp_path / "out" / "checkpoint-2")["state"]
    assert state["best_global_step"] == 2
    assert state["best_model_checkpoint"] == str(tmp_path / "out" / "checkpoint-2")
    # lower is better (the default for a loss): every evaluation improves, so every one saves
    args = config(tmp_path / "b", eval_strategy="steps", eval_steps=2, save_strategy="best",
                  metric_for_best_model="loss")
    assert args.greater_is_better is False
    SFTTrainer(model=tiny_model_dir, args=args, train_dataset=ROWS, eval_dataset=ROWS[:16]).train()
    assert checkpoints(tmp_path / "b") == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]


def test_an_unknown_metric_for_best_model_names_the_metrics_there_are(tiny_model_dir, tmp_path):
    args = config(tmp_path, eval_strategy="steps", eval_steps=2, metric_for_best_model="reward")
    trainer = SFTTrainer(model=tiny_model_dir, args=args, train_dataset=ROWS, eval_dataset=ROWS[:16])
    with pytest.raises(ConfigError, match=r"metric_for_best_model='reward'.*\['eval_loss', 'eval_mean_token_accuracy', 'eval_runtime'"):
        trainer.train()


def test_save_only_model_writes_a_loadable_model_that_cannot_be_resumed(tiny_model_dir, tmp_path):
    whole = SFTTrainer(model=tiny_model_dir, args=config(tmp_path / "whole", max_steps=2, save_strategy="steps",
                                                         save_steps=2), train_dataset=ROWS)
    whole.train()
    trainer = SFTTrainer(model=tiny_model_dir, args=config(tmp_path, max_steps=2, save_strategy="steps", save_steps=2,
                                                           save_only_model=True), train_dataset=ROWS)
    trainer.train()
    folder = tmp_path / "out" / "checkpoint-2"
    files = set(os.listdir(folder))
    assert {"config.json", "model.safetensors", "tokenizer.json", "trainer_state.json"} <= files
    assert not any(name.startswith(("optimizer", "scheduler", "random_states")) for name in files)
    assert saved_state(folder)["model_only"] is True
    size = lambda root: sum(os.path.getsize(os.path.join(root, f)) for f in os.listdir(root))  # noqa: E731
    assert size(folder) < 0.5 * size(tmp_path / "whole" / "out" / "checkpoint-2")  # AdamW keeps 2 floats a weight
    loaded = weights(AutoModelForCausalLM.from_pretrained(folder))
    for key, value in weights(trainer.unwrapped_model).items():
        assert torch.equal(loaded[key], value), key
    again = SFTTrainer(model=tiny_model_dir, args=config(tmp_path, max_steps=4), train_dataset=ROWS)
    for resume in (str(folder), True):
        with pytest.raises(CheckpointError, match="save_only_model=True.*cannot resume"):
            if resume is True:
                with pytest.warns(UserWarning, match="Skipping"):
                    again.train(resume_from_checkpoint=resume)
            else:
                again.train(resume_from_checkpoint=resume)
    # a stop (signal, non-finite steps) needs a checkpoint to resume from: it is whole even with save_only_model.
    # SIGTERM during step 2: the step ends, its model-only checkpoint is written, then the stop's whole one over it
    stopped = SFTTrainer(model=tiny_model_dir, args=config(tmp_path / "stopped", max_steps=4, save_strategy="steps",
                                                           save_steps=2, save_only_model=True),
                         train_dataset=ROWS, callbacks=[SignalDuring(step=2)])
    with pytest.raises(SystemExit) as stop:
        stopped.train()
    assert stop.value.code == 128 + signal.SIGTERM
    folder = tmp_path / "stopped" / "out" / "checkpoint-2"
    assert "model_only" not in saved_state(folder)
    resumed = SFTTrainer(model=tiny_model_dir, args=config(tmp_path / "stopped", max_steps=3), train_dataset=ROWS)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 3


class SignalDuring(TrainerCallback):
    """Sends this process SIGTERM as step ``step`` (1-based) begins; the trainer stops after it."""

    def __init__(self, step: int):
        self.step = step

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.step - 1:
            signal.raise_signal(signal.SIGTERM)


@pytest.mark.parametrize("mode", ["no", "non_padding", "all", True])
def test_include_num_input_tokens_seen(tiny_model_dir, tmp_path, mode):
    rows = as_sft_rows(reverse_digits_rows(64, length=3) + reverse_digits_rows(64, length=7, seed=1))  # 2 widths
    trainer = SFTTrainer(model=tiny_model_dir, args=config(tmp_path, max_steps=4, include_num_input_tokens_seen=mode),
                         train_dataset=rows)
    trainer.train()
    history = step_records(trainer)
    if mode == "no":
        assert all("num_input_tokens_seen" not in r for r in history)
        return
    seen = [r["num_input_tokens_seen"] for r in history]
    if mode == "non_padding":
        assert seen == [r["num_tokens"] for r in history]
        return
    # "all" (True maps to it) counts every position fed to the model, padding included: rows x padded width
    padded = [trainer.micro_batch(step, 0).input_ids.numel() for step in range(4)]
    assert seen == [sum(padded[:k + 1]) for k in range(4)]
    assert seen[-1] > history[-1]["num_tokens"]  # some rows were padded


def test_eval_delay_skips_the_early_evaluations(tiny_model_dir, tmp_path):
    args = config(tmp_path, max_steps=5, eval_strategy="steps", eval_steps=1, eval_delay=3)
    trainer = SFTTrainer(model=tiny_model_dir, args=args, train_dataset=ROWS, eval_dataset=ROWS[:8])
    trainer.train()
    assert [r["step"] for r in trainer.state.log_history if "eval_loss" in r] == [3, 4, 5]


def test_data_seed_sets_the_data_order_apart_from_seed(tiny_model_dir, tmp_path):
    def first_batch(**seeds):
        trainer = SFTTrainer(model=tiny_model_dir, args=config(tmp_path, **seeds), train_dataset=ROWS)
        return trainer.micro_batch(0, 0).input_ids

    assert torch.equal(first_batch(seed=0, data_seed=5), first_batch(seed=1, data_seed=5))
    assert not torch.equal(first_batch(seed=0, data_seed=5), first_batch(seed=0, data_seed=6))
    assert torch.equal(first_batch(seed=3), first_batch(seed=0, data_seed=3))  # None: the data follow seed


def test_torch_empty_cache_steps_clears_the_cache_every_n_steps(tiny_model_dir, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(trainers.loop.base, "clear_device_cache", lambda: calls.append(1))
    trainer = SFTTrainer(model=tiny_model_dir, args=config(tmp_path, max_steps=5, torch_empty_cache_steps=2),
                         train_dataset=ROWS)
    trainer.train()
    assert len(calls) == 2  # after steps 2 and 4


def test_grpo_keeps_and_loads_the_best_reward(tiny_model_dir, tmp_path):
    from tests.integration.test_grpo import PROMPTS, digits
    from tests.integration.test_grpo import config as grpo_config
    from trainers import GRPOTrainer

    args = grpo_config(tmp_path, max_steps=4, eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=8,
                       save_strategy="best", metric_for_best_model="rewards/digits/mean",
                       load_best_model_at_end=True, include_num_input_tokens_seen="all")
    assert args.greater_is_better is True
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=digits, train_dataset=PROMPTS, eval_dataset=PROMPTS[:3],
                          args=args)
    trainer.train()
    evals = [(r["step"], r["eval_rewards/digits/mean"]) for r in trainer.state.log_history if "eval_reward" in r]
    improved, best = [], float("-inf")
    for step, value in evals:
        if value > best:
            improved.append(step)
            best = value
    assert checkpoints(tmp_path) == [f"checkpoint-{step}" for step in improved]  # saved on each new best only
    assert trainer.state.best_global_step == improved[-1]
    saved = load_file(tmp_path / "out" / f"checkpoint-{improved[-1]}" / "model.safetensors")
    current = weights(trainer.unwrapped_model)
    for key, value in saved.items():
        assert torch.equal(current[key], value), key
    # TRL's GRPO counts the real prompt and completion tokens, whatever include_num_input_tokens_seen says
    train_records = [r for r in trainer.state.log_history if "loss" in r]
    assert [r["num_input_tokens_seen"] for r in train_records] == [r["num_tokens"] for r in train_records]


def test_a_best_evaluation_without_a_checkpoint_is_said_not_skipped(tiny_model_dir, tmp_path, caplog):
    # the evaluation before training is the best (greater loss is "better"), and no checkpoint holds step 0
    args = config(tmp_path, max_steps=2, eval_on_start=True, eval_strategy="steps", eval_steps=2,
                  save_strategy="steps", save_steps=2, load_best_model_at_end=True, greater_is_better=True)
    trainer = SFTTrainer(model=tiny_model_dir, args=args, train_dataset=ROWS, eval_dataset=ROWS[:16])
    trainer.train()
    assert trainer.state.best_global_step == 0 and trainer.state.best_model_checkpoint is None
    assert "no checkpoint holds the best evaluation (loss" in caplog.text


@pytest.mark.parametrize("packing,eval_packing,packed", [(True, None, True), (True, False, False),
                                                        (False, True, True), (False, None, False)])
def test_eval_packing_packs_the_eval_rows_for_the_same_loss(tiny_model_dir, tmp_path, packing, eval_packing, packed):
    trainer = SFTTrainer(model=tiny_model_dir, train_dataset=ROWS, eval_dataset=ROWS[:24],
                         args=config(tmp_path, packing=packing, eval_packing=eval_packing, max_length=64))
    assert all(("position_ids" in row) == packed for row in trainer.eval_rows)
    assert (len(trainer.eval_rows) < 24) == packed  # several short rows per packed row
    unpacked = SFTTrainer(model=tiny_model_dir, train_dataset=ROWS, eval_dataset=ROWS[:24],
                          args=config(tmp_path, max_length=64)).evaluate()
    assert trainer.evaluate()["eval_loss"] == pytest.approx(unpacked["eval_loss"], rel=1e-5)
