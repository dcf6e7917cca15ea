"""fp16 without DeepSpeed: an overflowing step is skipped by Accelerate's GradScaler, which then lowers its scale,
and the next step trains (``trainers.optim.optimizers.step_unless_nonfinite``, the base trainer's optimizer step).

A GPU is what runs fp16 for real; the scaler's bookkeeping is the same on CPU (``torch.amp.GradScaler("cpu")``),
driven as Accelerate drives it: ``accelerator.clip_grad_norm_`` unscales, ``AcceleratedOptimizer.step`` steps and
updates the scaler."""

import math

import pytest
import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer

from trainers.optim.optimizers import step_unless_nonfinite


def test_an_overflow_is_skipped_and_the_next_step_trains():
    Accelerator(cpu=True)  # the state AcceleratedOptimizer reads
    weight = torch.nn.Parameter(torch.ones(4))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    optimizer = AcceleratedOptimizer(torch.optim.SGD([weight], lr=0.1), device_placement=False, scaler=scaler)
    updated, moved = [], []
    for factor in (1e36, 1.0, 1.0):  # the first step's scaled gradient overflows float32, as fp16's first ones do
        before = weight.detach().clone()
        scaler.scale((weight * factor).sum()).backward()
        scaler.unscale_(optimizer.optimizer)  # what accelerator.clip_grad_norm_ does first
        grad_norm = float(torch.nn.utils.clip_grad_norm_([weight], float("inf")))
        updated.append(step_unless_nonfinite(optimizer, grad_norm))
        optimizer.zero_grad(set_to_none=True)
        moved.append(not torch.equal(before, weight.detach()))
    assert updated == [False, True, True] and moved == [False, True, True]
    assert scaler.get_scale() == 2.0**15  # halved once, by the overflow
    assert torch.allclose(weight.detach(), torch.full((4,), 1 - 2 * 0.1))


@pytest.mark.parametrize("grad_norm", [float("nan"), float("inf")])
def test_without_a_scaler_a_non_finite_step_is_not_applied(grad_norm):
    weight = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    weight.grad = torch.ones(2)
    assert not step_unless_nonfinite(optimizer, grad_norm)
    assert torch.equal(weight.detach(), torch.ones(2))
    assert step_unless_nonfinite(optimizer, 2.0) and math.isclose(float(weight.detach()[0]), 0.9, rel_tol=1e-6)
