"""Distillation with 2 processes under the DDP and ZeRO-3 templates: on the dataset's completions the run equals one
process with twice the rows (the loss is the divergence over every process's tokens), the teacher is partitioned
under ZeRO-3 (each process holds half of it), and on-policy steps (the student samples) run."""

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO, launch, rank_reports

JOB = os.path.join(REPO, "tests", "distributed", "distill_job.py")


@pytest.fixture(scope="module")
def one_process(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("distill-one")
    subprocess.run([sys.executable, JOB, tiny_model_dir, str(out), "4"], check=True, cwd=REPO,
                   env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
    with open(out / "report-0.json") as f:
        return json.load(f)


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["multi_gpu", "zero3"])
def test_two_processes_equal_one_and_zero3_partitions_the_teacher(name, tiny_model_dir, tmp_path, one_process):
    launch(name, JOB, tiny_model_dir, str(tmp_path))
    reports = rank_reports(tmp_path)
    assert [r["zero_stage"] for r in reports] == [3 if name == "zero3" else 0] * 2
    for report in reports:
        assert report["losses"] == pytest.approx(one_process["losses"], rel=1e-4)
        assert report["checksum"] == pytest.approx(one_process["checksum"], rel=1e-4, abs=1e-4)
        assert len(report["on_policy_losses"]) == 2 and all(loss > 0 for loss in report["on_policy_losses"])
        if name == "zero3":  # a shard per process, about half of every weight (ZeRO pads each to the world size)
            assert report["teacher_held"] < 0.55 * report["teacher_full"]
        else:
            assert report["teacher_held"] == report["teacher_full"]
    assert reports[0]["on_policy_losses"] == reports[1]["on_policy_losses"]  # logged over both processes
