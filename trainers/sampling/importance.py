"""Correcting for a sampler other than the policy (vLLM, a rollout_func, a registered backend): TRL's
vllm_importance_sampling_* as a record of its settings and the weights it gives. GRPO's option; the round applies
it when its trainer asks for it."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ImportanceCorrection:
    """How the round weighs a completion sampled by another engine: ``mode`` (per 'token_*' or 'sequence_*';
    '*_truncate' clips the ratio, '*_mask' drops what falls outside) and the bounds (None: no bound)."""

    mode: str
    clip_min: float | None
    clip_max: float | None

    def weights(self, logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return sampler_importance_weights(logps, sampler_logps, mask, self.mode, self.clip_min, self.clip_max)


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
