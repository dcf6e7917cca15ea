"""GRPO's entropy bonus coefficient, as TRL 1.16 sets it: fixed (``entropy_coef``), or adaptive
(``use_adaptive_entropy``, Skywork-OR1, arXiv:2505.22312).

Adaptive control: after every optimizer step the coefficient moves by ``entropy_coef_delta`` toward more bonus
when the step's entropy (token-weighted over every micro-batch and process) was at or below ``entropy_target``,
and toward less otherwise, within [entropy_coef_min, entropy_coef_max]. The bonus is applied only while the
last step's entropy is at or below the target, so the first step (no entropy measured yet) applies none.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass


@dataclass
class EntropyControl:
    coef: float
    adaptive: bool = False
    target: float = 0.2
    delta: float = 0.005
    low: float = 0.0
    high: float = 1.0
    last_entropy: float = math.inf  # the entropy of the last step; inf before the first

    @property
    def applied(self) -> float:
        """The coefficient every micro-batch of the coming step applies."""
        if self.adaptive and self.last_entropy > self.target:
            return 0.0
        return self.coef

    def update(self, step_entropy: float) -> None:
        """After an optimizer step: adapt the coefficient to that step's entropy (no-op when fixed)."""
        if not self.adaptive:
            return
        if math.isnan(step_entropy):  # a step without loss tokens: TRL's clamped mean reads 0
            step_entropy = 0.0
        if step_entropy <= self.target:
            self.coef = min(self.coef + self.delta, self.high)
        else:
            self.coef = max(self.coef - self.delta, self.low)
        self.last_entropy = step_entropy


def save_entropy_control(folder: str, rank: int, control: EntropyControl) -> None:
    """The adaptive coefficient and the entropy it last saw, per process (a resumed run continues from them)."""
    with open(os.path.join(folder, f"entropy-{rank}.json"), "w") as f:
        json.dump(dataclasses.asdict(control), f)


def load_entropy_control(folder: str, rank: int, control: EntropyControl) -> None:
    path = os.path.join(folder, f"entropy-{rank}.json")
    if os.path.exists(path):
        with open(path) as f:
            saved = json.load(f)
        control.coef, control.last_entropy = saved["coef"], saved["last_entropy"]
