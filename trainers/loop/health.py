"""Health warnings: small tested rules over a run's metrics history.

A history is the list of metrics records a run logs (``trainer.state.log_history``, or the lines of
``output_dir/metrics.jsonl``). Each rule is a pure function ``rule(history) -> str | None`` that returns one
plain-language warning, saying what looks wrong and what to try, or None. A rule only reads records that hold
its metric, so eval records quietly give None.

``HealthMonitor`` runs a trainer's rules (``BaseTrainer.HEALTH_RULES``) after each log and reports each warning
once per run; ``replay`` gives the warnings a monitor would have raised while the history was being written
(``trainers report`` shows them). The rule here is every trainer's: a non-finite ``loss`` or ``grad_norm``; GRPO's
own (reward variance, entropy, truncation, length, KL) are in trainers/sampling/health.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable

Rule = Callable[[list[dict]], str | None]

# ---------------------------------------------------------------------------------------------------- helpers

def _number(value) -> float | None:
    """``value`` as a float when it is a real number (not bool/None/str), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def series(history: list[dict], name: str) -> list[tuple[int | None, float]]:
    """(step, value) of every record that holds a finite number for ``name``, in order. train()'s closing record
    (``train_runtime``) is left out: the trainer metrics it carries are means over the steps after the last step
    record (or over the whole run), not a step's."""
    out = []
    for record in history:
        if "train_runtime" in record:
            continue
        value = _number(record.get(name))
        if value is not None and math.isfinite(value):
            out.append((record.get("step"), value))
    return out


def mean_of(values: list[float]) -> float:
    return sum(values) / len(values)


def at_step(step) -> str:
    return f"step {step}" if step is not None else "the latest log"


# ---------------------------------------------------------------------------------------------------- rules

def nonfinite_loss(history: list[dict]) -> str | None:
    """A loss or gradient norm was NaN or infinite."""
    for record in history:
        for name in ("loss", "grad_norm"):
            value = _number(record.get(name))
            if value is not None and not math.isfinite(value):
                return (f"{name} was {value} at {at_step(record.get('step'))}; optimizer steps with a non-finite "
                        f"gradient are skipped, and training stops after max_consecutive_nonfinite_steps of them. "
                        f"Try: lower learning_rate, bf16 instead of fp16, a max_grad_norm (e.g. 1.0), and check the "
                        f"data and reward functions for inf/NaN.")
    return None


RULES: tuple[Rule, ...] = (nonfinite_loss,)  # every trainer's; GRPO adds its own (trainers/sampling/health.py)


# ---------------------------------------------------------------------------------------------------- monitor

class HealthMonitor:
    """Runs every rule over the history; each rule's warning is returned only the first time it fires."""

    def __init__(self, rules: tuple[Rule, ...] = RULES):
        self.rules = tuple(rules)
        self.fired: set[str] = set()  # names of rules that already warned in this run

    def check(self, history: list[dict]) -> list[str]:
        """Warnings of the rules that fire now and never fired before (in rule order)."""
        warnings = []
        for rule in self.rules:
            if rule.__name__ in self.fired:
                continue  # warn once: a condition that persists would otherwise repeat at every log
            warning = rule(history)
            if warning is not None:
                self.fired.add(rule.__name__)
                warnings.append(warning)
        return warnings

    def replay(self, history: list[dict]) -> list[str]:
        """The warnings a fresh monitor raises when checked after each record of ``history``, as during training
        (so a problem that later went away is still reported)."""
        warnings = []
        for end in range(1, len(history) + 1):
            warnings.extend(self.check(history[:end]))
        return warnings
