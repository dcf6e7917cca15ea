"""The advantage estimators (trainers/sampling/advantages.py, ADVANTAGE_ESTIMATORS): each entry's advantages equal
its formula's, and what it says it needs of the round is what it reads (the round computes exactly that)."""

from types import SimpleNamespace

import pytest
import torch

import trainers  # noqa: F401  registers every estimator ("rloo" with RLOO)
from trainers.sampling.advantages import ADVANTAGE_ESTIMATORS, AdvantageInputs, group_advantages
from trainers.sampling.batch import Rollout
from trainers.rloo.objective import leave_one_out_advantages, sequence_kl

REWARDS = torch.tensor([[1.0], [0.0], [3.0], [2.0], [5.0], [5.0], [1.0], [float("nan")]])  # [G=8, F=1], groups of 4


def rollout(n=8, C=3, old=True):
    torch.manual_seed(0)
    mask = torch.ones(n, C)
    return Rollout(torch.zeros(n, 2, dtype=torch.long), torch.ones(n, 2, dtype=torch.long),
                   torch.zeros(n, C, dtype=torch.long), torch.ones(n, C, dtype=torch.long), torch.arange(n) // 4,
                   mask, torch.zeros(n), old_logps=torch.randn(n, C) if old else None, ref_logps=torch.randn(n, C))


def inputs(round_):
    return AdvantageInputs(REWARDS, torch.tensor([1.0]), 4, round_, accelerator=None, over_processes=False)


def args(**fields):
    base = dict(scale_rewards="group", multi_objective_aggregation="sum_then_normalize", beta=0.0,
                reward_clip_range=None, normalize_advantages=False)
    return SimpleNamespace(**{**base, **fields})


def test_the_registry_names_grpo_and_rloo():
    assert {"grpo", "rloo"} <= set(ADVANTAGE_ESTIMATORS)


def test_grpo_is_group_relative_and_needs_no_old_logprobs():
    estimator = ADVANTAGE_ESTIMATORS["grpo"]
    got = estimator.estimate(inputs(rollout(old=False)), args())
    expected, zero_std = group_advantages(REWARDS[:, 0], 4, "group")
    assert torch.equal(got.advantages, expected) and torch.equal(got.zero_std, zero_std)
    assert not estimator.needs_old_logps(args(beta=0.1))


@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_rloo_is_leave_one_out_of_the_kl_penalized_reward_and_needs_old_logprobs_with_beta(beta):
    estimator = ADVANTAGE_ESTIMATORS["rloo"]
    assert estimator.needs_old_logps(args(beta=beta)) == (beta > 0)
    round_ = rollout(old=beta > 0)  # without beta the estimator reads no log-probs
    got = estimator.estimate(inputs(round_), args(beta=beta))
    penalty = beta * sequence_kl(round_.old_logps, round_.ref_logps, round_.loss_mask) if beta else 0.0
    expected = leave_one_out_advantages(REWARDS[:, 0] - penalty, 4)
    torch.testing.assert_close(got.advantages, expected, equal_nan=True)
    assert ("kl" in got.metrics) == (beta > 0)
    assert got.rewards[:7].tolist() == REWARDS[:7, 0].tolist() and got.rewards[7].isnan()  # logged: no penalty
