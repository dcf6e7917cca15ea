"""The prepared GPU check (benchmarks/gpu_check.py), its CPU-runnable half: a dry run on CPU runs each part in its
own process, skips the GPU-only ones with the reason, and writes the report (JSON, the Markdown table and the parts'
log, nothing else in --out); a part past its limit is killed with everything it started; without --dry-run and
without CUDA it refuses to start, naming why. So the one GPU call is not spent on a typo."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow

SCRIPT = os.path.join(REPO, "benchmarks", "gpu_check.py")


def test_a_dry_run_on_cpu_runs_the_parts_and_writes_the_report(tmp_path):
    result = subprocess.run([sys.executable, SCRIPT, "--dry-run", "--out", str(tmp_path)], capture_output=True,
                            text=True, timeout=600, cwd=REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    with open(tmp_path / "gpu_check.json") as f:
        report = json.load(f)
    assert report["dry_run"] and list(report["parts"]) == ["runs", "head", "rows", "templates", "profile", "sync"]
    # the report alone comes back from the device machine: 8 files at most (the parts' files go to --work)
    assert sorted(os.listdir(tmp_path)) == ["gpu_check.json", "gpu_check.md", "parts.log"]
    runs = report["parts"]["runs"]["details"]
    assert runs["sft_finite"] and runs["resume_exact"] and runs["lean_equals_hf_greedy"]
    assert runs["resume_max_abs_diff"] == 0.0 and runs["lean_hf_equal_prompts"] == "3/3"
    for part in ("rows", "sync"):
        assert report["parts"][part] == {"skipped": "needs CUDA", "seconds": report["parts"][part]["seconds"]}
    assert report["parts"]["templates"]["details"]["single_gpu"] == "ok"
    head = report["parts"]["head"]["details"]  # float32 products on CPU, whatever the model's dtype
    assert report["parts"]["head"]["ok"] and not head["low_precision_chosen"] and head["head_forward_backward_s"] > 0
    profile = report["parts"]["profile"]["details"]
    assert 0 < profile["sampling_s"] < profile["step_s"]
    table = (tmp_path / "gpu_check.md").read_text()
    assert table.startswith("GPU check on CPU (no CUDA) (dry run)") and "| runs | ok |" in table
    assert "| rows | skipped |" in table and "Versions: torch" in table


def test_without_cuda_it_asks_for_the_dry_run(tmp_path):
    result = subprocess.run([sys.executable, SCRIPT, "--out", str(tmp_path)], capture_output=True, text=True,
                            timeout=120, cwd=REPO)
    assert result.returncode == 2 and "no CUDA device here: run on the GPU machine, or pass --dry-run" in result.stderr


def test_a_part_past_its_limit_is_killed_with_everything_it_started(tmp_path):
    """The templates part launches `accelerate launch` (a launcher and its worker). The test stops the worker as
    soon as it appears (SIGSTOP: the part can no longer finish, however fast the host), so the part runs past its
    limit: the report says so and neither the launcher nor the stopped worker is left to share the GPU."""
    os.makedirs(tmp_path / "work")
    process = subprocess.Popen([sys.executable, SCRIPT, "--dry-run", "--out", str(tmp_path), "--work",
                                str(tmp_path / "work"), "--parts", "templates", "--limit", "30"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    stopped = []
    while process.poll() is None and not stopped:
        for pid in os.listdir("/proc"):
            line = cmdline(pid) if pid.isdigit() else ""
            if str(tmp_path) in line and "sft.py" in line and "accelerate" not in line:
                os.kill(int(pid), signal.SIGSTOP)
                stopped.append(pid)
        time.sleep(0.05)
    output, _ = process.communicate(timeout=120)
    with open(tmp_path / "gpu_check.json") as f:
        part = json.load(f)["parts"]["templates"]
    assert stopped, output[-3000:]  # the worker was seen (and held) before the part ended
    assert process.returncode == 1 and part["error"] == "timed out after 30 s" and part["seconds"] < 45, part
    time.sleep(1)
    left = [pid for pid in os.listdir("/proc") if pid.isdigit() and str(tmp_path) in cmdline(pid)]
    assert left == [], [cmdline(pid) for pid in left]


def cmdline(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
