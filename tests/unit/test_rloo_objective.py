"""RLOO's pure pieces (trainers/rloo/objective.py) on fixed tensors, against values computed by hand."""

import math

import pytest
import torch

from trainers.rloo.objective import (
    clipped_sequence_loss,
    leave_one_out_advantages,
    penalized_rewards,
    sequence_kl,
)

nan = float("nan")


def test_leave_one_out_baseline_is_the_mean_of_the_others():
    rewards = torch.tensor([1.0, 2.0, 3.0, 6.0,  # group 1: baselines (2+3+6)/3, (1+3+6)/3, ...
                            0.0, 0.0, 4.0, nan])  # group 2: one unscorable (advantage 0, left out of the others)
    advantages = leave_one_out_advantages(rewards, 4)
    expected = [1 - 11 / 3, 2 - 10 / 3, 3 - 3, 6 - 2, 0 - 2, 0 - 2, 4 - 0, 0.0]
    assert advantages.tolist() == pytest.approx(expected, abs=1e-6)
    # the mean advantage of a fully scorable group is 0: sum_i (r_i - (S - r_i)/(n-1)) = S - S
    assert float(advantages[:4].sum()) == pytest.approx(0.0, abs=1e-6)


def test_a_group_with_one_scorable_completion_and_groups_of_one_get_no_advantage():
    assert leave_one_out_advantages(torch.tensor([5.0, nan, 1.0, 2.0]), 2).tolist() == [0.0, 0.0, -1.0, 1.0]
    assert leave_one_out_advantages(torch.tensor([5.0, 1.0]), 1).tolist() == [0.0, 0.0]


def test_normalized_advantages_have_mean_zero_and_unit_std_over_the_scorable_ones():
    rewards = torch.tensor([1.0, 2.0, 3.0, 6.0, 0.0, 1.0, 4.0, nan])
    raw = leave_one_out_advantages(rewards, 4)[:7]
    normalized = leave_one_out_advantages(rewards, 4, normalize=True)
    assert normalized[7] == 0.0
    std = raw.std()  # unbiased, as TRL's nanstd
    assert normalized[:7].tolist() == pytest.approx(((raw - raw.mean()) / (std + 1e-4)).tolist(), abs=1e-6)


def test_rewards_are_weighted_clipped_then_penalized_by_the_sequence_kl():
    per_func = torch.tensor([[1.0, 2.0], [nan, 4.0], [nan, nan], [-5.0, 0.0]])
    weights = torch.tensor([1.0, 0.5])
    kl = torch.tensor([0.5, -1.0, 2.0, 0.0])
    rewards = penalized_rewards(per_func, weights, clip_range=(-2.0, 1.5), kl=kl, beta=0.1)
    # 1 + 1 = 2 -> 1.5 - 0.05; 2 -> 1.5 + 0.1; unscorable stays NaN; -5 -> -2
    assert rewards[[0, 1, 3]].tolist() == pytest.approx([1.45, 1.6, -2.0], abs=1e-6)
    assert math.isnan(rewards[2])
    assert penalized_rewards(per_func, weights)[[0, 1, 3]].tolist() == [2.0, 2.0, -5.0]


def test_sequence_kl_is_the_masked_sum_of_the_log_ratio():
    old = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -9.0]])
    ref = torch.tensor([[-1.5, -1.0, 0.0], [-1.0, -0.25, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    assert sequence_kl(old, ref, mask).tolist() == pytest.approx([0.5 - 1.0, 0.5 - 0.25])


def test_clipped_sequence_loss_clips_the_sequence_ratio():
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 1.0]])
    old = torch.zeros(4, 2)
    # sequence log-ratios: 0.5 (rho 1.65, A > 0: clipped high), -0.5 on the first token only (rho 0.61, A < 0:
    # clipped low), 0.1 (inside), 0.5 with A < 0 (the unclipped term is the smaller: not clipped)
    logps = torch.tensor([[0.25, 0.25], [-0.5, 7.0], [0.05, 0.05], [0.25, 0.25]])
    advantages = torch.tensor([2.0, -1.0, 1.0, -1.0])
    out = clipped_sequence_loss(logps, old, advantages, mask, eps_low=0.2, eps_high=0.3)
    rho = torch.exp(torch.tensor([0.5, -0.5, 0.1, 0.5]))
    expected = [-1.3 * 2.0, 0.8 * 1.0, -float(rho[2]), float(rho[3])]
    assert out.per_sequence.tolist() == pytest.approx(expected, rel=1e-6)
    assert out.high_clipped.tolist() == [True, False, False, False]
    assert out.low_clipped.tolist() == [False, True, False, False]
    logps.requires_grad_(True)
    clipped_sequence_loss(logps, old, advantages, mask, 0.2, 0.3).per_sequence.sum().backward()
    # clipped completions and masked tokens get no gradient; the others -A rho per token
    assert logps.grad[0].tolist() == [0.0, 0.0] and logps.grad[1].tolist() == [0.0, 0.0]
    assert logps.grad[2].tolist() == pytest.approx([-float(rho[2])] * 2, rel=1e-6)
    assert logps.grad[3].tolist() == pytest.approx([float(rho[3])] * 2, rel=1e-6)


# TRL 1.16's RLOOTrainer._compute_loss on one batch (4 completions of 6 tokens after 5-token prompts, drawn with
# torch.Generator().manual_seed(1); the tiny model moved by torch.manual_seed(0), 0.05 x randn per parameter;
# epsilon 0.2, epsilon_high 0.3; old sequence log-probs the current ones + OLD_SHIFT), obtained with trl.RLOOTrainer
# on 2026-11-27: its loss and clip_ratio/low_mean.
TRL_LOSS, TRL_LOW_CLIPPED = 0.544392466545105, 0.25
OLD_SHIFT, ADVANTAGES = [0.5, -0.3, 0.05, 0.4], [1.0, -2.0, 0.5, -0.7]


def test_the_loss_equals_trls_on_one_batch(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from trainers.model.modeling import token_logprobs

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    torch.manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    generator = torch.Generator().manual_seed(1)
    prompt_ids = torch.randint(0, 200, (4, 5), generator=generator)
    completion_ids = torch.randint(0, 200, (4, 6), generator=generator)
    prompt_mask, completion_mask = torch.ones(4, 5, dtype=torch.long), torch.ones(4, 6, dtype=torch.long)
    prompt_mask[0, :2], completion_mask[1, 4:], completion_mask[3, 2:] = 0, 0, 0
    with torch.no_grad():
        logps = token_logprobs(model, torch.cat([prompt_ids, completion_ids], 1), completion_ids,
                               attention_mask=torch.cat([prompt_mask, completion_mask], 1), logits_to_keep=6)["logps"]
    mask = completion_mask.float()
    old = (logps * mask).detach().clone()  # per token; the first token carries the shift
    old[:, 0] += torch.tensor(OLD_SHIFT)
    out = clipped_sequence_loss(logps, old, torch.tensor(ADVANTAGES), mask, eps_low=0.2, eps_high=0.3)
    assert float(out.per_sequence.mean()) == pytest.approx(TRL_LOSS, rel=1e-5)
    assert float(out.low_clipped.float().mean()) == TRL_LOW_CLIPPED and not out.high_clipped.any()
