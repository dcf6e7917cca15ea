"""Exact resume with 2 processes under ZeRO-2, for SFT and for GRPO (a checkpoint in the middle of a round)."""

import json
import os

import pytest
import torch

from tests.conftest import REPO, launch
from tests.integration.test_resume import assert_identical, final_weights, metrics_without_time

JOB = os.path.join(REPO, "tests", "resume_job.py")


@pytest.mark.distributed
@pytest.mark.parametrize("method", ["sft", "grpo"])
def test_zero2_resume_in_new_processes_continues_exactly(method, tiny_model_dir, tmp_path):
    straight, split = tmp_path / "straight", tmp_path / "split"
    launch("zero2", JOB, method, tiny_model_dir, str(straight), "6")
    launch("zero2", JOB, method, tiny_model_dir, str(split), "6", "3")
    if method == "grpo":
        assert {"rollout-0.pt", "rollout-1.pt"} <= set(os.listdir(split / "checkpoint-3"))
    launch("zero2", JOB, method, tiny_model_dir, str(split), "6", "--resume")
    assert_identical(final_weights(straight), final_weights(split))
    assert metrics_without_time(straight) == metrics_without_time(split)


@pytest.mark.distributed
def test_zero3_resume_keeps_the_moved_reference_and_the_adaptive_entropy_coefficient(tiny_model_dir, tmp_path):
    """GRPO state beyond the policy under ZeRO-3: the reference that sync_ref_model moved (partitioned, saved
    gathered) and the adaptive entropy coefficient (one file per rank) come back on resume."""
    extra = ["--extra", json.dumps({"beta": 0.05, "sync_ref_model": True, "ref_model_sync_steps": 1,
                                    "ref_model_mixup_alpha": 0.5, "use_adaptive_entropy": True,
                                    "entropy_coef": 0.1, "entropy_target": 100.0, "entropy_coef_delta": 0.05})]
    straight, split = tmp_path / "straight", tmp_path / "split"
    launch("zero3", JOB, "grpo", tiny_model_dir, str(straight), "4", *extra)
    launch("zero3", JOB, "grpo", tiny_model_dir, str(split), "4", "2", *extra)
    assert "reference.pt" in os.listdir(split / "checkpoint-2")
    launch("zero3", JOB, "grpo", tiny_model_dir, str(split), "4", "--resume", *extra)
    a, b = metrics_without_time(straight), metrics_without_time(split)
    assert [r["entropy_coef"] for r in a] == [r["entropy_coef"] for r in b] == pytest.approx([0.15, 0.2, 0.25, 0.3])
    for x, y in zip(a, b):
        assert y["kl"] == pytest.approx(x["kl"], rel=1e-4, abs=1e-8)  # KL to the same (moved) reference
    for key, value in final_weights(straight).items():
        torch.testing.assert_close(final_weights(split)[key], value, rtol=1e-5, atol=1e-6)
