"""Crash-safe checkpoints, graceful stops, and skipped non-finite steps."""

import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from transformers import TrainerCallback

from tests.conftest import REPO, step_records
from tests.integration.test_resume import assert_identical, final_weights, run
from trainers import SFTConfig, SFTTrainer
from trainers.loop.checkpoint import resolve_resume_path, rotate_checkpoints
from trainers.errors import CheckpointError, NonFiniteError
from trainers.cli.tiny import as_sft_rows, reverse_digits_rows

JOB = os.path.join(REPO, "tests", "resume_job.py")


def start(*args):
    return subprocess.Popen([sys.executable, JOB, *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def complete_checkpoints(out):
    return sorted(d for d in os.listdir(out) if d.startswith("checkpoint-")
                  and os.path.isfile(os.path.join(out, d, "trainer_state.json"))) if os.path.isdir(out) else []


# The SIGTERM handler is the base trainer's, shared by every trainer: the fast tier signals two of them (~10 s each, a
# process that starts and waits to be a few steps in), the whole suite all six.
@pytest.mark.parametrize("method", ["sft", "dpo", *(pytest.param(m, marks=pytest.mark.slow)
                                                    for m in ("rloo", "distill", "reward", "kto"))])
def test_sigterm_finishes_the_step_checkpoints_and_says_how_to_resume(method, tiny_model_dir, tmp_path):
    job = start(method, tiny_model_dir, tmp_path, 40, "--step_sleep", "0.2")
    deadline = time.time() + 120
    while not os.path.exists(tmp_path / "metrics.jsonl") and time.time() < deadline:
        time.sleep(0.2)
    time.sleep(1.5)  # a few steps in
    job.send_signal(signal.SIGTERM)
    out, err = job.communicate(timeout=120)
    assert job.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "resume_from_checkpoint=True" in err
    saved = complete_checkpoints(tmp_path)
    assert len(saved) == 1
    step = int(saved[0].split("-")[1])
    assert 0 < step < 40
    with open(tmp_path / "metrics.jsonl") as f:
        assert json.loads(f.readlines()[-1])["step"] == step  # the last step's metrics were logged, not lost


@pytest.mark.slow  # ~60 s: a dozen processes killed at random
def test_random_kills_then_resume_reach_the_straight_run_weights(tiny_model_dir, tmp_path):
    """SIGTERM (graceful) and SIGKILL (abrupt, possibly mid-checkpoint) at random moments, several times."""
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    run("sft", tiny_model_dir, straight, 16, "--save_steps", "2")
    rng = random.Random(0)
    outcomes = []
    for attempt in range(6):
        args = ["sft", tiny_model_dir, killed, 16, "--save_steps", "2", "--step_sleep", "0.1"]
        lines_before = count_lines(killed / "metrics.jsonl")
        job = start(*args, *(["--resume"] if complete_checkpoints(killed) else []))
        deadline = time.time() + 120
        while count_lines(killed / "metrics.jsonl") <= lines_before and job.poll() is None and time.time() < deadline:
            time.sleep(0.05)  # wait for this attempt's first step, then kill at a random moment of training
        time.sleep(rng.uniform(0.0, 1.5))
        sig = signal.SIGTERM if attempt % 2 == 0 else signal.SIGKILL
        job.send_signal(sig)
        job.communicate(timeout=120)
        outcomes.append((sig.name, job.returncode, complete_checkpoints(killed)[-1:]))
        if job.returncode == 0:
            break
    assert any(code == 128 + signal.SIGTERM for _, code, _ in outcomes), outcomes  # a graceful stop happened
    run("sft", tiny_model_dir, killed, 16, "--save_steps", "2", *(["--resume"] if complete_checkpoints(killed) else []))
    assert_identical(final_weights(straight), final_weights(killed))


def count_lines(path) -> int:
    try:
        with open(path) as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0


def small_trainer(model, out, trainer_class=SFTTrainer, **overrides):
    args = dict(output_dir=str(out), per_device_train_batch_size=4, max_steps=4, logging_steps=1, save_steps=2,
                disable_tqdm=True, seed=0, bf16=False)
    return trainer_class(model=model, args=SFTConfig(**{**args, **overrides}),
                         train_dataset=as_sft_rows(reverse_digits_rows(16)))


def poisoning(value: float):
    """An SFTTrainer subclass (compute_loss overridden, as TRL's users do) whose third step's loss is multiplied
    by ``value``; it keeps every loss it computed (before the poison) in ``losses``."""
    class Poisoned(SFTTrainer):
        losses: list[float] = []  # a new list with each class

        def compute_loss(self, model, batch, counts):
            loss, stats = super().compute_loss(model, batch, counts)
            self.losses.append(float(loss.detach()))
            return (loss * value if self.state.global_step == 2 else loss), stats

    return Poisoned


def test_damaged_or_incomplete_checkpoints(tiny_model_dir, tmp_path):
    small_trainer(tiny_model_dir, tmp_path).train()
    assert complete_checkpoints(tmp_path) == ["checkpoint-2", "checkpoint-4"]
    newest = tmp_path / "checkpoint-4"
    # a file listed in trainer_state.json is gone: named in the error
    os.remove(newest / "optimizer.bin")
    with pytest.raises(CheckpointError, match=r"checkpoint-4' is incomplete: 'optimizer.bin' is missing"):
        resolve_resume_path(str(newest), str(tmp_path))
    # True skips it with a warning and takes the newest complete one
    with pytest.warns(UserWarning, match="optimizer.bin"):
        assert resolve_resume_path(True, str(tmp_path)) == str(tmp_path / "checkpoint-2")
    # a truncated file is damaged, not silently loaded
    weights = tmp_path / "checkpoint-2" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"'model.safetensors' has 100 bytes"):
        resolve_resume_path(str(tmp_path / "checkpoint-2"), str(tmp_path))
    # a folder that never finished (no trainer_state.json, as a kill mid-write would leave it) is named so
    shutil.copytree(tmp_path / "checkpoint-4", tmp_path / "checkpoint-6")
    os.remove(tmp_path / "checkpoint-6" / "trainer_state.json")
    with pytest.raises(CheckpointError, match="trainer_state.json is missing"):
        resolve_resume_path(str(tmp_path / "checkpoint-6"), str(tmp_path))
    with pytest.raises(CheckpointError, match="no complete checkpoint"), pytest.warns(UserWarning, match="Skipping"):
        resolve_resume_path(True, str(tmp_path))
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_resume_path(str(tmp_path / "checkpoint-99"), str(tmp_path))


def test_rotation_never_removes_the_newest_complete_checkpoint(tmp_path):
    for step, complete in ((2, True), (4, True), (6, False)):
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        if complete:
            (folder / "trainer_state.json").write_text("{}")
    rotate_checkpoints(str(tmp_path), keep=1)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-4", "checkpoint-6"]


@pytest.mark.parametrize("keep,best,keep_newest,left", [
    (1, 2, True, [2, 8]),  # the best counts as second newest: keep=1 leaves it and the newest
    (2, 2, True, [2, 8]),
    (3, 4, True, [4, 6, 8]),
    (2, 8, True, [6, 8]),  # the newest is the best
    (1, 2, False, [2]),  # the end of training, as transformers: only the best
    (1, None, True, [8]),
])
def test_rotation_keeps_the_best_checkpoint(tmp_path, keep, best, keep_newest, left):
    for step in (2, 4, 6, 8):
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
    best = None if best is None else str(tmp_path / f"checkpoint-{best}")
    rotate_checkpoints(str(tmp_path), keep=keep, best=best, keep_newest=keep_newest)
    assert sorted(os.listdir(tmp_path), key=lambda n: int(n.split("-")[1])) == [f"checkpoint-{s}" for s in left]


def test_a_non_finite_step_is_skipped_counted_and_training_goes_on(tiny_model_dir, tmp_path):
    trainer = small_trainer(tiny_model_dir, tmp_path, poisoning(float("nan")), save_strategy="no")
    snapshots = []

    class Snapshots(TrainerCallback):  # the weights after each step
        def on_step_end(self, args, state, control, model=None, **kwargs):
            snapshots.append({n: v.clone() for n, v in model.state_dict().items()})

    trainer.add_callback(Snapshots())
    trainer.train()
    assert_identical(snapshots[1], snapshots[2])  # step 3 changed nothing
    assert not torch.equal(snapshots[2]["model.norm.weight"], snapshots[3]["model.norm.weight"])  # step 4 trained
    history = step_records(trainer)
    assert [r["nonfinite_steps"] for r in history] == [0, 0, 1, 1]
    assert trainer.state.total_nonfinite == 1 and trainer.state.consecutive_nonfinite == 0
    assert math.isnan(history[2]["loss"])  # a record of that step alone has nothing finite to show


@pytest.mark.parametrize("nan_filter", [True, False])
def test_logging_nan_inf_filter_keeps_a_non_finite_loss_out_of_the_logged_loss(tiny_model_dir, tmp_path, nan_filter):
    trainer = small_trainer(tiny_model_dir, tmp_path, poisoning(float("inf")), save_strategy="no", logging_steps=2,
                            logging_first_step=False, logging_nan_inf_filter=nan_filter)
    output = trainer.train()
    losses = trainer.losses
    last = step_records(trainer)[-1]  # steps 3 and 4
    assert last["nonfinite_steps"] == 1
    if nan_filter:  # transformers' default: the finite steps' mean
        assert last["loss"] == pytest.approx(losses[3])
        assert output.training_loss == pytest.approx((losses[0] + losses[1] + losses[3]) / 3)
    else:
        assert not math.isfinite(last["loss"]) and not math.isfinite(output.training_loss)


def test_too_many_non_finite_steps_stop_with_a_checkpoint_and_an_explanation(tiny_model_dir, tmp_path):
    result = run("sft", tiny_model_dir, tmp_path, 10, "--nan_at", 3, 4, 5, "--max_nonfinite", 3, check=False)
    assert result.returncode != 0
    assert "NonFiniteError" in result.stderr and "3 consecutive optimizer steps (up to step 5)" in result.stderr
    assert "learning_rate=" in result.stderr
    assert complete_checkpoints(tmp_path) == ["checkpoint-5"]


def test_non_finite_error_is_one_of_ours():
    assert issubclass(NonFiniteError, ValueError)
