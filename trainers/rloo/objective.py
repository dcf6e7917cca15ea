"""What RLOO (TRL 1.16's RLOOTrainer; Ahmadian et al. 2024, arXiv:2402.14740) does differently from GRPO, as pure
tensor functions on a generation round: the reward a completion is trained on, its leave-one-out advantage, and
the sequence-level clipped policy loss. Sampling, reward functions, tools and vLLM are the sampling base's.

- The reward: the reward functions' weighted sum (NaN where none applied), clipped to ``reward_clip_range``,
  minus ``beta`` times the completion's KL to the reference: the sum over its tokens of log pi_old - log pi_ref
  (the first-order estimate, which can be negative; GRPO instead adds k3 to the per-token loss).
- The advantage: the reward minus the mean of its group's other scorable rewards; a completion without a
  scorable sibling (or unscorable itself) gets 0; optionally normalized over the round.
  Registered as the advantage estimator "rloo" (``leave_one_out_round``), which needs the old log-probs with
  beta > 0.
- The loss, per completion: -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A) with rho the ratio of the
  sequence probabilities, exp(sum of the token log-ratios); averaged over completions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from trainers.parallel import distributed as dist
from trainers.sampling.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageEstimator,
    AdvantageInputs,
    RoundAdvantages,
    combine_rewards,
    nanstd,
)


def sequence_kl(old_logps: torch.Tensor, ref_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each completion's KL estimate to the reference: sum over its tokens of log pi_old - log pi_ref.
    [B, C], [B, C], mask [B, C] -> [B]."""
    return ((old_logps - ref_logps) * mask).sum(-1)


def penalized_rewards(rewards_per_func: torch.Tensor, weights: torch.Tensor,
                      clip_range: tuple[float, float] | None = None, kl: torch.Tensor | None = None,
                      beta: float = 0.0) -> torch.Tensor:
    """The reward each completion is trained on: [G, F] (NaN: not applicable), weights [F], each completion's
    sequence KL [G] -> [G], NaN where no function applied (clipped, then the KL penalty, as TRL)."""
    rewards = combine_rewards(rewards_per_func, weights)  # [G]
    if clip_range is not None:
        rewards = rewards.clamp(min=clip_range[0], max=clip_range[1])
    if kl is not None and beta != 0.0:
        rewards = rewards - beta * kl
    return rewards


def leave_one_out_advantages(rewards: torch.Tensor, num_generations: int, normalize: bool = False,
                             eps: float = 1e-4) -> torch.Tensor:
    """A_i = r_i - mean of the other scorable rewards of its group. rewards: [G] in contiguous groups of
    ``num_generations`` (NaN: unscorable) -> [G]; 0 for an unscorable completion, one without a scorable sibling,
    and every completion when groups have one member. ``normalize``: (A - mean) / (std + eps) over the round's
    scorable completions first."""
    if num_generations == 1:
        return torch.zeros_like(rewards)
    grouped = rewards.view(-1, num_generations)  # [G / n, n]
    scorable = (~torch.isnan(grouped)).sum(dim=1, keepdim=True)  # [G / n, 1]
    others = (torch.nansum(grouped, dim=1, keepdim=True) - grouped) / (scorable - 1)  # [G / n, n]; 0/0: NaN
    advantages = (grouped - others).view(-1)  # [G]
    if normalize:
        advantages = (advantages - torch.nanmean(advantages)) / (nanstd(advantages) + eps)
    return torch.nan_to_num(advantages, nan=0.0)


@dataclass(frozen=True)
class SequenceLoss:
    """The clipped loss of each completion [B] and which were clipped (for TRL's clip_ratio metrics) [B]."""

    per_sequence: torch.Tensor
    low_clipped: torch.Tensor  # bool: rho < 1 - eps_low where A < 0
    high_clipped: torch.Tensor  # bool: rho > 1 + eps_high where A > 0


def clipped_sequence_loss(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor,
                          mask: torch.Tensor, eps_low: float, eps_high: float) -> SequenceLoss:
    """PPO's clipped objective on whole completions: logps, old_logps [B, C] per token, advantages [B], mask
    [B, C] -> per completion -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A), rho = exp(sum of the masked
    token log-ratios)."""
    ratio = torch.exp(((logps - old_logps) * mask).sum(-1))  # [B]
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    per_sequence = -torch.min(ratio * advantages, clipped * advantages)
    return SequenceLoss(per_sequence, (ratio < 1 - eps_low) & (advantages < 0),
                        (ratio > 1 + eps_high) & (advantages > 0))


def leave_one_out_round(inputs: AdvantageInputs, args: Any) -> RoundAdvantages:
    """RLOO's advantages of a round: each completion's weighted reward, clipped to reward_clip_range, less beta x
    its KL to the reference (summed over its loss tokens, from the old log-probs: the policy that sampled), minus
    the mean of the other scorable completions of its prompt; normalized over the round with
    normalize_advantages. Also the round's kl: the per-token mean over every process of log pi_old - log pi_ref
    (over this process's batch when not ``over_processes``)."""
    metrics, kl = {}, None
    if args.beta > 0:
        rollout, acc = inputs.rollout, inputs.accelerator
        mask = rollout.loss_mask
        kl = sequence_kl(rollout.old_logps.float(), rollout.ref_logps.float(), mask)  # [n]
        totals = torch.stack([kl.sum(), mask.sum()])
        if inputs.over_processes:
            kl, totals = acc.gather(kl), dist.all_reduce_sum(acc, totals)
        metrics["kl"] = float(totals[0] / totals[1].clamp(min=1.0))
        kl = kl.cpu()
    rewards = penalized_rewards(inputs.rewards_per_func, inputs.weights, args.reward_clip_range, kl,
                                args.beta)  # [G]
    advantages = leave_one_out_advantages(rewards, inputs.num_generations, args.normalize_advantages)
    std = nanstd(rewards.view(-1, inputs.num_generations), dim=1)  # frac_reward_zero_std, over the penalized rewards
    zero_std = torch.isclose(torch.nan_to_num(std, nan=0.0), torch.zeros_like(std))
    # the logged reward is the functions' weighted sum, without the penalty (as TRL logs it)
    return RoundAdvantages(combine_rewards(inputs.rewards_per_func, inputs.weights), advantages, zero_std, std,
                           metrics)


# the KL penalty is on the policy that sampled (log pi_old - log pi_ref): with beta, the round computes them
ADVANTAGE_ESTIMATORS["rloo"] = AdvantageEstimator(leave_one_out_round, needs_old_logps=lambda args: args.beta > 0)
