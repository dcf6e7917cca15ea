"""Pure tensor functions: log-probs from logits, advantages, the GRPO family of losses, KL, and aggregation.

Nothing here knows about models, processes or configs. Shapes: B sequences, T positions, V vocabulary.
``mask`` is 1.0 where a token counts and 0.0 elsewhere.

How losses are averaged (``AGGREGATIONS``) is what makes a result independent of how a global batch is split
into micro-batches and processes: each micro-batch's loss is a sum divided by a *global* count (tokens or
sequences in the whole optimizer step), so summing micro-batch gradients gives the gradient of the global
loss. The trainer multiplies by processes x accumulation steps to undo the averaging done by DDP/DeepSpeed
and by ``accelerator.backward``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

# ----------------------------------------------------------------------------------------------------------------
# Log-probabilities and entropy, computed in row chunks so [B, T, V] float32 never exists at once.
# ----------------------------------------------------------------------------------------------------------------


def selective_log_softmax(logits: torch.Tensor, index: torch.Tensor, chunk_rows: int = 4) -> torch.Tensor:
    """log softmax(logits)[index] for every position.

    logits: [B, T, V] (any float dtype; upcast to float32 one chunk of rows at a time)
    index:  [B, T] token ids (negative ids are treated as 0; mask them yourself)
    returns [B, T] float32
    """
    index = index.clamp(min=0)
    out = []
    for rows, idx in zip(logits.split(chunk_rows), index.split(chunk_rows)):
        rows = rows.float()  # [b, T, V]
        picked = rows.gather(-1, idx.unsqueeze(-1)).squeeze(-1)  # [b, T]
        out.append(picked - torch.logsumexp(rows, dim=-1))
    return torch.cat(out)


def logps_and_entropy(logits: torch.Tensor, index: torch.Tensor, chunk_rows: int = 4,
                      entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``selective_log_softmax`` and ``entropy_from_logits`` in one pass over the logits (they share the
    log-sum-exp). The entropy carries a gradient only with ``entropy_grad`` (an entropy bonus; it keeps each
    chunk's probabilities for backward). Returns ([B, T], [B, T]) float32."""
    index = index.clamp(min=0)
    logps, entropies = [], []
    for rows, idx in zip(logits.split(chunk_rows), index.split(chunk_rows)):
        rows = rows.float()  # [b, T, V]
        lse = torch.logsumexp(rows, dim=-1)  # [b, T]
        logps.append(rows.gather(-1, idx.unsqueeze(-1)).squeeze(-1) - lse)
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            probs = torch.exp(rows - lse.unsqueeze(-1))
            entropies.append(lse - (probs * rows).sum(-1))  # H = lse - E_p[logit]
    return torch.cat(logps), torch.cat(entropies)


def entropy_bonus(entropy: torch.Tensor, mask: torch.Tensor, counts: "BatchCounts") -> torch.Tensor:
    """TRL's entropy regularizer for one micro-batch: the mean entropy of its ``mask`` tokens, averaged over the
    step's micro-batches (of every process), whatever the loss type. The loss subtracts entropy_coef times it.
    entropy, mask: [B, T]."""
    return (entropy * mask).sum() / mask.sum().clamp(min=1.0) / counts.micro_batches


def entropy_from_logits(logits: torch.Tensor, chunk_rows: int = 4) -> torch.Tensor:
    """Entropy of softmax(logits) at every position: [B, T, V] -> [B, T] float32."""
    out = []
    for rows in logits.split(chunk_rows):
        logp = rows.float().log_softmax(-1)  # [b, T, V]
        out.append(-(logp.exp() * logp).sum(-1))
    return torch.cat(out)


# ----------------------------------------------------------------------------------------------------------------
# Aggregation: per-token losses [B, T] -> the scalar this micro-batch contributes to the global loss.
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BatchCounts:
    """Counts over one whole optimizer step (every micro-batch on every process)."""

    tokens: float  # masked-in tokens
    sequences: float  # sequences (completions)
    micro_batches: int  # processes x accumulation steps
    max_completion_length: int = 1


def aggregate_token_mean(per_token: torch.Tensor, mask: torch.Tensor, counts: BatchCounts) -> torch.Tensor:
    """Σ loss·mask / (tokens in the whole step). DAPO's normalization, and SFT's NLL."""
    return (per_token * mask).sum() / max(counts.tokens, 1.0)


def aggregate_sequence_mean(per_token: torch.Tensor, mask: torch.Tensor, counts: BatchCounts) -> torch.Tensor:
    """Mean over sequences of each sequence's token mean (GRPO, arXiv:2402.03300 eq. 3)."""
    per_sequence = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)  # [B]
    return per_sequence.sum() / max(counts.sequences, 1.0)


def aggregate_micro_batch_token_mean(per_token: torch.Tensor, mask: torch.Tensor, counts: BatchCounts) -> torch.Tensor:
    """Token mean within this micro-batch, averaged over micro-batches (BNPO, TRL's definition)."""
    return (per_token * mask).sum() / mask.sum().clamp(min=1.0) / counts.micro_batches


def aggregate_constant_length(per_token: torch.Tensor, mask: torch.Tensor, counts: BatchCounts) -> torch.Tensor:
    """Σ loss·mask / (sequences x max_completion_length): Dr. GRPO (arXiv:2503.20783), no length bias."""
    return (per_token * mask).sum() / max(counts.sequences * counts.max_completion_length, 1.0)


def aggregate_sequence_sum(per_token: torch.Tensor, mask: torch.Tensor, counts: BatchCounts) -> torch.Tensor:
    """Mean over sequences of each sequence's token *sum*: LUSPO, GSPO scaled by each completion's length so
    long completions are not under-weighted (TRL's loss_type="luspo")."""
    return (per_token * mask).sum() / max(counts.sequences, 1.0)


AGGREGATIONS: dict[str, Callable[[torch.Tensor, torch.Tensor, BatchCounts], torch.Tensor]] = {
    "grpo": aggregate_sequence_mean,
    "bnpo": aggregate_micro_batch_token_mean,
    "dr_grpo": aggregate_constant_length,
    "dapo": aggregate_token_mean,
    "cispo": aggregate_token_mean,  # as TRL: over the step's tokens
    "sapo": aggregate_sequence_mean,  # as TRL: the grpo mean of sequence means
    "luspo": aggregate_sequence_sum,
    "vespo": aggregate_token_mean,  # as TRL: over the step's tokens
    "nll": aggregate_token_mean,
}


# ----------------------------------------------------------------------------------------------------------------
# Advantages
# ----------------------------------------------------------------------------------------------------------------


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


# ----------------------------------------------------------------------------------------------------------------
# The clipped policy objective (GRPO / DAPO / Dr. GRPO / BNPO / GSPO) and the KL penalty
# ----------------------------------------------------------------------------------------------------------------


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


def sampler_importance_weights(logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor, mode: str,
                               clip_min: float | None, clip_max: float | None) -> torch.Tensor:
    """Importance weights π_old / π_sampler that correct for completions sampled by another engine than the
    policy (TRL's vLLM importance sampling: truncated or masked IS): per token ([B, T]) for
    'token_*' modes, per completion ([B, 1], the product over its masked tokens) for 'sequence_*'. '*_truncate'
    clips them to [clip_min, clip_max]; '*_mask' sets them to 0 outside it (None: no bound on that side).

    logps (the trainer's, π_old), sampler_logps (NaN where the sampler gave none: a difference of 0, so no
    correction), mask: [B, T]. Padding columns get weight 1.
    """
    diff = torch.nan_to_num((logps - sampler_logps) * mask, nan=0.0)  # [B, T]
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)  # [B, 1]
    weights = torch.exp(diff)
    if mode.endswith("truncate"):
        return weights if clip_min is None and clip_max is None else weights.clamp(min=clip_min, max=clip_max)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return weights.masked_fill((weights < low) | (weights > high), 0.0)


def k3_kl(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(π || π_ref), per token: exp(ref - logp) - (ref - logp) - 1 (>= 0)."""
    diff = ref_logps - logps
    return torch.exp(diff) - diff - 1
