"""A round's advantages: rewards of a round -> one advantage per completion.

Every estimator is one entry of ``ADVANTAGE_ESTIMATORS`` (beside the policy objectives' ``OBJECTIVES``,
trainers/grpo/objectives.py): its function, ``estimate(inputs: AdvantageInputs, args) -> RoundAdvantages``, and
what it needs of the round besides the rewards (the old log-probs: the round computes them when it says so).
"grpo" (group-relative, GRPOTrainer's) is here; "rloo" (leave-one-out with a KL penalty, RLOOTrainer's) in
trainers/rloo/objective.py. DistillationTrainer has none (the teacher's distribution is its signal). The tensor
functions below are pure.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch


def nanstd(x: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """Unbiased standard deviation ignoring NaNs."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True)
    var = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True) * count / (count - 1).clamp(min=1)
    std = var.sqrt()
    return std if keepdim or dim is None else std.squeeze(dim)


def combine_rewards(rewards_per_func: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted sum of reward functions, skipping NaN (a function's "not applicable").

    rewards_per_func: [N, F] (NaN = not applicable), weights: [F] -> [N]; NaN where no function applied.
    """
    total = (rewards_per_func * weights.unsqueeze(0)).nansum(dim=1)  # [N]
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    return total.masked_fill(unscorable, float("nan"))


def group_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str = "group",
                     eps: float = 1e-4) -> tuple[torch.Tensor, torch.Tensor]:
    """A_i = (r_i - mean(group)) / (std + eps), the std being the group's, the batch's, or none.

    rewards: [N] with N = groups x num_generations, each group contiguous; NaN = unscorable (advantage 0).
    returns (advantages [N], zero_std [N/G] bool: groups whose rewards are all equal).
    """
    grouped = rewards.view(-1, num_generations)  # [N/G, G]
    group_mean = torch.nanmean(grouped, dim=1)  # [N/G]
    group_std = nanstd(grouped, dim=1)  # [N/G]
    advantages = rewards - group_mean.repeat_interleave(num_generations)
    if scale_rewards == "group":
        advantages = advantages / (group_std.repeat_interleave(num_generations) + eps)
    elif scale_rewards == "batch":
        advantages = advantages / (nanstd(rewards) + eps)
    elif scale_rewards != "none":
        raise ValueError(f"scale_rewards must be 'group', 'batch' or 'none', got {scale_rewards!r}")
    zero_std = torch.isclose(torch.nan_to_num(group_std, nan=0.0), torch.zeros_like(group_std))
    return torch.nan_to_num(advantages, nan=0.0), zero_std


def decoupled_advantages(rewards_per_func: torch.Tensor, weights: torch.Tensor, num_generations: int,
                         eps: float = 1e-4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GDPO (arXiv:2601.05242; TRL's multi_objective_aggregation="normalize_then_sum"): each function's rewards
    normalized within their group, (r_k − mean_k) / (std_k + eps), summed with the weights, and the sum
    normalized over the batch. Functions on different scales then count by their weights, not their spreads.

    rewards_per_func: [N, F] (NaN = not applicable), groups of num_generations contiguous; weights: [F].
    returns (advantages [N], the weighted sum of normalized rewards [N] (NaN where no function applied),
    zero_std [N/G] bool: groups where every function's rewards are all equal).
    """
    grouped = rewards_per_func.view(-1, num_generations, rewards_per_func.shape[1])  # [N/G, G, F]
    mean = torch.nanmean(grouped, dim=1, keepdim=True)  # [N/G, 1, F]
    std = nanstd(grouped, dim=1, keepdim=True)  # [N/G, 1, F]
    normalized = ((grouped - mean) / (std + eps)).view_as(rewards_per_func)  # [N, F]
    summed = combine_rewards(normalized, weights)  # [N]
    advantages = (summed - torch.nanmean(summed)) / (nanstd(summed) + eps)
    zero_std = torch.isclose(torch.nan_to_num(std, nan=0.0), torch.zeros_like(std)).all(dim=-1).squeeze(1)
    return torch.nan_to_num(advantages, nan=0.0), summed, zero_std


@dataclass(frozen=True)
class RoundAdvantages:
    """A round's rewards and advantages over every process's completions (G = generation_batch_size)."""

    rewards: torch.Tensor  # [G] weighted sums of the functions (NaN where none applied)
    advantages: torch.Tensor  # [G]
    zero_std: torch.Tensor  # [G / num_generations] bool: groups whose rewards are all equal
    # the std the advantages were scaled by, as TRL counts it for frac_reward_zero_std: per group [G /
    # num_generations], or the batch's (scale_rewards="batch", GDPO) as a 0-d tensor
    std_in_use: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)  # the algorithm's own round metrics (RLOO's kl)


def round_advantages(rewards_per_func: torch.Tensor, weights: torch.Tensor, num_generations: int,
                     scale_rewards: str, multi_objective_aggregation: str) -> RoundAdvantages:
    """Rewards [G, F] (NaN: a function's "not applicable") -> the round's advantages: GRPO's group-relative
    ones of the weighted sum (``group_advantages``), or GDPO's per-function normalization
    (multi_objective_aggregation="normalize_then_sum", ``decoupled_advantages``)."""
    rewards = combine_rewards(rewards_per_func, weights)  # [G]
    if multi_objective_aggregation == "normalize_then_sum":
        advantages, scaled, zero_std = decoupled_advantages(rewards_per_func, weights, num_generations)
        return RoundAdvantages(rewards, advantages, zero_std, nanstd(scaled))
    advantages, zero_std = group_advantages(rewards, num_generations, scale_rewards)
    # a NaN std (a group with fewer than two scored completions) is not zero
    std = nanstd(rewards) if scale_rewards == "batch" else nanstd(rewards.view(-1, num_generations), dim=1)
    return RoundAdvantages(rewards, advantages, zero_std, std)


@dataclass(frozen=True)
class AdvantageInputs:
    """What an estimator reads of one round (or of one process's evaluation batch)."""

    rewards_per_func: torch.Tensor  # [G, F] (NaN: a function's "not applicable"), groups of num_generations
    weights: torch.Tensor  # [F] reward_weights
    num_generations: int
    rollout: Any  # this process's Rollout (trainers/sampling/batch.py): its rows, masks and log-probs
    accelerator: Any
    # True: rewards_per_func holds every process's rows and every process calls the estimator together; False:
    # this process's evaluation batch alone (whole groups), no collectives
    over_processes: bool = True


@dataclass(frozen=True)
class AdvantageEstimator:
    """An entry of ``ADVANTAGE_ESTIMATORS``: ``estimate`` and what it needs of the round (config -> bool)."""

    estimate: Callable[[AdvantageInputs, Any], RoundAdvantages]
    needs_old_logps: Callable[[Any], bool] = lambda args: False


def group_relative(inputs: AdvantageInputs, args: Any) -> RoundAdvantages:
    """GRPO's: ``round_advantages`` with scale_rewards and multi_objective_aggregation."""
    return round_advantages(inputs.rewards_per_func, inputs.weights, inputs.num_generations, args.scale_rewards,
                            args.multi_objective_aggregation)


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    "grpo": AdvantageEstimator(group_relative),
}
