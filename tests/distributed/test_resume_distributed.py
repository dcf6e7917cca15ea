"""Exact resume with 2 processes under ZeRO-2, for SFT and for GRPO (a checkpoint in the middle of a round), and of
GRPO's state beyond the policy under ZeRO-3.

Two launches per template (tests/resume_job.py runs one run after the other, `--then`): the first makes the
straight and the stopped runs of every variant the tests compare, the second resumes each of them in new
processes."""

import json
import os

import pytest
import torch

from tests.conftest import REPO, launch
from tests.integration.test_resume import (assert_identical, checkpoint_files, final_weights, metrics_without_time,
                                           selected, then)

JOB = os.path.join(REPO, "tests", "resume_job.py")
ZERO3_EXTRA = ["--extra", json.dumps({"beta": 0.05, "sync_ref_model": True, "ref_model_sync_steps": 1,
                                      "ref_model_mixup_alpha": 0.5, "use_adaptive_entropy": True,
                                      "entropy_coef": 0.1, "entropy_target": 100.0, "entropy_coef_delta": 0.05})]


@pytest.fixture(scope="module")
def resumed(tiny_model_dir, tmp_path_factory):
    """``resumed(template, methods, total, stop_after, extra)`` -> method -> (the straight run's folder, the split
    run's folder, the files of the checkpoint the stopped run wrote, listed before the resume): one launch makes
    every method's straight run and its run stopped after ``stop_after`` of ``total`` steps, a second one resumes
    each of them."""

    def make(template: str, methods: list[str], total: int, stop_after: int, extra: list[str]) -> dict:
        root = tmp_path_factory.mktemp(template)
        folders = {method: (root / method / "straight", root / method / "split") for method in methods}
        straight_and_stopped = []
        for method, (straight, split) in folders.items():
            straight_and_stopped += [[method, tiny_model_dir, straight, total, *extra],
                                     [method, tiny_model_dir, split, total, stop_after, *extra]]
        launch(template, JOB, *then(*straight_and_stopped))
        checkpoints = {method: checkpoint_files(split / f"checkpoint-{stop_after}")
                       for method, (_, split) in folders.items()}
        launch(template, JOB, *then(*([method, tiny_model_dir, split, total, "--resume", *extra]
                                      for method, (_, split) in folders.items())))
        return {method: (*folders[method], checkpoints[method]) for method in methods}

    return make


@pytest.fixture(scope="module")
def zero2(request, resumed):
    """The ZeRO-2 runs (6 steps, stopped after 3) of the methods this session tests."""
    return resumed("zero2", selected(request, "method"), 6, 3, [])


@pytest.mark.distributed
@pytest.mark.parametrize("method", ["sft", "grpo"])
def test_zero2_resume_in_new_processes_continues_exactly(method, zero2):
    straight, split, checkpoint = zero2[method]
    assert checkpoint is not None, "the stopped run left checkpoint-3"
    if method == "grpo":
        assert {"rollout-0.pt", "rollout-1.pt"} <= set(checkpoint)
    assert_identical(final_weights(straight), final_weights(split))
    assert metrics_without_time(straight) == metrics_without_time(split)


@pytest.mark.distributed
def test_zero3_resume_keeps_the_moved_reference_and_the_adaptive_entropy_coefficient(resumed):
    """GRPO state beyond the policy under ZeRO-3: the reference that sync_ref_model moved (partitioned, saved
    gathered) and the adaptive entropy coefficient (one file per rank) come back on resume."""
    straight, split, checkpoint = resumed("zero3", ["grpo"], 4, 2, ZERO3_EXTRA)["grpo"]
    assert checkpoint is not None and "reference.pt" in checkpoint
    a, b = metrics_without_time(straight), metrics_without_time(split)
    assert [r["entropy_coef"] for r in a] == [r["entropy_coef"] for r in b] == pytest.approx([0.15, 0.2, 0.25, 0.3])
    for x, y in zip(a, b):
        assert y["kl"] == pytest.approx(x["kl"], rel=1e-4, abs=1e-8)  # KL to the same (moved) reference
    for key, value in final_weights(straight).items():
        torch.testing.assert_close(final_weights(split)[key], value, rtol=1e-5, atol=1e-6)
