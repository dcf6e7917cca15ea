"""Learning-rate schedules: transformers' own (``transformers.get_scheduler``), so a TRL run's learning rate is
the same here at every step, warm-up included (its first step runs at lr 0)."""

from __future__ import annotations

import inspect
import math

import torch
from transformers.optimization import TYPE_TO_SCHEDULER_FUNCTION, get_scheduler

from trainers.errors import ConfigError
from trainers.logs import logger

# Arguments the trainer passes itself; lr_scheduler_kwargs may not set them.
_OWN_ARGUMENTS = ("optimizer", "num_warmup_steps", "num_training_steps", "last_epoch")


def warmup_steps(total_steps: int, steps: float = 0, fraction: float | None = None) -> int:
    """Warmup length in steps, given as a count or as a fraction of all steps (rounded up, as transformers)."""
    if fraction:
        return math.ceil(fraction * total_steps)
    return int(steps)


def check_scheduler_kwargs(kind: str, kwargs: dict) -> str | None:
    """Why ``kwargs`` cannot be passed to the ``kind`` schedule, or None when they can (names only: values are
    checked when the schedule is built)."""
    parameters = inspect.signature(TYPE_TO_SCHEDULER_FUNCTION[kind]).parameters
    accepted = [p for p in parameters if p not in _OWN_ARGUMENTS]
    for name in kwargs:
        if name in _OWN_ARGUMENTS:
            return f"`{name}` is set by the trainer (from warmup_steps/warmup_ratio and the step count)"
        if name not in parameters:
            return f"the {kind!r} schedule has no argument `{name}` (it takes: {', '.join(accepted) or 'none'})"
    missing = [p for p in accepted if parameters[p].default is inspect.Parameter.empty and p not in kwargs]
    if missing:
        return f"the {kind!r} schedule needs {', '.join(f'`{p}`' for p in missing)} in lr_scheduler_kwargs"
    if "min_lr_rate" in parameters and ("min_lr" in kwargs) == ("min_lr_rate" in kwargs):
        return f"the {kind!r} schedule needs one of `min_lr` and `min_lr_rate` in lr_scheduler_kwargs"
    return None


def build_scheduler(optimizer: torch.optim.Optimizer, args, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """transformers' ``args.lr_scheduler_type`` schedule over ``total_steps`` optimizer steps, with the configured
    warm-up and ``args.lr_scheduler_kwargs``."""
    warmup = warmup_steps(total_steps, args.warmup_steps if args.warmup_steps >= 1 else 0, args.warmup_fraction)
    kind = args.lr_scheduler_type
    if kind == "constant" and warmup:
        # transformers' "constant" ignores warm-up; say so rather than drop it silently
        logger.warning(f"lr_scheduler_type='constant' ignores the {warmup}-step warm-up, as in transformers and TRL; "
                       "use 'constant_with_warmup' to warm up.")
    try:
        return get_scheduler(kind, optimizer, num_warmup_steps=warmup, num_training_steps=total_steps,
                             scheduler_specific_kwargs=dict(args.lr_scheduler_kwargs or {}))
    except (TypeError, ValueError) as error:
        raise ConfigError(f"lr_scheduler_type={kind!r} with lr_scheduler_kwargs={args.lr_scheduler_kwargs!r}: "
                          f"{error}") from error
