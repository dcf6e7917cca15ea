"""Unit tests for trainers/optim/schedules.py: warmup length, the lr_scheduler_kwargs check, and the schedule built from a
config (transformers' own, so the values here are also transformers' and TRL's)."""

import logging
import math

import pytest
import torch

from trainers.config.training import LR_SCHEDULER_TYPES, TrainingConfig
from trainers.errors import ConfigError
from trainers.optim.schedules import build_scheduler, warmup_steps

# ------------------------------------------------------------------------------------------------------------
# warmup_steps
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "total,steps,fraction,expected",
    [
        (100, 0, None, 0),
        (100, 5, None, 5),
        (100, 5.0, None, 5),
        (100, 0, 0.1, 10),
        (10, 0, 0.25, 3),  # ceil(2.5)
        (7, 0, 0.5, 4),  # ceil(3.5)
        (8, 0, 0.25, 2),
        (100, 5, 0.2, 20),  # a fraction wins over a count
        (100, 5, 0.0, 5),  # a zero fraction means "not given"
        (1, 0, 0.01, 1),  # any non-zero fraction warms up at least one step
    ],
)
def test_warmup_steps(total, steps, fraction, expected):
    result = warmup_steps(total, steps, fraction)
    assert result == expected
    assert isinstance(result, int)


# ------------------------------------------------------------------------------------------------------------
# build_scheduler
# ------------------------------------------------------------------------------------------------------------


class DummyOptimizer(torch.optim.Optimizer):
    """Just enough of an optimizer for LambdaLR (a real one's first construction imports torch._dynamo: ~2 s)."""

    def __init__(self, lr: float):
        self.defaults = {"lr": lr}
        self.state = {}
        self.param_groups = [{"params": [], "lr": lr}]

    def step(self, closure=None):
        return None


def _lrs(config: TrainingConfig, total_steps: int, n: int) -> list[float]:
    """Learning rates the optimizer uses at steps 0..n-1."""
    optimizer = DummyOptimizer(config.learning_rate)
    scheduler = build_scheduler(optimizer, config, total_steps)
    lrs = []
    for _ in range(n):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


def test_build_scheduler_linear_with_warmup_steps():
    # transformers: step / warmup during warm-up (the first step at lr 0), then (total - step) / (total - warmup)
    config = TrainingConfig(learning_rate=0.1, warmup_steps=2, lr_scheduler_type="linear")
    expected = [0.0, 0.05, 0.1, 0.075, 0.05, 0.025, 0.0]
    assert _lrs(config, total_steps=6, n=7) == pytest.approx(expected, abs=1e-12)


def test_build_scheduler_linear_no_warmup():
    config = TrainingConfig(learning_rate=1.0)
    assert _lrs(config, total_steps=4, n=5) == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0], abs=1e-12)


def test_build_scheduler_cosine():
    config = TrainingConfig(learning_rate=2.0, lr_scheduler_type="cosine", warmup_steps=1)
    # warmup 1: step 0 -> 0; then progress (s - 1) / 4, lr = 2.0 x 0.5 x (1 + cos(pi x progress))
    expected = [0.0, 2.0, 1 + math.cos(math.pi / 4), 1.0, 1 + math.cos(3 * math.pi / 4), 0.0]
    assert _lrs(config, total_steps=5, n=6) == pytest.approx(expected, abs=1e-12)


def test_build_scheduler_cosine_hand_values():
    lrs = _lrs(TrainingConfig(learning_rate=1.0, lr_scheduler_type="cosine"), total_steps=10, n=11)
    assert lrs[3] == pytest.approx(0.7938926261, abs=1e-9)
    assert lrs[7] == pytest.approx(0.2061073739, abs=1e-9)
    assert lrs[10] == pytest.approx(0.0, abs=1e-12)


def test_build_scheduler_constant_with_warmup():
    config = TrainingConfig(learning_rate=1.0, lr_scheduler_type="constant_with_warmup", warmup_steps=3)
    assert _lrs(config, total_steps=6, n=6) == pytest.approx([0.0, 1 / 3, 2 / 3, 1.0, 1.0, 1.0], abs=1e-12)


def test_build_scheduler_constant_ignores_warmup_and_says_so(caplog):
    config = TrainingConfig(learning_rate=1.0, lr_scheduler_type="constant", warmup_steps=3)
    with caplog.at_level(logging.WARNING, logger="trainers"):
        lrs = _lrs(config, total_steps=6, n=6)
    assert lrs == [1.0] * 6
    assert "constant_with_warmup" in caplog.text and "3-step warm-up" in caplog.text


def test_build_scheduler_warmup_as_fraction_in_warmup_steps():
    config = TrainingConfig(learning_rate=1.0, warmup_steps=0.1)  # 10% of 20 steps = 2
    lrs = _lrs(config, total_steps=20, n=21)
    assert lrs[:3] == pytest.approx([0.0, 0.5, 1.0], abs=1e-12)
    assert lrs[12] == pytest.approx(8 / 18, abs=1e-12)
    assert lrs[20] == pytest.approx(0.0, abs=1e-12)


def test_build_scheduler_warmup_ratio():
    config = TrainingConfig(learning_rate=1.0, warmup_ratio=0.25)  # 25% of 8 steps = 2
    lrs = _lrs(config, total_steps=8, n=9)
    assert lrs == pytest.approx([0.0, 0.5, 1.0, 5 / 6, 4 / 6, 3 / 6, 2 / 6, 1 / 6, 0.0], abs=1e-12)


def test_build_scheduler_fraction_rounds_up():
    config = TrainingConfig(learning_rate=1.0, warmup_steps=0.5, lr_scheduler_type="constant_with_warmup")
    # ceil(0.5 x 7) = 4 warm-up steps
    assert _lrs(config, total_steps=7, n=6) == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0, 1.0], abs=1e-12)


def test_build_scheduler_same_warmup_from_fraction_and_ratio():
    a = _lrs(TrainingConfig(learning_rate=1.0, warmup_steps=0.3, lr_scheduler_type="cosine"), 10, 11)
    b = _lrs(TrainingConfig(learning_rate=1.0, warmup_ratio=0.3, lr_scheduler_type="cosine"), 10, 11)
    c = _lrs(TrainingConfig(learning_rate=1.0, warmup_steps=3, lr_scheduler_type="cosine"), 10, 11)
    assert a == b == c
    assert a[:4] == pytest.approx([0.0, 1 / 3, 2 / 3, 1.0], abs=1e-12)


# ------------------------------------------------------------------------------------------------------------
# lr_scheduler_kwargs and the schedules beyond the common four
# ------------------------------------------------------------------------------------------------------------


def test_cosine_with_min_lr_rate_ends_at_the_floor():
    config = TrainingConfig(learning_rate=1.0, lr_scheduler_type="cosine_with_min_lr",
                            lr_scheduler_kwargs={"min_lr_rate": 0.1})
    # 0.1 + 0.9 x 0.5 x (1 + cos(pi x step / 4))
    expected = [1.0, 0.1 + 0.45 * (1 + math.cos(math.pi / 4)), 0.55, 0.1 + 0.45 * (1 + math.cos(3 * math.pi / 4)), 0.1]
    assert _lrs(config, total_steps=4, n=5) == pytest.approx(expected, abs=1e-12)


def test_cosine_with_restarts_cycles():
    config = TrainingConfig(learning_rate=1.0, lr_scheduler_type="cosine_with_restarts",
                            lr_scheduler_kwargs={"num_cycles": 2})
    # two half-cosines over 4 steps: 0.5 x (1 + cos(pi x ((2 x step / 4) mod 1)))
    assert _lrs(config, total_steps=4, n=4) == pytest.approx([1.0, 0.5, 1.0, 0.5], abs=1e-12)


def test_warmup_stable_decay():
    config = TrainingConfig(learning_rate=1.0, lr_scheduler_type="warmup_stable_decay", warmup_steps=2,
                            lr_scheduler_kwargs={"num_decay_steps": 2, "decay_type": "linear"})
    # warm up 2, stable 4 (of 8), decay 2 linearly to 0
    assert _lrs(config, total_steps=8, n=9) == pytest.approx([0.0, 0.5, 1, 1, 1, 1, 1.0, 0.5, 0.0], abs=1e-12)


@pytest.mark.parametrize("kind", LR_SCHEDULER_TYPES)
def test_every_type_builds_and_starts_at_peak_without_warmup(kind):
    kwargs = {"cosine_with_min_lr": {"min_lr": 1e-3}, "cosine_warmup_with_min_lr": {"min_lr_rate": 0.1},
              "warmup_stable_decay": {"num_decay_steps": 3}}.get(kind)
    lrs = _lrs(TrainingConfig(learning_rate=1.0, lr_scheduler_type=kind, lr_scheduler_kwargs=kwargs), 10, 10)
    assert lrs[0] > 0.95  # cosine_warmup_with_min_lr is already one step into its cosine (0.978)
    assert all(0.0 <= lr <= 1.0 for lr in lrs)


@pytest.mark.parametrize(
    "kind,kwargs,says",
    [
        ("cosine", {"min_lr_rate": 0.1}, "has no argument `min_lr_rate` (it takes: num_cycles)"),
        ("linear", {"num_warmup_steps": 3}, "set by the trainer"),
        ("warmup_stable_decay", None, "needs `num_decay_steps`"),
        ("cosine_with_min_lr", None, "one of `min_lr` and `min_lr_rate`"),
        ("cosine_with_min_lr", {"min_lr": 0.0, "min_lr_rate": 0.1}, "one of `min_lr` and `min_lr_rate`"),
    ],
)
def test_bad_scheduler_kwargs_are_refused_at_construction(kind, kwargs, says):
    with pytest.raises(ConfigError, match="lr_scheduler_kwargs") as info:
        TrainingConfig(lr_scheduler_type=kind, lr_scheduler_kwargs=kwargs)
    assert says in str(info.value)


def test_bad_scheduler_value_is_a_config_error_when_built():
    config = TrainingConfig(learning_rate=1.0, lr_scheduler_type="warmup_stable_decay",
                            lr_scheduler_kwargs={"num_decay_steps": 3, "decay_type": "exponential"})
    with pytest.raises(ConfigError, match="lr_scheduler_kwargs=.*decay_type"):
        _lrs(config, 10, 1)


@pytest.mark.parametrize("kind", ["reduce_lr_on_plateau", "greedy"])
def test_metric_driven_schedules_are_refused(kind):
    with pytest.raises(ConfigError, match="lr_scheduler_type"):
        TrainingConfig(lr_scheduler_type=kind)
