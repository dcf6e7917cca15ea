"""Exact resume with 2 processes under ZeRO-2, for SFT and for GRPO (a checkpoint in the middle of a round)."""

import os

import pytest

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
