"""Exact resume in a new process: N steps straight equal N/2 steps, then a new process resuming from the checkpoint
the first one wrote, and N/2 more.

Two processes serve every method (tests/resume_job.py runs one run after the other, `--then`): the first makes
each method's straight run and its stopped run, the second each method's resumed run. A run builds its own trainer,
which reseeds, so it trains as in a process of its own (its weights and metrics are bit-identical to one)."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import REPO, run_script

# the slow tier: its two processes train 21 runs (~45 s); the fast tier resumes in-process (test_sft.py,
# test_tool_loop.py, test_async_grpo.py)
pytestmark = pytest.mark.slow
JOB = os.path.join(REPO, "tests", "resume_job.py")
METHODS = ["sft", "grpo", "rloo", "distill", "dpo", "reward", "kto"]


def run(*args, check=True, timeout=300):
    return run_script(JOB, *args, check=check, timeout=timeout)


def then(*runs: list) -> list[str]:
    """resume_job.py's argv for several runs, one after the other in the same process(es)."""
    argv = []
    for args in runs:
        argv += [*(["--then"] if argv else []), *map(str, args)]
    return argv


def selected(request, param: str) -> list:
    """The values of ``param`` among the tests of the requesting module that this session runs (all of them, or
    those ``-k`` or node ids picked), in order: what a module-scoped fixture has to make for them."""
    values = []
    for item in request.session.items:
        callspec = getattr(item, "callspec", None)  # parametrized tests only
        if getattr(item, "module", None) is request.module and callspec is not None and param in callspec.params:
            values.append(callspec.params[param])
    return list(dict.fromkeys(values))


def checkpoint_files(folder) -> list[str] | None:
    """The files of a checkpoint folder, or None when there is none."""
    return sorted(os.listdir(folder)) if os.path.isdir(folder) else None


@pytest.fixture(scope="module")
def resumed(request, tiny_model_dir, tmp_path_factory) -> dict:
    """method -> (the straight run's folder, the split run's folder, the files of checkpoint-3 that the stopped run
    wrote, listed before the resume), for the methods this session tests: one process runs each method straight
    (6 steps) and stopped after 3 (mid-round for GRPO), a second one resumes each from its checkpoint."""
    root = tmp_path_factory.mktemp("resume")
    methods = selected(request, "method")
    folders = {method: (root / method / "straight", root / method / "split") for method in methods}
    straight_and_stopped = []
    for method, (straight, split) in folders.items():
        straight_and_stopped += [[method, tiny_model_dir, straight, 6], [method, tiny_model_dir, split, 6, 3]]
    run(*then(*straight_and_stopped), timeout=600)
    checkpoints = {method: checkpoint_files(split / "checkpoint-3") for method, (_, split) in folders.items()}
    run(*then(*([method, tiny_model_dir, split, 6, "--resume"] for method, (_, split) in folders.items())),
        timeout=600)
    return {method: (*folders[method], checkpoints[method]) for method in methods}


def final_weights(out):
    return load_file(os.path.join(out, "final", "model.safetensors"))


def assert_identical(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs by {(a[key] - b[key]).abs().max().item()}"


@pytest.mark.parametrize("method", METHODS)
def test_resume_in_a_new_process_continues_exactly(method, resumed):
    straight, split, checkpoint = resumed[method]
    assert checkpoint is not None, "the stopped run left checkpoint-3"
    if method == "grpo":
        assert "rollout-0.pt" in checkpoint, "the buffered round is saved"
    assert_identical(final_weights(straight), final_weights(split))
    assert metrics_without_time(straight) == metrics_without_time(split)


def metrics_without_time(out):
    with open(out / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    # without timings, and without train()'s closing summary (its runtime and loss are per call of train())
    return [{k: v for k, v in r.items() if k not in ("step_time", "tokens_per_second")} for r in records
            if "train_runtime" not in r]
