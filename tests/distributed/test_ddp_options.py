"""transformers' ddp_* options reach DistributedDataParallel and the process group (2 processes, multi_gpu.yaml
on CPU: DDP over gloo); a parameter outside the loss gets an error that names ddp_find_unused_parameters; and
per-micro-batch min/max statistics (TRL's clip_ratio/low_min, high_max) reduce over processes; and a callback's
request (a checkpoint, the end of training) made on one rank is served on both. One launch runs every check of
tests/distributed/ddp_options_job.py's RUNS, one after the other in the same processes; the callbacks job keeps a
launch of its own (if it regressed, a rank would hang, and the others' reports with it)."""

import os

import pytest

from tests.conftest import REPO, launch, rank_reports

JOB = os.path.join(REPO, "tests", "distributed", "ddp_options_job.py")
CALLBACKS_JOB = os.path.join(REPO, "tests", "distributed", "callbacks_job.py")
# the runs of JOB's one launch: "options" first, as its ddp_timeout reaches only the process group the first run
# makes; "unused" last, as its failed training leaves its DDP's reducer mid-step
RUNS = ["options", "unused-found", "extremes", "unused"]


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    """``runs(run)``: the reports of one run of JOB (one per rank), from its one launch, made once for the module
    when a test first needs it."""
    folder = None

    def reports(run: str) -> list[dict]:
        nonlocal folder
        if folder is None:
            folder = tmp_path_factory.mktemp("ddp_options")
            launch("multi_gpu", JOB, tiny_model_dir, str(folder), *RUNS)
        return rank_reports(folder / run)

    return reports


@pytest.mark.distributed
def test_ddp_options_reach_ddp_and_the_process_group(runs):
    for report in runs("options"):
        assert report["wrapper"] == "DistributedDataParallel" and report["steps"] == 3
        assert report["find_unused_parameters"] is True  # DDP's default is False
        assert report["bucket_bytes_cap"] == 1024 * 1024  # DDP's default is 25 MiB
        assert report["broadcast_buffers"] is False
        assert report["timeout_seconds"] == 123


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["unused", "unused-found"])
def test_a_parameter_outside_the_loss_names_ddp_find_unused_parameters(runs, mode):
    for report in runs(mode):
        if mode == "unused":
            assert "steps" not in report
            assert "Set ddp_find_unused_parameters=True" in report["error"]
        else:
            assert report["steps"] == 3 and "error" not in report


@pytest.mark.distributed
def test_min_and_max_statistics_reduce_over_processes_then_average_over_micro_batches(runs):
    for report in runs("extremes"):
        # per micro-batch min over ranks: 0.1, 0.4 (rank 0 measured nothing), 0.3, nothing at all -> mean of 3
        assert report["low_min"] == pytest.approx((0.1 + 0.4 + 0.3) / 3)
        assert report["high_max"] == pytest.approx((0.7 + 0.1 + 0.6 + 0.2) / 4)


@pytest.mark.distributed
def test_a_callbacks_request_on_one_rank_is_served_on_every_rank(tiny_model_dir, tmp_path):
    launch("multi_gpu", CALLBACKS_JOB, tiny_model_dir, str(tmp_path), timeout=180)  # alone, a rank would hang
    for report in rank_reports(tmp_path):
        assert report["global_step"] == 2 and report["steps_seen"] == [1, 2]  # rank 0 asked to stop at step 2
        assert "checkpoint-1" in report["checkpoints"]  # rank 1 asked for it
