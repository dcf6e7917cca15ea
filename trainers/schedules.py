"""Learning-rate schedules: the multiplier of the peak learning rate at each optimizer step, as pure functions."""

from __future__ import annotations

import math

import torch


def warmup_steps(total_steps: int, steps: float = 0, fraction: float | None = None) -> int:
    """Warmup length in steps, given as a count or as a fraction of all steps."""
    if fraction:
        return math.ceil(fraction * total_steps)
    return int(steps)


def lr_multiplier(step: int, kind: str, total_steps: int, warmup: int) -> float:
    """Multiplier of the peak learning rate at ``step`` (0-based): linear warmup, then constant, linear decay to
    0, or half-cosine decay to 0 at ``total_steps``. "constant" honours a warmup too (same as
    "constant_with_warmup"), so a configured warmup is never silently dropped."""
    if step < warmup:
        return (step + 1) / (warmup + 1)  # never 0, so no step is wasted
    if kind in ("constant", "constant_with_warmup"):
        return 1.0
    progress = (step - warmup) / max(1, total_steps - warmup)
    if kind == "linear":
        return max(0.0, 1.0 - progress)
    if kind == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
    raise ValueError(f"unknown lr_scheduler_type {kind!r}")


def build_scheduler(optimizer: torch.optim.Optimizer, args, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR following ``args.lr_scheduler_type`` with the configured warmup."""
    warmup = warmup_steps(total_steps, args.warmup_steps if args.warmup_steps >= 1 else 0, args.warmup_fraction)
    kind = args.lr_scheduler_type
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, kind, total_steps, warmup))
