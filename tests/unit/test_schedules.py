"""Unit tests for trainers/schedules.py: warmup length, the lr multiplier, and the LambdaLR built from a config."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainers.configs import TrainingConfig
from trainers.schedules import build_scheduler, lr_multiplier, warmup_steps

KINDS = ("linear", "cosine", "constant", "constant_with_warmup")


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
# lr_multiplier, hand-computed
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "step,expected",
    [(0, 1.0), (1, 0.9), (5, 0.5), (9, 0.1), (10, 0.0), (15, 0.0)],
)
def test_linear_without_warmup(step, expected):
    assert lr_multiplier(step, "linear", 10, 0) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize(
    "step,expected",
    # warmup 4: (step + 1) / 5 for steps 0..3, then 1 - (step - 4) / (12 - 4)
    [(0, 0.2), (1, 0.4), (2, 0.6), (3, 0.8), (4, 1.0), (6, 0.75), (8, 0.5), (11, 0.125), (12, 0.0)],
)
def test_linear_with_warmup(step, expected):
    assert lr_multiplier(step, "linear", 12, 4) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize(
    "step,expected",
    [
        (0, 1.0),
        (3, 0.5 * (1 + math.cos(0.3 * math.pi))),  # 0.7938926...
        (5, 0.5),
        (7, 0.5 * (1 + math.cos(0.7 * math.pi))),  # 0.2061073...
        (10, 0.0),
        (15, 0.0),  # progress is capped at 1, so the cosine does not come back up
        (20, 0.0),
    ],
)
def test_cosine_without_warmup(step, expected):
    assert lr_multiplier(step, "cosine", 10, 0) == pytest.approx(expected, abs=1e-12)


def test_cosine_hand_values():
    assert lr_multiplier(3, "cosine", 10, 0) == pytest.approx(0.7938926261, abs=1e-9)
    assert lr_multiplier(7, "cosine", 10, 0) == pytest.approx(0.2061073739, abs=1e-9)


@pytest.mark.parametrize(
    "step,expected",
    # warmup 2 -> (step + 1) / 3; then progress = (step - 2) / 8
    [(0, 1 / 3), (1, 2 / 3), (2, 1.0), (4, 0.5 * (1 + math.cos(math.pi / 4))), (6, 0.5), (10, 0.0)],
)
def test_cosine_with_warmup(step, expected):
    assert lr_multiplier(step, "cosine", 10, 2) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("kind", ["constant", "constant_with_warmup"])
def test_constant_without_warmup(kind):
    assert [lr_multiplier(s, kind, 10, 0) for s in range(12)] == [1.0] * 12


@pytest.mark.parametrize("kind", ["constant", "constant_with_warmup"])
def test_constant_with_warmup(kind):
    values = [lr_multiplier(s, kind, 10, 3) for s in range(10)]
    assert values == pytest.approx([0.25, 0.5, 0.75] + [1.0] * 7, abs=1e-12)


@pytest.mark.parametrize("kind", KINDS)
def test_warmup_is_strictly_increasing_and_never_zero(kind):
    values = [lr_multiplier(s, kind, 100, 9) for s in range(10)]
    assert values == pytest.approx([(s + 1) / 10 for s in range(10)], abs=1e-12)
    assert values[0] > 0


@pytest.mark.parametrize("kind", ["linear", "cosine"])
@pytest.mark.parametrize("total,warmup", [(10, 0), (10, 3), (1000, 100), (5, 4)])
def test_decay_reaches_zero_at_total_steps(kind, total, warmup):
    assert lr_multiplier(total, kind, total, warmup) == pytest.approx(0.0, abs=1e-12)
    # the last trained step (total - 1) is already close to 0 and no higher than the step before
    last = lr_multiplier(total - 1, kind, total, warmup)
    assert 0 < last <= 1.0 / (total - warmup) + 1e-12


def test_unknown_kind_raises_after_warmup():
    with pytest.raises(ValueError, match="polynomial"):
        lr_multiplier(0, "polynomial", 10, 0)


@settings(max_examples=200, deadline=None, database=None)
@given(
    kind=st.sampled_from(KINDS),
    total=st.integers(1, 500),
    warmup=st.integers(0, 100),
    step=st.integers(0, 1200),
)
def test_multiplier_in_unit_interval(kind, total, warmup, step):
    value = lr_multiplier(step, kind, total, warmup)
    assert 0.0 <= value <= 1.0


@settings(max_examples=100, deadline=None, database=None)
@given(kind=st.sampled_from(["linear", "cosine"]), total=st.integers(1, 300), warmup=st.integers(0, 50))
def test_decay_is_monotone_after_warmup(kind, total, warmup):
    values = [lr_multiplier(s, kind, total, warmup) for s in range(warmup, max(total, warmup) + 5)]
    assert all(a >= b for a, b in zip(values, values[1:]))
    assert values[0] == 1.0


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
    config = TrainingConfig(learning_rate=0.1, warmup_steps=2, lr_scheduler_type="linear")
    expected = [0.1 / 3, 0.2 / 3, 0.1, 0.075, 0.05, 0.025, 0.0]
    assert _lrs(config, total_steps=6, n=7) == pytest.approx(expected, abs=1e-12)


def test_build_scheduler_linear_no_warmup():
    config = TrainingConfig(learning_rate=1.0)
    assert _lrs(config, total_steps=4, n=5) == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0], abs=1e-12)


def test_build_scheduler_cosine():
    config = TrainingConfig(learning_rate=2.0, lr_scheduler_type="cosine", warmup_steps=1)
    # warmup 1: step 0 -> 1/2; then progress (s - 1) / 4
    expected = [1.0, 2.0, 1 + math.cos(math.pi / 4), 1.0, 1 + math.cos(3 * math.pi / 4), 0.0]  # 2.0 x 0.5 x (1 + cos)
    assert _lrs(config, total_steps=5, n=6) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("kind", ["constant", "constant_with_warmup"])
def test_build_scheduler_constant_honours_warmup(kind):
    config = TrainingConfig(learning_rate=1.0, lr_scheduler_type=kind, warmup_steps=3)
    assert _lrs(config, total_steps=6, n=6) == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0], abs=1e-12)


def test_build_scheduler_warmup_as_fraction_in_warmup_steps():
    config = TrainingConfig(learning_rate=1.0, warmup_steps=0.1)  # 10% of 20 steps = 2
    lrs = _lrs(config, total_steps=20, n=21)
    assert lrs[:3] == pytest.approx([1 / 3, 2 / 3, 1.0], abs=1e-12)
    assert lrs[12] == pytest.approx(1 - 10 / 18, abs=1e-12)
    assert lrs[20] == pytest.approx(0.0, abs=1e-12)


def test_build_scheduler_warmup_ratio():
    config = TrainingConfig(learning_rate=1.0, warmup_ratio=0.25)  # 25% of 8 steps = 2
    lrs = _lrs(config, total_steps=8, n=9)
    assert lrs == pytest.approx([1 / 3, 2 / 3, 1.0, 5 / 6, 4 / 6, 3 / 6, 2 / 6, 1 / 6, 0.0], abs=1e-12)


def test_build_scheduler_fraction_rounds_up():
    config = TrainingConfig(learning_rate=1.0, warmup_steps=0.5, lr_scheduler_type="constant")  # ceil(3.5) = 4
    assert _lrs(config, total_steps=7, n=6) == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0, 1.0], abs=1e-12)


def test_build_scheduler_same_warmup_from_fraction_and_ratio():
    a = _lrs(TrainingConfig(learning_rate=1.0, warmup_steps=0.3, lr_scheduler_type="cosine"), 10, 11)
    b = _lrs(TrainingConfig(learning_rate=1.0, warmup_ratio=0.3, lr_scheduler_type="cosine"), 10, 11)
    c = _lrs(TrainingConfig(learning_rate=1.0, warmup_steps=3, lr_scheduler_type="cosine"), 10, 11)
    assert a == b == c
    assert a[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0], abs=1e-12)
