"""Asynchronous GRPO with 2 processes (tests/distributed/async_job.py): each process's producer samples its own
rows, the weight pushes wait for both producers to finish their rounds."""

import os

import pytest

from tests.conftest import REPO, launch, rank_reports

JOB = os.path.join(REPO, "tests", "distributed", "async_job.py")


@pytest.mark.distributed
@pytest.mark.parametrize("template", ["multi_gpu", "zero2"])
def test_async_grpo_two_processes(template, tiny_model_dir, tmp_path):
    """Under DDP and ZeRO-2: bound 0 ends with the synchronous run's weights on both processes (the same on each);
    bound 1 trains the rounds after the first at most one step stale, with evaluations between steps."""
    launch(template, JOB, tiny_model_dir, str(tmp_path))
    reports = rank_reports(tmp_path)
    assert [r["rank"] for r in reports] == [0, 1]
    for report in reports:
        assert report["bound0"] == report["sync"]
        # bound 1: at most one step stale, one step for most rounds (a producer thread that starts a round only
        # after the step's weight push samples it with those weights: a race on a busy host)
        stale = report["staleness1"]
        assert report["staleness0"] == [0.0] * 4 and stale[0] == 0.0 and set(stale) <= {0.0, 1.0}
        assert stale.count(1.0) >= 2, stale
        assert len(report["eval_rewards"]) == 2
    assert reports[0]["sync"] == reports[1]["sync"] and reports[0]["bound1"] == reports[1]["bound1"]
