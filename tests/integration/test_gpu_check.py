"""The prepared GPU check (benchmarks/gpu_check.py), its CPU-runnable half: a dry run on CPU runs each part in its
own process, skips the GPU-only ones with the reason, and writes the report (JSON and the Markdown table); without
--dry-run and without CUDA it refuses to start, naming why. So the one GPU call is not spent on a typo."""

import json
import os
import subprocess
import sys

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
    runs = report["parts"]["runs"]["details"]
    assert runs["sft_finite"] and runs["resume_exact"] and runs["lean_equals_hf_greedy"]
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
