"""Exact resume in one process: N steps straight equal N/2 steps, a new process resuming, and N/2 more."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import REPO, run_script

JOB = os.path.join(REPO, "tests", "resume_job.py")


def run(*args, check=True, timeout=300):
    return run_script(JOB, *args, check=check, timeout=timeout)


def final_weights(out):
    return load_file(os.path.join(out, "final", "model.safetensors"))


def assert_identical(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs by {(a[key] - b[key]).abs().max().item()}"


@pytest.mark.parametrize("method", ["sft", "grpo", "rloo", "distill", "dpo", "reward", "kto"])
def test_resume_in_a_new_process_continues_exactly(method, tiny_model_dir, tmp_path):
    straight, split = tmp_path / "straight", tmp_path / "split"
    run(method, tiny_model_dir, straight, 6)
    run(method, tiny_model_dir, split, 6, 3)  # preempted after 3 steps (mid-round for GRPO)
    assert os.path.isdir(split / "checkpoint-3")
    if method == "grpo":
        assert os.path.isfile(split / "checkpoint-3" / "rollout-0.pt"), "the buffered round is saved"
    run(method, tiny_model_dir, split, 6, "--resume")
    assert_identical(final_weights(straight), final_weights(split))
    assert metrics_without_time(straight) == metrics_without_time(split)


def metrics_without_time(out):
    with open(out / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    # without timings, and without train()'s closing summary (its runtime and loss are per call of train())
    return [{k: v for k, v in r.items() if k not in ("step_time", "tokens_per_second")} for r in records
            if "train_runtime" not in r]
