"""Failures in a 2-process job: no silent hangs, and a graceful stop on SIGTERM for all processes together."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import CONFIGS, REPO, free_port, launch

JOB = os.path.join(REPO, "tests", "distributed", "failing_job.py")


@pytest.mark.distributed
def test_a_reward_function_failing_on_one_rank_brings_the_job_down_fast(tiny_model_dir, tmp_path):
    started = time.time()
    result = launch("multi_gpu", JOB, tiny_model_dir, str(tmp_path), "fail", check=False, timeout=300)
    elapsed = time.time() - started
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "the judge service is down (simulated on rank 1)" in output
    assert "process 1 failed, so this process stops too" in output  # rank 0 says why it stops
    assert elapsed < 60, f"took {elapsed:.0f} s"


@pytest.mark.distributed
def test_sigterm_to_the_launcher_stops_every_process_with_one_checkpoint(tiny_model_dir, tmp_path):
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               os.path.join(CONFIGS, "multi_gpu.yaml"), "--num_processes", "2", "--main_process_port",
               str(free_port()), JOB, tiny_model_dir, str(tmp_path), "sleep"]
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                           env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 180
    while time.time() < deadline and not (tmp_path / "metrics.jsonl").exists():
        time.sleep(0.2)
    time.sleep(2)
    job.send_signal(signal.SIGTERM)
    out, err = job.communicate(timeout=180)
    assert job.returncode != 0
    assert "resume_from_checkpoint=True" in out + err
    checkpoints = [d for d in os.listdir(tmp_path) if d.startswith("checkpoint-")]
    assert len(checkpoints) == 1
    with open(tmp_path / checkpoints[0] / "trainer_state.json") as f:
        assert json.load(f)["state"]["global_step"] == int(checkpoints[0].split("-")[1])
