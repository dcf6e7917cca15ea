"""Streamed datasets (datasets.IterableDataset) in both trainers, skip_prepare_dataset, dataloader_num_workers, and
the train_dataset / eval_dataset attributes, one CPU process (tests/distributed/test_streaming_distributed.py: 2)."""

import logging

import pytest
import torch
from datasets import Dataset, IterableDatasetDict
from transformers import TrainerCallback

import trainers.data.streaming
from tests.conftest import digits, step_records
from trainers import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer
from trainers.errors import CheckpointError, ConfigError, DatasetFormatError
from trainers.cli.tiny import as_sft_rows, reverse_digits_rows

ROWS = as_sft_rows(reverse_digits_rows(20, seed=1))
PROMPTS = [{"prompt": p} for p in ["abc", "hello", "xyz", "12", "the", "cat", "sat", "on", "mat", "dog"]]


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """Chunks of 7 raw rows, so that batches span chunks (and, with 20 rows, passes over the stream)."""
    monkeypatch.setattr(trainers.data.streaming, "CHUNK_ROWS", 7)


def sft_config(tmp_path, **overrides):
    base = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                learning_rate=1e-3, max_steps=4, logging_steps=1, save_strategy="no", disable_tqdm=True, seed=0,
                shuffle_dataset=False)
    return SFTConfig(**{**base, **overrides})


def grpo_config(tmp_path, **overrides):
    base = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4,
                max_completion_length=6, steps_per_generation=2, learning_rate=1e-2, max_steps=4, logging_steps=1,
                save_strategy="no", disable_tqdm=True, seed=0, shuffle_dataset=False)
    return GRPOConfig(**{**base, **overrides})


def stream(rows, shards: int = 1):
    return Dataset.from_list(rows).to_iterable_dataset(num_shards=shards)


def weights(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.unwrapped_model.state_dict().items()}


def assert_same_weights(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def losses(trainer) -> list[float]:
    return [r["loss"] for r in step_records(trainer) if "loss" in r]


class RecordingSFT(SFTTrainer):
    """SFTTrainer (micro_batch overridden, as a subclass may) that keeps the token ids of every row each
    micro-batch trains on, in order, padding removed: ``seen``, a list per micro-batch."""

    def micro_batch(self, step, accumulation_index):
        batch = super().micro_batch(step, accumulation_index)
        rows = [row[mask.bool()].tolist() for row, mask in zip(batch.input_ids, batch.attention_mask)]
        self.__dict__.setdefault("seen", []).append(rows)
        return batch


class StopAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        control.should_training_stop = state.global_step >= self.step


# ---------------------------------------------------------------------------------------------- SFT


@pytest.mark.parametrize("workers", [0, 2])
def test_a_streamed_sft_run_equals_the_same_rows_in_memory_in_order(tiny_model_dir, tmp_path, workers):
    """16 rows = 2 global batches of 8: the stream's first pass is the map-style run's first epoch."""
    in_memory = RecordingSFT(model=tiny_model_dir, args=sft_config(tmp_path, max_steps=2), train_dataset=ROWS[:16])
    in_memory.train()
    streamed = RecordingSFT(model=tiny_model_dir, args=sft_config(tmp_path, max_steps=2, dataloader_num_workers=workers),
                            train_dataset=stream(ROWS[:16], shards=2))
    streamed.train()
    memory_rows, stream_rows = in_memory.seen, streamed.seen
    assert stream_rows == memory_rows and len(stream_rows) == 4
    assert losses(streamed) == losses(in_memory)
    assert_same_weights(weights(streamed), weights(in_memory))
    assert streamed.state.epoch == 1.0  # as transformers: with a stream, max_steps is one "epoch"


def test_a_stream_is_read_on_into_its_next_pass(tiny_model_dir, tmp_path, tokenizer):
    trainer = RecordingSFT(model=tiny_model_dir, args=sft_config(tmp_path, max_steps=3), train_dataset=stream(ROWS))
    trainer.train()
    texts = [tokenizer.decode(ids) for micro in trainer.seen for ids in micro]
    expected = [row["prompt"] + row["completion"] + tokenizer.eos_token for row in ROWS]
    assert texts == expected + expected[:4]  # 24 rows: the 20 of the stream, then its first 4 again


def test_a_stream_needs_max_steps_and_its_own_order(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="max_steps > 0"):
        SFTTrainer(model=tiny_model_dir, args=sft_config(tmp_path, max_steps=-1), train_dataset=stream(ROWS))
    with pytest.raises(ConfigError, match="group_by_length"):
        SFTTrainer(model=tiny_model_dir, args=sft_config(tmp_path, train_sampling_strategy="group_by_length"),
                   train_dataset=stream(ROWS))
    with pytest.raises(DatasetFormatError, match=r"pass one split, e.g. train_dataset=dataset\['train'\]"):
        SFTTrainer(model=tiny_model_dir, args=sft_config(tmp_path), train_dataset=IterableDatasetDict(
            {"train": stream(ROWS)}))
    with pytest.raises(ConfigError, match="max_steps > 0"):
        GRPOTrainer(model=tiny_model_dir, reward_funcs=digits, args=grpo_config(tmp_path, max_steps=-1),
                    train_dataset=stream(PROMPTS))


def test_a_malformed_streamed_row_is_named_before_training(tiny_model_dir, tmp_path):
    rows = [dict(row) for row in ROWS]
    rows[3]["completion"] = None
    with pytest.raises(DatasetFormatError, match="train_dataset row 3"):
        SFTTrainer(model=tiny_model_dir, args=sft_config(tmp_path), train_dataset=stream(rows))


def test_sft_resumed_mid_stream_sees_the_rows_and_reaches_the_weights_of_an_uninterrupted_run(tiny_model_dir,
                                                                                             tmp_path):
    """A shuffled stream (reshuffled each pass), a checkpoint mid-chunk and mid-pass, 2 workers preparing ahead."""
    def run(folder, stop=None, resume=None):
        data = stream(ROWS, shards=2).shuffle(seed=3, buffer_size=6)
        trainer = RecordingSFT(model=tiny_model_dir, train_dataset=data, callbacks=[StopAt(stop)] if stop else None,
                               args=sft_config(tmp_path, output_dir=str(tmp_path / folder), max_steps=6,
                                               save_strategy="steps", save_steps=3, dataloader_num_workers=2))
        trainer.train(resume_from_checkpoint=resume)
        return trainer, trainer.seen

    straight, straight_rows = run("straight")
    _, first_rows = run("split", stop=3)
    resumed, resumed_rows = run("split2", resume=str(tmp_path / "split" / "checkpoint-3"))
    assert first_rows + resumed_rows == straight_rows and len(straight_rows) == 12  # 48 rows: 2 passes and more
    assert_same_weights(weights(resumed), weights(straight))
    assert losses(resumed)[-3:] == losses(straight)[-3:]


SFT_DISPATCH_WARNING = ("You are using an `IterableDataset` for training with `dispatch_batches=True`. "
                        "`dispatch_batches` is forced to `False` when using an `IterableDataset`. To remove this "
                        "warning, unset `dispatch_batches` in `SFTConfig` or set it to `False`.")


def test_a_streamed_train_set_turns_dispatch_batches_off_and_keeps_its_workers_as_trls_sft(tiny_model_dir, tmp_path,
                                                                                           caplog):
    """TRL's SFTTrainer: an IterableDataset as train_dataset forces accelerator_config's dispatch_batches=True to
    False, with its warning, and leaves dataloader_num_workers as given (TRL's GRPOTrainer refuses dispatch_batches
    and sets the workers to 0 instead; its SFTTrainer does neither). A streamed eval_dataset beside a map-style
    train_dataset changes neither."""
    options = dict(dataloader_num_workers=2, accelerator_config={"dispatch_batches": True})
    with caplog.at_level(logging.WARNING, logger="trainers"):
        streamed = SFTTrainer(model=tiny_model_dir, args=sft_config(tmp_path, **options), train_dataset=stream(ROWS))
    warnings = [r.getMessage() for r in caplog.records if "dispatch_batches" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith(SFT_DISPATCH_WARNING)
    assert streamed.args.accelerator_config["dispatch_batches"] is False
    # the threads preparing the stream ahead: as many as dataloader_num_workers
    assert streamed.args.dataloader_num_workers == 2 and streamed.train_batches.workers == 2
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trainers"):
        eval_only = SFTTrainer(model=tiny_model_dir, args=sft_config(tmp_path, **options), train_dataset=ROWS,
                               eval_dataset=stream(ROWS[:4]))
    assert not [r for r in caplog.records if "dispatch_batches" in r.getMessage()]
    assert eval_only.args.accelerator_config["dispatch_batches"] is True
    assert eval_only.args.dataloader_num_workers == 2


def test_a_map_style_checkpoint_does_not_resume_a_stream(tiny_model_dir, tmp_path):
    SFTTrainer(model=tiny_model_dir, train_dataset=ROWS, args=sft_config(
        tmp_path, max_steps=1, save_strategy="steps", save_steps=1)).train()
    trainer = SFTTrainer(model=tiny_model_dir, train_dataset=stream(ROWS), args=sft_config(tmp_path, max_steps=2))
    with pytest.raises(CheckpointError, match="records no position in a streamed train_dataset"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-1"))


def test_streamed_eval_datasets_are_read_whole(tiny_model_dir, tmp_path):
    eval_rows = as_sft_rows(reverse_digits_rows(6, seed=9))
    args = sft_config(tmp_path, max_steps=1, per_device_eval_batch_size=4)
    in_memory = SFTTrainer(model=tiny_model_dir, args=args, train_dataset=ROWS, eval_dataset=eval_rows)
    streamed = SFTTrainer(model=tiny_model_dir, args=args, train_dataset=stream(ROWS),
                          eval_dataset=stream(eval_rows, shards=2))
    expected = in_memory.evaluate()["eval_loss"]
    assert streamed.evaluate()["eval_loss"] == pytest.approx(expected, rel=1e-6)
    assert in_memory.evaluate(stream(eval_rows))["eval_loss"] == pytest.approx(expected, rel=1e-6)
    named = SFTTrainer(model=tiny_model_dir, args=args, train_dataset=ROWS, eval_dataset=IterableDatasetDict(
        {"digits": stream(eval_rows), "more": stream(ROWS[:3])}))
    metrics = named.evaluate()
    assert metrics["eval_digits_loss"] == pytest.approx(expected, rel=1e-6) and "eval_more_loss" in metrics
    assert set(named.eval_dataset) == {"digits", "more"} and len(named.eval_dataset["more"]) == 3


# ---------------------------------------------------------------------------------------------- GRPO


def test_a_streamed_grpo_run_equals_the_same_prompts_in_memory_in_order(tiny_model_dir, tmp_path):
    """10 prompts, 2 per round (8 completions, 4 each), 2 steps per round: 4 steps use 4 prompts of one pass."""
    in_memory = GRPOTrainer(model=tiny_model_dir, reward_funcs=digits, args=grpo_config(tmp_path),
                            train_dataset=PROMPTS)
    in_memory.train()
    streamed = GRPOTrainer(model=tiny_model_dir, reward_funcs=digits, args=grpo_config(tmp_path),
                           train_dataset=stream(PROMPTS))
    streamed.train()
    assert [r.get("reward") for r in step_records(streamed)] == [r.get("reward") for r in step_records(in_memory)]
    assert losses(streamed) == losses(in_memory)
    assert_same_weights(weights(streamed), weights(in_memory))
    assert streamed.train_dataset is not None and not isinstance(streamed.train_dataset, Dataset)  # as given


def test_grpo_resumed_mid_stream_equals_an_uninterrupted_run(tiny_model_dir, tmp_path):
    """A checkpoint in the middle of a round (2 steps per round) and of the second pass over 10 prompts."""
    def run(folder, stop=None, resume=None):
        seen = []  # each round's distinct prompts, as the reward functions see them

        def digits_recording(prompts, completions, **kwargs):
            seen.append(list(dict.fromkeys(prompts)))
            return digits(completions=completions, **kwargs)

        trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=digits_recording, train_dataset=stream(PROMPTS),
                              callbacks=[StopAt(stop)] if stop else None,
                              args=grpo_config(tmp_path, output_dir=str(tmp_path / folder), max_steps=12,
                                               save_strategy="steps", save_steps=5))
        trainer.train(resume_from_checkpoint=resume)
        return trainer, seen

    straight, straight_prompts = run("straight")
    _, first = run("split", stop=5)
    resumed, rest = run("split2", resume=str(tmp_path / "split" / "checkpoint-5"))
    order = [row["prompt"] for row in PROMPTS]
    assert straight_prompts == [order[i:i + 2] for i in range(0, 10, 2)] + [order[0:2]]  # into a second pass
    assert first + rest == straight_prompts  # round 2 came back from the checkpoint, not rebuilt
    assert_same_weights(weights(resumed), weights(straight))
    assert [r.get("reward") for r in step_records(resumed)][-7:] == [r.get("reward") for r in step_records(straight)][-7:]


def test_grpo_evaluates_a_streamed_eval_dataset(tiny_model_dir, tmp_path):
    eval_prompts = stream(PROMPTS[:3])
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=digits, train_dataset=stream(PROMPTS),
                          eval_dataset=eval_prompts, args=grpo_config(tmp_path, per_device_eval_batch_size=4))
    assert trainer.eval_dataset is eval_prompts and [r["prompt"] for r in trainer.eval_rows] == ["abc", "hello", "xyz"]
    assert "eval_reward" in trainer.evaluate()


# ---------------------------------------------------------------------------------------------- skip_prepare_dataset


def test_skip_prepare_dataset_trains_on_the_rows_as_given(tiny_model_dir, tmp_path):
    """No EOS, no truncation (max_length=4 is not applied), 'labels' honoured, 'seq_lengths' keeping packed
    sequences apart; the same from a stream."""
    given = [{"input_ids": [5, 6, 7, 8, 9, 10]}, {"input_ids": [11, 12, 13], "labels": [-100, -100, 13]},
             {"input_ids": [14, 15, 16, 17], "seq_lengths": [2, 2]}, {"input_ids": [18, 19]}]
    given = [{"labels": None, "seq_lengths": None, **row} for row in given]  # every row has every column
    args = sft_config(tmp_path, max_steps=1, max_length=4, per_device_train_batch_size=2,
                      dataset_kwargs={"skip_prepare_dataset": True})
    for data in (given, stream(given)):
        trainer = SFTTrainer(model=tiny_model_dir, args=args, train_dataset=data)
        batches = [trainer.micro_batch(0, a) for a in range(2)]
        first, second = batches
        pad = trainer.processing_class.pad_token_id
        assert first.input_ids.tolist() == [[5, 6, 7, 8, 9, 10], [11, 12, 13, pad, pad, pad]]
        assert first.target_ids.tolist() == [[6, 7, 8, 9, 10, -100], [-100, 13, -100, -100, -100, -100]]
        assert second.input_ids.tolist() == [[14, 15, 16, 17], [18, 19, pad, pad]]
        assert second.target_ids.tolist() == [[15, -100, 17, -100], [19, -100, -100, -100]]
        assert second.position_ids.tolist() == [[0, 1, 0, 1], [0, 1, 0, 1]]  # packed rows: positions restart
    assert trainer.train()[0] == 1


def test_skip_prepare_dataset_refuses_what_it_cannot_use(tiny_model_dir, tmp_path):
    args = sft_config(tmp_path, dataset_kwargs={"skip_prepare_dataset": True})
    with pytest.raises(DatasetFormatError, match=r"train_dataset row 0 has no 'input_ids'.*skip_prepare_dataset"):
        SFTTrainer(model=tiny_model_dir, args=args, train_dataset=ROWS)
    with pytest.raises(DatasetFormatError, match="'completion_mask'.*but no 'labels'"):
        SFTTrainer(model=tiny_model_dir, args=args, train_dataset=[{"input_ids": [5, 6], "completion_mask": [0, 1]}])
    with pytest.raises(ConfigError, match="only key is 'skip_prepare_dataset'"):
        SFTConfig(dataset_kwargs={"skip_prepare": True})
    with pytest.raises(ConfigError, match="packing"):
        SFTConfig(dataset_kwargs={"skip_prepare_dataset": True}, packing=True)


# ---------------------------------------------------------------------------------------------- attributes


def test_sft_train_and_eval_datasets_are_the_prepared_rows(tiny_model_dir, tmp_path, tokenizer):
    rows = [{"prompt": "0123456789" * 3, "completion": "9"}] + ROWS[:5]  # the first is all prompt at max_length 16
    trainer = SFTTrainer(model=tiny_model_dir, args=sft_config(tmp_path, max_length=16), train_dataset=rows,
                         eval_dataset={"a": ROWS[:2], "b": ROWS[2:5]})
    prepared = trainer.train_dataset
    assert isinstance(prepared, Dataset) and prepared.column_names == ["input_ids", "labels"]
    assert len(prepared) == 5  # the over-long prompt left nothing to train on: dropped, as TRL drops it
    first = tokenizer(ROWS[0]["prompt"] + ROWS[0]["completion"] + tokenizer.eos_token)["input_ids"]
    assert prepared[0]["input_ids"] == first
    prompt_length = len(tokenizer(ROWS[0]["prompt"])["input_ids"])
    assert prepared[0]["labels"] == [-100] * prompt_length + first[prompt_length:]  # the completion only
    assert {name: len(d) for name, d in trainer.eval_dataset.items()} == {"a": 2, "b": 3}
    packed = SFTTrainer(model=tiny_model_dir, args=sft_config(tmp_path, max_length=64, packing=True),
                        train_dataset=ROWS)
    assert packed.train_dataset.column_names == ["input_ids", "labels", "seq_lengths"]
    assert sum(map(sum, packed.train_dataset["seq_lengths"])) == sum(map(len, trainer.train_dataset["input_ids"])) \
        + sum(len(tokenizer(r["prompt"] + r["completion"] + tokenizer.eos_token)["input_ids"]) for r in ROWS[5:])
    data = stream(ROWS)
    assert SFTTrainer(model=tiny_model_dir, args=sft_config(tmp_path), train_dataset=data).train_dataset is data


def test_grpo_keeps_its_datasets_as_given(tiny_model_dir, tmp_path):
    evals = {"x": PROMPTS[:2], "y": PROMPTS[2:4]}
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=digits, args=grpo_config(tmp_path),
                          train_dataset=PROMPTS, eval_dataset=evals)
    assert trainer.train_dataset is PROMPTS
    assert trainer.eval_dataset == evals and trainer.eval_dataset["x"] is evals["x"]


# ---------------------------------------------------------------------------------------------- DPO, KTO, reward


@pytest.mark.parametrize("method", ["dpo", "kto", "reward"])
def test_a_streamed_preference_run_equals_the_same_rows_in_memory_in_order(method, tiny_model_dir, tmp_path):
    """The preference trainers read a stream a chunk at a time, as SFT does: 16 rows in order, 2 steps of 8, the
    same losses and weights as the rows in memory (sequential order); a stream with precompute_ref_log_probs is
    refused, as in TRL."""
    from trainers import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer, RewardConfig, RewardTrainer

    pairs = [{"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1)}
             for a in range(4) for b in range(4)]
    if method == "kto":
        pairs = [{"prompt": p["prompt"], "completion": p[side], "label": side == "chosen"}
                 for p in pairs[:8] for side in ("chosen", "rejected")]
    Trainer, Config = {"dpo": (DPOTrainer, DPOConfig), "kto": (KTOTrainer, KTOConfig),
                       "reward": (RewardTrainer, RewardConfig)}[method]
    options = dict(per_device_train_batch_size=8, learning_rate=1e-2, max_steps=2, logging_steps=1,
                   save_strategy="no", disable_tqdm=True, seed=0, report_to="none",
                   train_sampling_strategy="sequential")
    in_memory = Trainer(model=tiny_model_dir, train_dataset=pairs, args=Config(output_dir=str(tmp_path / "m"),
                                                                               **options))
    in_memory.train()
    streamed = Trainer(model=tiny_model_dir, train_dataset=stream(pairs, shards=2),
                       args=Config(output_dir=str(tmp_path / "s"), **options))
    assert streamed.train_dataset is not None
    streamed.train()
    assert losses(streamed) == pytest.approx(losses(in_memory), rel=1e-6) and len(losses(streamed)) == 2
    for key, value in weights(in_memory).items():
        torch.testing.assert_close(weights(streamed)[key], value, rtol=1e-6, atol=1e-7)
    if method != "reward":
        refused = r"precompute_ref_log_probs=True` is not supported with IterableDataset \(train_dataset is streamed\)"
        with pytest.raises(ConfigError, match=refused):
            Trainer(model=tiny_model_dir, train_dataset=stream(pairs), args=Config(
                output_dir=str(tmp_path / "p"), precompute_ref_log_probs=True, **options))
