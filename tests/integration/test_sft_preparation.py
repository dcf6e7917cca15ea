"""SFT's dataset preparation as TRL 1.16's SFTTrainer._prepare_dataset does it, on the tiny model, one CPU process:
a 'labels' column kept as given (any format), completion_only_loss=None resolved from the training rows (so a
pre-tokenized 'completion_mask' applies only with completion_only_loss=True or prompt/completion columns), rows
dropped after truncation only when all their labels are -100, the prepared labels (trainer.train_dataset) with each
sequence's first label, datasets with a transform, and padding_free with a max_length.

The expected rows were recorded from TRL's SFTTrainer on the same model and rows; test_records_are_trls runs TRL
again where it is installed (the bench extra)."""

import pytest
from datasets import Dataset

from tests.conftest import config_factory
from trainers import SFTConfig, SFTTrainer
from trainers.errors import ConfigError, DatasetFormatError
from trainers.sft.tokenize import IGNORE

# name: (train rows, eval rows or None, options, TRL's prepared train rows, TRL's prepared eval rows or None); a
# prepared row is (input_ids, labels) or, packed, (input_ids, labels, seq_lengths). The tiny tokenizer is
# byte-level: "a" is 64, ..., "<|im_end|>" (EOS) 256.
MASKED_AND_ONE = [{"input_ids": [5, 6, 7, 8], "completion_mask": [0, 0, 0, 0]},
                  {"input_ids": [5, 6], "completion_mask": [0, 1]}]
CASES = {
    # a 'labels' column is left as it is, whatever the format (TRL builds labels only without one)
    "labels_prompt_completion": ([{"prompt": "ab", "completion": "cd", "labels": [-100, 65, -100, 67, 256]}], None,
                                 {"max_length": None}, [([64, 65, 66, 67, 256], [-100, 65, -100, 67, 256])], None),
    "labels_text": ([{"text": "ab", "labels": [64, -100, 256]}], None, {}, [([64, 65, 256], [64, -100, 256])], None),
    "labels_over_masks": ([{"input_ids": [5, 6, 7, 8], "labels": [5, 6, -100, 8], "completion_mask": [0, 0, 1, 1]}],
                          None, {"completion_only_loss": True}, [([5, 6, 7, 8], [5, 6, -100, 8])], None),
    # completion_only_loss=None is False without prompt/completion columns: the completion_mask does not apply.
    # Issue 42's example: [[6, 7, 8]] after keep_end truncation (here it was [[-100, 7, 8]])
    "mask_ignored_keep_end": ([{"input_ids": [5, 6, 7, 8], "completion_mask": [0, 1, 1, 1]}], None,
                              {"max_length": 3, "truncation_mode": "keep_end"}, [([6, 7, 8], [6, 7, 8])], None),
    "mask_ignored": ([{"input_ids": [5, 6, 7, 8], "completion_mask": [0, 0, 1, 1]}], None, {},
                     [([5, 6, 7, 8], [5, 6, 7, 8])], None),
    "mask_with_prompt_completion_columns": (
        [{"input_ids": [5, 6, 7, 8], "completion_mask": [0, 1, 1, 1], "prompt": "x", "completion": "y"}], None, {},
        [([5, 6, 7, 8], [-100, 6, 7, 8])], None),
    # resolved from the training rows, the value applies to eval rows too: prompt/completion eval rows beside a
    # text train set are trained whole
    "eval_follows_train": ([{"text": "ab"}], [{"prompt": "ab", "completion": "cd"}], {},
                           [([64, 65, 256], [64, 65, 256])], [([64, 65, 66, 67, 256], [64, 65, 66, 67, 256])]),
    # after truncation a row is dropped when all its labels are -100; a label on the first token alone keeps it
    "dropped_after_truncation": (
        [{"input_ids": [5, 6, 7, 8], "completion_mask": [1, 0, 0, 0]},
         {"input_ids": [5, 6, 7, 8], "completion_mask": [0, 0, 0, 1]},
         {"input_ids": [9, 10, 11, 12], "completion_mask": [0, 1, 1, 1]}], None,
        {"max_length": 3, "completion_only_loss": True},
        [([5, 6, 7], [5, -100, -100]), ([9, 10, 11], [-100, 10, 11])], None),
    # no truncation (max_length=None) or packing: nothing is dropped
    "kept_without_max_length": (
        MASKED_AND_ONE,
        None, {"max_length": None, "completion_only_loss": True},
        [([5, 6, 7, 8], [-100, -100, -100, -100]), ([5, 6], [-100, 6])], None),
    "kept_when_packing": (
        MASKED_AND_ONE,
        None, {"max_length": 8, "packing": True, "completion_only_loss": True},
        [([5, 6, 7, 8, 5, 6], [-100, -100, -100, -100, -100, 6], [4, 2])], None),
}


config = config_factory(SFTConfig, max_steps=1, shuffle_dataset=False)


def as_records(dataset) -> list[tuple]:
    """A prepared dataset's rows as (input_ids, labels[, seq_lengths]) tuples (TRL's keeps other columns too)."""
    keys = ["input_ids", "labels"] + (["seq_lengths"] if "seq_lengths" in dataset.column_names else [])
    return [tuple(row[key] for key in keys) for row in dataset]


@pytest.mark.parametrize("name", CASES)
def test_prepared_rows_are_trls(tiny_model_dir, tmp_path, name):
    rows, eval_rows, options, expected, expected_eval = CASES[name]
    trainer = SFTTrainer(model=tiny_model_dir, args=config(tmp_path, **options), train_dataset=rows,
                         eval_dataset=eval_rows)
    assert as_records(trainer.train_dataset) == expected
    if expected_eval is not None:
        assert as_records(trainer.eval_dataset) == expected_eval


@pytest.mark.parametrize("name", CASES)
def test_records_are_trls(tiny_model_dir, tmp_path, name):
    trl = pytest.importorskip("trl")
    rows, eval_rows, options, expected, expected_eval = CASES[name]
    args = trl.SFTConfig(output_dir=str(tmp_path / "trl"), report_to="none", use_cpu=True, bf16=False,
                         shuffle_dataset=False, **options)
    trainer = trl.SFTTrainer(model=tiny_model_dir, args=args, train_dataset=Dataset.from_list(rows),
                             eval_dataset=Dataset.from_list(eval_rows) if eval_rows else None)
    assert as_records(trainer.train_dataset) == expected
    if expected_eval is not None:
        assert as_records(trainer.eval_dataset) == expected_eval


def test_what_the_prepared_rows_train(tiny_model_dir, tmp_path):
    """The targets behind the rows above: the ignored completion_mask trains every token; a row kept for its first
    label alone trains nothing (nothing predicts a first token), as in TRL, whose loss shifts the labels."""
    rows, _, options, _, _ = CASES["mask_ignored"]
    trainer = SFTTrainer(model=tiny_model_dir, args=config(tmp_path, **options), train_dataset=rows)
    assert trainer.train_rows[0]["target_ids"] == [6, 7, 8, IGNORE]
    assert trainer.completion_only_loss is False  # TRL's attribute, resolved
    rows, _, options, _, _ = CASES["dropped_after_truncation"]
    trainer = SFTTrainer(model=tiny_model_dir, args=config(tmp_path, **options), train_dataset=rows)
    assert [r["target_ids"] for r in trainer.train_rows] == [[IGNORE] * 3, [10, 11, IGNORE]]
    trainer.train()  # the row with nothing to train takes its place in the batch and adds no loss


def test_a_labels_column_must_match_the_tokens(tiny_model_dir, tmp_path):
    with pytest.raises(DatasetFormatError, match=r"'labels' has 4 entries but the row tokenizes to 5 tokens: a "
                                                 r"'labels' column is used as the labels"):
        SFTTrainer(model=tiny_model_dir, args=config(tmp_path, max_length=None),
                   train_dataset=[{"prompt": "ab", "completion": "cd", "labels": [1, 2, 3, 4]}])


TRANSFORM_ERROR = (r"SFTTrainer cannot prepare a dataset that uses `Dataset\.with_transform\(\)`\. The preparation "
                   r"pipeline calls `Dataset\.map\(\)`.*Pass `dataset_kwargs=\{'skip_prepare_dataset': True\}`")


def test_a_dataset_with_a_transform_needs_skip_prepare_dataset(tiny_model_dir, tmp_path):
    def shifted(batch):
        return {"input_ids": [[t + 1 for t in ids] for ids in batch["input_ids"]]}

    plain = Dataset.from_list([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}])
    set_in_place = Dataset.from_list([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}])
    set_in_place.set_transform(shifted)
    for data in (plain.with_transform(shifted), set_in_place):
        with pytest.raises(DatasetFormatError, match="^train_dataset: " + TRANSFORM_ERROR):
            SFTTrainer(model=tiny_model_dir, args=config(tmp_path), train_dataset=data)
    with pytest.raises(DatasetFormatError, match="^eval_dataset: " + TRANSFORM_ERROR):
        SFTTrainer(model=tiny_model_dir, args=config(tmp_path), train_dataset=plain,
                   eval_dataset=plain.with_transform(shifted))
    # with skip_prepare_dataset the rows are read through the transform (they were read around it)
    trainer = SFTTrainer(model=tiny_model_dir, args=config(tmp_path, dataset_kwargs={"skip_prepare_dataset": True}),
                         train_dataset=set_in_place)
    assert trainer.train_dataset["input_ids"] == [[6, 7, 8], [9, 10]]
    assert [r["target_ids"] for r in trainer.train_rows] == [[7, 8, IGNORE], [10, IGNORE]]


PADDING_FREE_ERROR = (r"When `padding_free=True` without packing, `max_length` is not enforced\. Either enable "
                      r"packing \(e\.g\., `packing=True, packing_strategy='bfd'`\), provide already truncated inputs, "
                      r"or set `max_length=None`\.")


def test_padding_free_with_max_length_is_refused_by_the_trainer(tiny_model_dir, tmp_path):
    """TRL's SFTConfig(padding_free=True) is valid (max_length 1024); TRL's SFTTrainer raises, also for rows used
    as given."""
    rows = [{"text": "hello"}] * 2
    for options in ({}, {"max_length": 64}):
        args = config(tmp_path, padding_free=True, **options)
        with pytest.raises(ConfigError, match=PADDING_FREE_ERROR):
            SFTTrainer(model=tiny_model_dir, args=args, train_dataset=rows)
    with pytest.raises(ConfigError, match=PADDING_FREE_ERROR):
        SFTTrainer(model=tiny_model_dir, train_dataset=[{"input_ids": [5, 6]}] * 2,
                   args=config(tmp_path, padding_free=True, dataset_kwargs={"skip_prepare_dataset": True}))
    for options in ({"max_length": None}, {"packing": True, "max_length": 8}):
        trainer = SFTTrainer(model=tiny_model_dir, args=config(tmp_path, padding_free=True, **options),
                             train_dataset=rows)
        assert trainer.collator.padding_free
