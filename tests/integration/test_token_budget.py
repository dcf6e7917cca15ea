"""GRPOConfig.token_budget: each step's completions regrouped into micro-batches of at most that many tokens
(prompt + completion), with padding_free. One CPU process here; two under ZeRO-3 in
tests/distributed/test_grpo_distributed.py."""

import random

import pytest
import torch

from tests.conftest import MicroBatches, digits, step_records
from trainers import GRPOConfig, GRPOTrainer
from trainers.errors import ConfigError

PROMPTS = [{"prompt": p} for p in ["abc", "hello", "xyz", "12", "the", "cat", "sat", "on"] * 4]
BUDGET = 24  # "hello" (5 tokens) + 8 of completion = 13: one such row per micro-batch, with room for short ones


def ragged(prompts, trainer):
    """A rollout function whose completions of "abc" are its EOS alone and every other one 8 random characters
    (digits or letters, so a group's rewards differ): ragged lengths, the same in every run."""
    tokenizer, draw = trainer.processing_class, random.Random(len(prompts[0]) + trainer.state.global_step)
    prompt_ids = [tokenizer(p)["input_ids"] for p in prompts]
    completions = [[tokenizer.eos_token_id] if p == "abc" else
                   tokenizer("".join(draw.choice("0123456789abcdef") for _ in range(8)))["input_ids"]
                   for p in prompts]
    return {"prompt_ids": prompt_ids, "completion_ids": completions, "logprobs": None}


def train(tiny_model_dir, folder, **options):
    """Three steps of 16 completions per step (2 x 8 rows; a round's prompts: "abc", "hello", "xyz", "12"),
    trained on twice (num_iterations=2: old log-probs),
    with a reference (beta), completions from ``ragged``. Returns the trainer, its micro-batch counts and the
    token count of each forward with gradients."""
    counter = MicroBatches()
    args = GRPOConfig(output_dir=str(folder), per_device_train_batch_size=8, gradient_accumulation_steps=2,
                      num_generations=4, num_iterations=2, beta=0.1, max_completion_length=8, learning_rate=1e-2,
                      max_steps=3, logging_steps=1, save_strategy="no", disable_tqdm=True, seed=0, padding_free=True,
                      shuffle_dataset=False, **options)
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=digits, train_dataset=PROMPTS, args=args,
                          callbacks=[counter], rollout_func=ragged)
    tokens = []

    def record(module, call_args, kwargs):
        if torch.is_grad_enabled():
            tokens.append(kwargs["input_ids"].numel())  # one packed row: its real tokens

    trainer.model.register_forward_pre_hook(record, with_kwargs=True)
    trainer.train()
    return trainer, counter.per_step, tokens


def test_token_budget_trains_the_same_weights_in_micro_batches_within_it(tiny_model_dir, tmp_path):
    """The same completions, regrouped by tokens: the same weights and metrics (the dapo loss is normalized by
    the step's tokens, so it does not depend on the split) as micro-batches of 8 rows; every forward with a
    gradient is within the budget, and the number of micro-batches follows the tokens, not the rows."""
    rows, rows_counts, rows_tokens = train(tiny_model_dir, tmp_path / "rows")
    budget, budget_counts, budget_tokens = train(tiny_model_dir, tmp_path / "budget", token_budget=BUDGET)
    assert rows_counts == [2, 2, 2] and max(rows_tokens) > BUDGET  # 8 rows at a time do not fit in it
    assert max(budget_tokens) <= BUDGET and len(budget_tokens) == sum(budget_counts)
    assert all(count > 2 for count in budget_counts), budget_counts
    for name, value in rows.unwrapped_model.named_parameters():  # Adam turns float-order noise into up to ~lr
        torch.testing.assert_close(dict(budget.unwrapped_model.named_parameters())[name], value, rtol=1e-4,
                                   atol=5e-4)
    for record, reference in zip(step_records(budget), step_records(rows)):
        assert record["num_tokens"] == reference["num_tokens"]  # a round trained on again is counted once
        for key in ("loss", "kl", "entropy", "grad_norm"):
            assert record[key] == pytest.approx(reference[key], rel=1e-3, abs=1e-5), key
    assert step_records(rows)[-1]["grad_norm"] > 0


def test_token_budget_needs_padding_free_and_room_for_every_prompt(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="set padding_free=True too"):
        GRPOConfig(output_dir=str(tmp_path), token_budget=64)
    with pytest.raises(ConfigError, match="token_budget"):
        GRPOConfig(output_dir=str(tmp_path), token_budget=0, padding_free=True)
    args = GRPOConfig(output_dir=str(tmp_path), token_budget=12, padding_free=True, max_completion_length=8,
                      per_device_train_batch_size=8, num_generations=8)
    # "hello" (row 1) has 5 tokens: 5 + 8 > 12, refused before the model loads
    with pytest.raises(ConfigError, match=r"token_budget=12 cannot hold train_dataset row 1 .*token_budget >= 13"):
        GRPOTrainer(model=tiny_model_dir, reward_funcs=digits, train_dataset=PROMPTS, args=args)
