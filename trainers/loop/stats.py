"""Step statistics: what ``compute_loss`` and ``evaluation_stats`` report, and how it is reduced.

A statistic is one of two kinds:
  - a ``(numerator, denominator)`` pair: both are summed over micro-batches and processes before dividing, so
    the result is a mean over everything the step (or evaluation) covered, weighted by the denominators;
  - an ``Extreme``: one value per micro-batch, reduced by its min or max over processes, then averaged over
    the step's micro-batches (TRL's clip_ratio/low_min and high_max).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from trainers.parallel import distributed as dist
class Extreme(NamedTuple):
    """A micro-batch statistic reduced by its min or max over processes. A NaN value (nothing to measure) is left
    out."""
    value: torch.Tensor  # a scalar
    reduce: str  # "min" or "max"


Stats = dict[str, tuple[torch.Tensor, torch.Tensor] | Extreme]


class StepStats:
    """One optimizer step's statistics, added micro-batch by micro-batch, reduced with two collectives."""

    def __init__(self, device: torch.device):
        self.device = device
        self.sums: dict[str, torch.Tensor] = {}  # name -> [numerator, denominator], this process
        self.extremes: dict[str, list[Extreme]] = {}  # name -> one per micro-batch

    def add(self, stats: Stats) -> None:
        for name, entry in stats.items():
            if isinstance(entry, Extreme):
                self.extremes.setdefault(name, []).append(entry)
                continue
            pair = _pair(entry, self.device)
            self.sums[name] = self.sums[name] + pair if name in self.sums else pair

    def reduce(self, accelerator, head: list[torch.Tensor]) -> tuple[list[float], dict[str, float]]:
        """The step's metrics over every process. ``head``: scalars summed over processes in the same
        collective as the pairs (returned first, in order)."""
        names = sorted(self.sums)
        packed = dist.all_reduce_sum(accelerator, torch.stack(head + [v for n in names for v in self.sums[n]]))
        packed = packed.tolist()
        head_sums, pairs = packed[:len(head)], packed[len(head):]
        metrics = {name: _ratio(pairs[2 * i], pairs[2 * i + 1]) for i, name in enumerate(names)}
        metrics.update(reduce_extremes(accelerator, self.extremes))
        return head_sums, metrics


def reduce_pairs(accelerator, stats: Stats, prefix: str = "") -> dict[str, float]:
    """Numerator over denominator of each pair, both summed over processes (evaluation: no micro-batches)."""
    names = sorted(stats)
    packed = torch.stack([_pair(stats[name], accelerator.device) for name in names])  # [names, 2]
    packed = dist.all_reduce_sum(accelerator, packed).tolist()
    return {f"{prefix}{name}": _ratio(num, den) for name, (num, den) in zip(names, packed)}


def reduce_extremes(accelerator, extremes: dict[str, list[Extreme]]) -> dict[str, float]:
    """Each Extreme statistic: per micro-batch, the min or max over processes; then the mean over the step's
    micro-batches (every process has the same number). One collective for all of them."""
    if not extremes:
        return {}
    names = sorted(extremes)
    # min(x) = -max(-x): one max-reduce serves both; NaN (nothing measured) becomes -inf so it never wins
    sign = torch.tensor([[-1.0 if extremes[n][0].reduce == "min" else 1.0] for n in names], device=accelerator.device)
    # [names, micro-batches]
    values = torch.stack([torch.stack([e.value.detach().float() for e in extremes[n]]) for n in names])
    signed = values.to(accelerator.device) * sign
    signed = torch.where(torch.isnan(signed), -math.inf, signed)
    reduced = dist.all_reduce_max(accelerator, signed)
    reduced = torch.where(torch.isneginf(reduced), torch.nan, reduced) * sign
    return {name: float(torch.nanmean(row)) for name, row in zip(names, reduced)}


def _pair(entry: tuple, device: torch.device) -> torch.Tensor:
    """[numerator, denominator] as one float tensor (each summed, should it have several elements)."""
    num, den = entry
    return torch.stack([num.detach().float().sum(), torch.as_tensor(den, device=device).float().sum()])


def _ratio(num: float, den: float) -> float:
    return num / den if den else float("nan")
