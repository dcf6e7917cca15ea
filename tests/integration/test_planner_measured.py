"""The planner's ``--device cpu`` estimate against the measured peak RSS of real training runs, within 25%.

The model is a Qwen2 of width 768 and 8 layers (68M parameters, byte vocabulary): its model states (1 GB in
fp32 with AdamW) outweigh the process baseline (~0.5 GB), so the check is about the planner's formulas and not
about a constant. Each run happens in its own process (tests/integration/planner_job.py), so its peak RSS
(VmHWM) is the training run's alone.
"""

import glob
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO, launch
from trainers.cli.planner import GB, PlanInputs, make_plan

JOB = os.path.join(REPO, "tests", "integration", "planner_job.py")
WIDTH, LAYERS, BATCH, SEQ_LEN = 768, 8, 4, 128
TOLERANCE = 0.25


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from trainers.cli.tiny import save_tiny_model

    return save_tiny_model(str(tmp_path_factory.mktemp("planner") / "model"), hidden_size=WIDTH, num_layers=LAYERS,
                           num_heads=WIDTH // 64, num_kv_heads=WIDTH // 256)


def job_args(model: str, out) -> list[str]:
    return [JOB, "--model", model, "--out", str(out), "--batch", str(BATCH), "--seq_len", str(SEQ_LEN), "--steps", "2"]


def measured_peaks_gb(out) -> list[float]:
    peaks = []
    for path in sorted(glob.glob(os.path.join(str(out), "peak-*.json"))):
        with open(path) as f:
            peaks.append(json.load(f)["peak_rss_bytes"] / GB)
    return peaks


def planned_gb(model: str, template: str, num_processes: int) -> float:
    inputs = PlanInputs(model=model, method="sft", num_gpus=num_processes, per_device_batch=BATCH, max_length=SEQ_LEN,
                        device="cpu")
    return make_plan(inputs).estimate_for(template).total_gb


@pytest.mark.slow  # ~17 s: a 68M-parameter model's run, measured
def test_single_process_sft_peak_is_within_25_percent_of_the_plan(model_dir, tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, *job_args(model_dir, tmp_path)], capture_output=True, text=True,
                            timeout=600, env=env, cwd=REPO, check=False)
    assert result.returncode == 0, result.stderr[-4000:]
    (measured,) = measured_peaks_gb(tmp_path)
    planned = planned_gb(model_dir, "single_gpu", 1)
    assert abs(planned / measured - 1) <= TOLERANCE, f"planned {planned:.2f} GB, measured {measured:.2f} GB"


@pytest.mark.distributed
def test_zero3_two_process_peak_is_within_25_percent_of_the_plan(model_dir, tmp_path):
    launch("zero3", *job_args(model_dir, tmp_path), num_processes=2)
    peaks = measured_peaks_gb(tmp_path)
    assert len(peaks) == 2
    planned = planned_gb(model_dir, "zero3", 2)
    for measured in peaks:
        assert abs(planned / measured - 1) <= TOLERANCE, f"planned {planned:.2f} GB, measured {measured:.2f} GB"
