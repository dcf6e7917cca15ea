"""trainers/loop/stats.py in one process: pairs are summed over micro-batches before dividing, extremes are averaged
over micro-batches leaving NaN out. Over 2 processes: tests/distributed/test_ddp_options.py."""

import math
from types import SimpleNamespace

import pytest
import torch

from trainers.loop.stats import Extreme, StepStats, reduce_pairs

ONE_PROCESS = SimpleNamespace(num_processes=1, device=torch.device("cpu"))


def test_a_step_divides_summed_numerators_by_summed_denominators():
    step = StepStats(ONE_PROCESS.device)
    step.add({"entropy": (torch.tensor([1.0, 2.0]), torch.tensor(2.0)), "low": Extreme(torch.tensor(0.5), "min")})
    step.add({"entropy": (torch.tensor(6.0), 1.0), "low": Extreme(torch.tensor(float("nan")), "min"),
              "empty": (torch.tensor(0.0), 0.0)})
    head, metrics = step.reduce(ONE_PROCESS, [torch.tensor(3.0), torch.tensor(4.0)])
    assert head == [3.0, 4.0]
    assert metrics["entropy"] == pytest.approx(9.0 / 3.0)  # not the mean of 1.5 and 6
    assert metrics["low"] == 0.5  # the NaN micro-batch measured nothing
    assert math.isnan(metrics["empty"])


def test_evaluation_pairs_take_the_prefix():
    stats = {"loss": (torch.tensor([2.0, 4.0]), torch.tensor(4.0)), "mean_token_accuracy": (torch.tensor(1.0), 2)}
    assert reduce_pairs(ONE_PROCESS, stats, prefix="eval_") == {"eval_loss": 1.5, "eval_mean_token_accuracy": 0.5}
