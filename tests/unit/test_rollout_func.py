"""check_rollout: a rollout function's answer is checked, and every error names the key and the row."""

import math

import pytest
import torch

from trainers.errors import RolloutError
from trainers.generation.user_rollout import check_rollout
from trainers.sampling.scoring import logprob_gap, padded_logprobs


def output(**overrides):
    base = {"prompt_ids": [[1, 2], [3]], "completion_ids": [[4, 5, 6], [7]], "logprobs": None}
    return {**base, **overrides}


def check(out, n=2, max_completion_length=8, vocab=100, context=64):
    return check_rollout(out, n, max_completion_length, vocab, context)


def test_a_valid_answer_keeps_its_rows_and_passes_other_keys_to_the_rewards():
    rollout = check(output(logprobs=[[-1.0, -2, -0.5], [0.0]], env_mask=[[1, 0, 1], [1]], score=[0.5, 1.0],
                           source="env", answer=torch.tensor([3, 4]).tolist()))
    assert rollout.prompt_ids == [[1, 2], [3]] and rollout.completion_ids == [[4, 5, 6], [7]]
    assert rollout.logprobs == [[-1.0, -2.0, -0.5], [0.0]] and rollout.model_mask == [[1, 0, 1], [1]]
    # a list is one value per row; anything else is every row's value (TRL's rule)
    assert rollout.extra == {"score": [0.5, 1.0], "source": ["env", "env"], "answer": [3, 4]}


def test_a_token_the_sampler_could_not_score_is_nan():
    """vLLM gives None for such a token; TRL reads it as NaN (no correction, left out of the gap)."""
    rollout = check(output(logprobs=[[-1.0, None, 0], [0.0]]))
    assert rollout.logprobs[0][0] == -1.0 and math.isnan(rollout.logprobs[0][1])


def test_tensors_are_accepted_as_token_rows():
    rollout = check(output(prompt_ids=torch.tensor([[1, 2], [3, 4]]), completion_ids=[torch.tensor([4]), [5]]))
    assert rollout.prompt_ids == [[1, 2], [3, 4]] and rollout.completion_ids == [[4], [5]]


@pytest.mark.parametrize("out, message", [
    ([1, 2], "returned list; it must return a dict"),
    ({"prompt_ids": [[1]], "completion_ids": [[2]]}, "must return keys ['logprobs']"),
    (output(completion_ids=[[4]]), "'completion_ids' with 1 rows; it must hold one entry per prompt it was given (2)"),
    (output(prompt_ids="ab"), "'prompt_ids' with str"),
    (output(completion_ids=[[4, "x"], [7]]), "'completion_ids' row 0 with a value that is not a token id"),
    (output(completion_ids=[[4], 7]), "'completion_ids' row 1 as int"),
    (output(prompt_ids=[[1], []]), "empty 'prompt_ids' row 1"),
    (output(completion_ids=[[4] * 9, [7]]), "completion of 9 tokens in row 0; max_completion_length=8"),
    (output(completion_ids=[[4], [100]]), "outside the model's vocabulary (0..99) in row 1"),
    (output(logprobs=[[-1.0], [0.0]]), "'logprobs' row 0 with 1 values for a completion of 3 tokens"),
    (output(logprobs=[[-1.0, "x", 0], [0.0]]), "'logprobs' row 0 with a value that is not a number"),
    (output(env_mask=[[1, 1, 2], [1]]), "'env_mask' value other than 0"),
    (output(env_mask=[[1, 1], [1]]), "'env_mask' row 0 with 2 values"),
    (output(score=[1.0, 2.0, 3.0]), "'score' with 3 rows"),
])
def test_errors_name_the_key_and_the_row(out, message):
    with pytest.raises(RolloutError, match="rollout_func") as error:
        check(out)
    assert message in str(error.value)


def test_prompt_and_completion_must_fit_the_context():
    with pytest.raises(RolloutError, match="row 0 with 2 prompt \\+ 3 completion tokens, more than the model's "
                                           "context of 4"):
        check(output(), context=4)


def test_logprob_gap_counts_masked_scored_tokens_only():
    trainer = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, 0.0, 0.0]])  # [N, C]
    mask = torch.tensor([[1, 0, 1], [1, 0, 0]])
    total, count, peak = logprob_gap(trainer, padded_logprobs([[-1.5, 9.0, math.nan], [-0.25]], 3), mask)
    # row 0: |-1 + 1.5| = 0.5 counted, column 1 masked, column 2 NaN (unscored); row 1: 0.25
    assert total.item() == pytest.approx(0.75) and count.item() == 2 and peak.item() == pytest.approx(0.5)
