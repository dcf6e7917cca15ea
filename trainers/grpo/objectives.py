"""GRPO's policy objectives: importance weights, the loss variants, masks and the KL penalty.

Pure tensor functions. Every ``loss_type`` is one entry of ``OBJECTIVES``, all with one signature:
``objective(inputs: PolicyInputs, args) -> PolicyLoss``, where ``args`` is the GRPOConfig (read for the
variant's own constants: clip ranges, temperatures, VESPO's shape). How the per-token loss is then averaged
is ``AGGREGATIONS[loss_type]`` (below), with the step's counts (``GRPOCounts``). Shapes: B completions, T tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from trainers.errors import ConfigError
from trainers.model.losses import (
    BatchCounts,
    aggregate_micro_batch_token_mean,
    aggregate_sequence_mean,
    aggregate_sequence_sum,
    aggregate_token_mean,
)
from trainers.loop.stats import Extreme, Stats


def entropy_bonus(entropy: torch.Tensor, mask: torch.Tensor, counts: "BatchCounts") -> torch.Tensor:
    """TRL's entropy regularizer for one micro-batch: the mean entropy of its ``mask`` tokens, averaged over the
    step's micro-batches (of every process), whatever the loss type. The loss subtracts entropy_coef times it.
    entropy, mask: [B, T]."""
    return (entropy * mask).sum() / mask.sum().clamp(min=1.0) / counts.micro_batches


def importance_log_weights(logps: torch.Tensor, old_logps: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """log π/π_old per token ([B, T]), or GSPO's length-normalized sequence ratio (arXiv:2507.18071) ([B, 1]):
    log w_i = (1/|o_i|) Σ_t (log π(o_i,t) - log π_old(o_i,t))."""
    log_ratio = logps - old_logps  # [B, T]
    if level == "token":
        return log_ratio
    if level == "sequence":
        return ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)  # [B, 1]
    raise ValueError(f"importance_sampling_level must be 'token' or 'sequence', got {level!r}")


def clipped_policy_loss(log_weights: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float,
                        delta: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate, per token: -min(w·A, clip(w, 1-ε_low, 1+ε_high)·A).

    log_weights: [B, T] or [B, 1]; advantages: [B]. ``delta`` also caps w at delta (two-sided clipping,
    arXiv:2505.22617). Returns (loss [B, T or 1], low_clipped, high_clipped) where the clip masks mark
    tokens whose gradient the clip removed.
    """
    adv = advantages.unsqueeze(-1)  # [B, 1]
    ratio = torch.exp(log_weights)
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high)
    if delta is not None:
        ratio = ratio.clamp(max=delta)
    loss = -torch.min(ratio * adv, clipped * adv)
    low_clipped = (ratio < 1 - eps_low) & (adv < 0)
    high_clipped = (ratio > 1 + eps_high) & (adv > 0)
    return loss, low_clipped, high_clipped


def cispo_policy_loss(logps: torch.Tensor, log_weights: torch.Tensor, advantages: torch.Tensor,
                      max_weight: float) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO (MiniMax-M1, arXiv:2506.13585), per token: -min(w, ε_max).detach() · A · log π. The weight is
    clipped and detached instead of the update, so every token keeps a gradient.

    logps: [B, T]; log_weights: [B, T] or [B, 1]; advantages: [B]. Returns (loss [B, T], clipped: w > ε_max
    with A > 0, [B, T or 1]).
    """
    adv = advantages.unsqueeze(-1)  # [B, 1]
    weight = torch.exp(log_weights)
    loss = -weight.clamp(max=max_weight).detach() * adv * logps
    return loss, (weight > max_weight) & (adv > 0)


def sapo_policy_loss(log_weights: torch.Tensor, advantages: torch.Tensor, temperature_pos: float,
                     temperature_neg: float) -> torch.Tensor:
    """SAPO (arXiv:2511.20347), per token: -σ(τ·(w − 1)) · 4/τ · A, a smooth gate in place of the hard clip
    (slope 1 at w = 1, fading off-policy), τ = temperature_pos where A > 0, else temperature_neg.

    log_weights: [B, T] or [B, 1]; advantages: [B]. Returns the loss, [B, T or 1].
    """
    adv = advantages.unsqueeze(-1)  # [B, 1]
    tau = torch.where(adv > 0, temperature_pos, temperature_neg)
    return -torch.sigmoid(tau * (torch.exp(log_weights) - 1)) * 4 / tau * adv


def vespo_policy_loss(logps: torch.Tensor, log_ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                      k_pos: float, lambda_pos: float, k_neg: float, lambda_neg: float,
                      sampler_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """VESPO (arXiv:2602.10693), per token: -φ(w) · A · log π, where w = Π_t π/π_old is the completion's
    sequence ratio and φ(w) = e^λ · w^k · e^(−λw) a detached Gamma-shaped weight with φ(1) = 1, (k, λ) =
    (k_pos, λ_pos) where A >= 0, else (k_neg, λ_neg). In log space, with TRL's clamps.

    logps, log_ratio (per token, log π − log π_old), mask: [B, T]; advantages: [B]. ``sampler_weights``
    ([B, T], π_old/π_sampler per token from ``sampler_importance_weights``) joins w, as in TRL: log w gains
    Σ_t log of them (every column, as TRL sums them; padding's weight is 1). Returns (loss [B, T], φ [B, 1]).
    """
    with torch.no_grad():
        log_w = (log_ratio.clamp(-20.0, 20.0) * mask).sum(-1, keepdim=True)  # [B, 1]
        if sampler_weights is not None:
            log_w = log_w + sampler_weights.log().clamp(math.log(1e-8), 20.0).sum(-1, keepdim=True)
        log_w = log_w.clamp(math.log(1e-8), 20.0)
        nonnegative = advantages.unsqueeze(-1) >= 0
        k = torch.where(nonnegative, k_pos, k_neg)
        lam = torch.where(nonnegative, lambda_pos, lambda_neg).clamp(min=1e-4)
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    return -phi * advantages.unsqueeze(-1) * logps, phi


def high_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, threshold: float | torch.Tensor) -> torch.Tensor:
    """The loss tokens whose entropy is at least ``threshold`` (top_entropy_quantile, arXiv:2506.01939: the
    policy gradient from the high-entropy "forking" tokens only). entropy, mask: [B, T]. Returns [B, T] bool."""
    return (entropy >= threshold) & mask.bool()


def off_policy_sequence_mask(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor,
                             mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence mask (arXiv:2512.02556, eq. 9): 0 for a completion whose advantage
    is negative and whose mean log π_old − log π (an estimate of KL(π_old || π)) exceeds ``threshold``, else 1.

    logps, old_logps (or a sampler's, NaN where unknown), mask: [B, T]; advantages: [B]. Returns [B, 1] in
    mask's dtype.
    """
    kl = torch.nan_to_num(old_logps - logps.detach(), nan=0.0)  # [B, T]; NaN: a token the sampler did not score
    mean_kl = (kl * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)  # [B, 1]
    return ((advantages.unsqueeze(-1) >= 0) | (mean_kl <= threshold)).to(mask.dtype)


def k3_kl(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(π || π_ref), per token: exp(ref - logp) - (ref - logp) - 1 (>= 0)."""
    diff = ref_logps - logps
    return torch.exp(diff) - diff - 1


# ----------------------------------------------------------------------------------------------------------------
# The registry: one signature for every loss_type
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PolicyInputs:
    """What every policy objective reads for one micro-batch."""

    logps: torch.Tensor  # [B, T] log pi (with gradient)
    old_logps: torch.Tensor  # [B, T] log pi_old (the policy that sampled; equal to logps, detached, on-policy)
    advantages: torch.Tensor  # [B]
    mask: torch.Tensor  # [B, T] float: the loss tokens
    # pi_old / pi_sampler (vllm_importance_sampling_correction) for a rollout's own log-probs: [B, T] per token,
    # [B, 1] per completion; None without them
    sampler_weights: torch.Tensor | None = None


@dataclass(frozen=True)
class PolicyLoss:
    """A policy objective's per-token loss (sampler weights applied) and what it clipped, for the metrics."""

    per_token: torch.Tensor  # [B, T] or [B, 1] (a sequence-level ratio with nothing per token)
    low_clipped: torch.Tensor | None = None  # [B, T or 1] bool: ratio below 1 - epsilon with A < 0 (clipped loss)
    high_clipped: torch.Tensor | None = None  # [B, T or 1] bool: ratio above 1 + epsilon_high with A > 0
    cispo_clipped: torch.Tensor | None = None  # [B, T or 1] bool: CISPO's weight capped
    phi: torch.Tensor | None = None  # [B, 1]: VESPO's sequence weight


def _with_sampler_weights(per_token: torch.Tensor, inputs: PolicyInputs) -> torch.Tensor:
    return per_token if inputs.sampler_weights is None else per_token * inputs.sampler_weights


def clipped_objective(inputs: PolicyInputs, args: Any) -> PolicyLoss:
    """PPO's clipped surrogate on the token (GRPO, DAPO, Dr. GRPO, BNPO) or sequence (GSPO, LUSPO) ratio."""
    log_weights = importance_log_weights(inputs.logps, inputs.old_logps, inputs.mask, args.importance_sampling_level)
    per_token, low, high = clipped_policy_loss(log_weights, inputs.advantages, args.epsilon, args.clip_high, args.delta)
    return PolicyLoss(_with_sampler_weights(per_token, inputs), low_clipped=low, high_clipped=high)


def cispo_objective(inputs: PolicyInputs, args: Any) -> PolicyLoss:
    log_weights = importance_log_weights(inputs.logps, inputs.old_logps, inputs.mask, args.importance_sampling_level)
    per_token, clipped = cispo_policy_loss(inputs.logps, log_weights, inputs.advantages, args.clip_high)
    return PolicyLoss(_with_sampler_weights(per_token, inputs), cispo_clipped=clipped)


def sapo_objective(inputs: PolicyInputs, args: Any) -> PolicyLoss:
    log_weights = importance_log_weights(inputs.logps, inputs.old_logps, inputs.mask, args.importance_sampling_level)
    per_token = sapo_policy_loss(log_weights, inputs.advantages, args.sapo_temperature_pos, args.sapo_temperature_neg)
    return PolicyLoss(_with_sampler_weights(per_token, inputs))


def vespo_objective(inputs: PolicyInputs, args: Any) -> PolicyLoss:
    """VESPO folds the sampler weights into its own sequence weight (as TRL) instead of multiplying the loss."""
    per_token, phi = vespo_policy_loss(inputs.logps, inputs.logps - inputs.old_logps, inputs.advantages, inputs.mask,
                                       args.vespo_k_pos, args.vespo_lambda_pos, args.vespo_k_neg,
                                       args.vespo_lambda_neg, inputs.sampler_weights)
    return PolicyLoss(per_token, phi=phi)


OBJECTIVES: dict[str, Callable[[PolicyInputs, Any], PolicyLoss]] = {
    "grpo": clipped_objective,
    "bnpo": clipped_objective,
    "dr_grpo": clipped_objective,
    "dapo": clipped_objective,
    "luspo": clipped_objective,
    "cispo": cispo_objective,
    "sapo": sapo_objective,
    "vespo": vespo_objective,
}

@dataclass(frozen=True)
class GRPOCounts(BatchCounts):
    """The step's counts, and the longest possible completion (Dr. GRPO's constant denominator)."""

    max_completion_length: int = 1


def aggregate_constant_length(per_token: torch.Tensor, mask: torch.Tensor, counts: GRPOCounts) -> torch.Tensor:
    """Σ loss·mask / (sequences x max_completion_length): Dr. GRPO (arXiv:2503.20783), no length bias."""
    return (per_token * mask).sum() / max(counts.sequences * counts.max_completion_length, 1.0)


# How each loss_type averages its per-token loss [B, T] into this micro-batch's share of the step's loss
AGGREGATIONS: dict[str, Callable[[torch.Tensor, torch.Tensor, GRPOCounts], torch.Tensor]] = {
    "grpo": aggregate_sequence_mean,
    "bnpo": aggregate_micro_batch_token_mean,
    "dr_grpo": aggregate_constant_length,
    "dapo": aggregate_token_mean,
    "cispo": aggregate_token_mean,  # as TRL: over the step's tokens
    "sapo": aggregate_sequence_mean,  # as TRL: the grpo mean of sequence means
    "luspo": aggregate_sequence_sum,
    "vespo": aggregate_token_mean,  # as TRL: over the step's tokens
}


# Objectives whose loss is not a multiple of the sampler weights (vllm_importance_sampling_correction): they fold
# the weights into their own terms, so a row whose weights are all 0 may still have a gradient.
FOLDS_SAMPLER_WEIGHTS = frozenset({"vespo"})


def check_loss_options(args: Any, other_sampler: str | None, warn: Callable[[str], None]) -> None:
    """The loss options checked once the sampler is known (``other_sampler``: "a rollout_func", "use_vllm", or
    None for the policy itself), and TRL's warnings about them (``warn``)."""
    if args.loss_type == "luspo" and args.importance_sampling_level != "sequence":
        warn("loss_type='luspo' is GSPO's sequence-level loss scaled by length; with importance_sampling_level="
             "'token' it is a token sum per sequence. Set importance_sampling_level='sequence' for the paper's "
             "setting (TRL warns the same).")
    if args.importance_sampling_level == "sequence" and args.loss_type in ("bnpo", "dr_grpo", "dapo", "cispo"):
        warn(f"When using `importance_sampling_level='sequence'`, the `'{args.loss_type}'` loss sums per-token "
             "contributions, which effectively weights each sequence by its completion length instead of optimizing "
             "the per-sequence objective. To reproduce the GSPO paper's setup, set `loss_type='grpo'`.")
    if args.multi_objective_aggregation == "normalize_then_sum" and args.scale_rewards != "group":
        warn(f"scale_rewards={args.scale_rewards!r} is not used with multi_objective_aggregation="
             "'normalize_then_sum', which normalizes each function per group and the sum over the batch.")
    if args.loss_type == "vespo" and other_sampler is not None and args.vllm_importance_sampling_correction \
            and args.vllm_importance_sampling_mode.startswith("sequence"):
        raise ConfigError(f"loss_type='vespo' with {other_sampler} needs vllm_importance_sampling_mode "
                          f"'token_truncate' or 'token_mask' (got {args.vllm_importance_sampling_mode!r}): VESPO "
                          f"folds per-token sampler weights into its own sequence weight, as in TRL. Or set "
                          f"vllm_importance_sampling_correction=False.")
    if args.loss_type == "vespo" and args.importance_sampling_level != "token":
        warn("loss_type='vespo' computes its sequence-level weight itself, from token log-ratios; "
             "importance_sampling_level is not used (TRL warns the same).")


def policy_loss_stats(policy: PolicyLoss, mask: torch.Tensor, per_completion: bool) -> Stats:
    """TRL's clip metrics of one micro-batch: the share of clipped tokens (``per_completion``, i.e.
    importance_sampling_level="sequence": of clipped completions), with its min (low) and max (high) over
    processes; CISPO's capped share; VESPO's mean weight. mask: [B, T]."""
    stats: Stats = {}
    weight = torch.ones((mask.shape[0], 1), dtype=mask.dtype, device=mask.device) if per_completion else mask
    if policy.low_clipped is not None:
        low, high = (policy.low_clipped.float() * weight).sum(), (policy.high_clipped.float() * weight).sum()
        counted = weight.sum()
        stats["clip_ratio/low_mean"] = (low, counted)
        stats["clip_ratio/high_mean"] = (high, counted)
        stats["clip_ratio/region_mean"] = (low + high, counted)
        stats["clip_ratio/low_min"] = Extreme(low / counted, "min")  # this micro-batch's ratio, min over processes
        stats["clip_ratio/high_max"] = Extreme(high / counted, "max")
    if policy.cispo_clipped is not None:  # TRL's name; SAPO has no clip to count
        stats["cispo_clip_ratio"] = ((policy.cispo_clipped.float() * weight).sum(), weight.sum())
    if policy.phi is not None:  # TRL's name: the mean weight over every completion row
        stats["vespo/phi_seq_mean"] = (policy.phi.sum(), policy.phi.shape[0])
    return stats
