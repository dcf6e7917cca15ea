"""GRPO's tool loop with 2 processes under the DDP and ZeRO-3 templates (tests/distributed/tool_loop_job.py)."""

import math
import os
import time

import pytest

from tests.conftest import REPO, launch, rank_reports

JOB = os.path.join(REPO, "tests", "distributed", "tool_loop_job.py")


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["multi_gpu", "zero3"])
def test_tool_loop_two_processes(name, tiny_model_dir, tmp_path):
    """Each process runs its own rollouts' calls (4 calls, 1 failed on process 0, whose first rollout calls twice,
    so its third turn is sampled while process 1 samples a dummy row; 2 calls, 1 failed, 1 malformed block on
    process 1); the tools/* metrics both processes log are over both (6 calls of 8 rollouts, 2 failed: 1/3, where
    the processes alone have 1/4 and 1/2), and both train one model, with a finite loss."""
    launch(name, JOB, tiny_model_dir, str(tmp_path), "train", timeout=300)  # ~35 s; a hang fails in 5 min
    reports = rank_reports(tmp_path)
    assert [r["rank"] for r in reports] == [0, 1] and reports[0]["zero_stage"] == {"multi_gpu": 0, "zero3": 3}[name]
    local = [{"rollouts": 4, "calls": 4, "failures": 1, "malformed": 0, "truncated_results": 0},
             {"rollouts": 4, "calls": 2, "failures": 1, "malformed": 1, "truncated_results": 0}]
    assert [r["counts"] for r in reports] == [[local[0]] * 3, [local[1]] * 3]  # one round per step
    histories = [r["history"] for r in reports]
    assert len(histories[0]) == len(histories[1]) == 3
    for step in range(3):
        for rank in range(2):
            record = histories[rank][step]
            assert record["tools/call_frequency"] == 6 / 8
            assert record["tools/failure_frequency"] == pytest.approx(1 / 3, abs=1e-6)  # logged to 6 digits
            assert record["tools/malformed_frequency"] == 1 / 8 and record["tools/truncated_results"] == 0
        untimed = [{k: v for k, v in h[step].items() if k not in ("step_time", "tokens_per_second")} for h in histories]
        assert untimed[0] == untimed[1]  # timings are per process
    assert all(math.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in histories[0])  # it trained
    assert reports[0]["checksum"] == pytest.approx(reports[1]["checksum"], rel=1e-9)
    assert reports[0]["checksum"] != pytest.approx(reports[0]["initial"], rel=1e-9)


@pytest.mark.distributed
def test_a_failing_environment_reset_on_one_process_stops_both(tiny_model_dir, tmp_path):
    started = time.time()
    result = launch("multi_gpu", JOB, tiny_model_dir, str(tmp_path), "fail_reset", check=False, timeout=300)
    elapsed = time.time() - started
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "RuntimeError: the environment failed on purpose (rank 1)" in output
    assert "process 1 failed, so this process stops too: RuntimeError: the environment failed on purpose" in output
    assert not (tmp_path / "report-0.json").exists() and not (tmp_path / "report-1.json").exists()
    assert elapsed < 90, f"took {elapsed:.0f} s"
