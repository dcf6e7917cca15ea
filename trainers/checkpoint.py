"""Checkpoints: everything a run needs to continue bit-for-bit, written atomically.

A checkpoint is written into ``output_dir/.tmp-checkpoint-N`` and renamed to ``checkpoint-N`` only once every
process has finished writing, so a folder named ``checkpoint-N`` is always whole. ``trainer_state.json`` is
written last and lists every file with its size; loading checks that list first.

Contents: weights, optimizer and scheduler (through ``accelerator.save_state``: plain files, or DeepSpeed's
sharded format), the RNG states of every process, ``trainer_state.json`` (step, data position, metrics
history), and whatever the trainer adds per process (GRPO's buffered generation round).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from dataclasses import asdict, dataclass, field

from trainers.errors import CheckpointError

CHECKPOINT_PREFIX = "checkpoint-"
STATE_FILE = "trainer_state.json"
_TMP_PREFIX = ".tmp-" + CHECKPOINT_PREFIX


@dataclass
class TrainerState:
    """What a run has done so far. ``global_step`` counts optimizer steps; the data position is a function of it."""

    global_step: int = 0
    epoch: float = 0.0
    num_tokens: int = 0  # cumulative non-padding input tokens trained on, over all processes
    consecutive_nonfinite: int = 0
    total_nonfinite: int = 0
    log_history: list[dict] = field(default_factory=list)


def checkpoint_dirs(output_dir: str) -> list[str]:
    """Complete-looking checkpoint folders in ``output_dir``, oldest step first."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        match = re.fullmatch(rf"{CHECKPOINT_PREFIX}(\d+)", name)
        if match and os.path.isdir(os.path.join(output_dir, name)):
            found.append((int(match.group(1)), os.path.join(output_dir, name)))
    return [path for _, path in sorted(found)]


def verify_checkpoint(path: str) -> dict:
    """Return the checkpoint's state dict, or raise ``CheckpointError`` naming what is missing or damaged."""
    if not os.path.isdir(path):
        raise CheckpointError(f"Checkpoint '{path}' does not exist.")
    state_path = os.path.join(path, STATE_FILE)
    if not os.path.isfile(state_path):
        raise CheckpointError(f"Checkpoint '{path}' is incomplete: {STATE_FILE} is missing (it is written last).")
    try:
        with open(state_path) as f:
            saved = json.load(f)
    except (OSError, json.JSONDecodeError) as error:
        raise CheckpointError(f"Checkpoint '{path}': {STATE_FILE} is unreadable ({error}).") from error
    for rel, size in saved.get("files", {}).items():
        full = os.path.join(path, rel)
        if not os.path.exists(full):
            raise CheckpointError(f"Checkpoint '{path}' is incomplete: '{rel}' is missing.")
        if os.path.getsize(full) != size:
            raise CheckpointError(
                f"Checkpoint '{path}' is damaged: '{rel}' has {os.path.getsize(full)} bytes, {size} were written."
            )
    return saved


def resolve_resume_path(resume_from_checkpoint, output_dir: str) -> str | None:
    """``True`` -> the newest complete checkpoint in output_dir (skipping damaged ones with a warning);
    a path -> that checkpoint, verified; ``None``/``False`` -> None."""
    if resume_from_checkpoint in (None, False):
        return None
    if resume_from_checkpoint is True:
        for path in reversed(checkpoint_dirs(output_dir)):
            try:
                verify_checkpoint(path)
                return path
            except CheckpointError as error:
                warnings.warn(f"Skipping a checkpoint that cannot be resumed: {error}", stacklevel=3)
        raise CheckpointError(
            f"resume_from_checkpoint=True but '{output_dir}' holds no complete checkpoint to resume from."
        )
    verify_checkpoint(str(resume_from_checkpoint))
    return str(resume_from_checkpoint)


def _file_sizes(root: str) -> dict[str, int]:
    sizes = {}
    for folder, _, files in os.walk(root):
        for name in files:
            full = os.path.join(folder, name)
            sizes[os.path.relpath(full, root)] = os.path.getsize(full)
    return sizes


def save_checkpoint(accelerator, output_dir: str, step: int, state: TrainerState, config: dict,
                    write_extra=None) -> str:
    """Write ``output_dir/checkpoint-<step>`` atomically. Every process must call this together.

    ``write_extra(folder)`` lets a trainer add its own per-process files (called on every process).
    """
    final = os.path.join(output_dir, f"{CHECKPOINT_PREFIX}{step}")
    tmp = os.path.join(output_dir, f"{_TMP_PREFIX}{step}")
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    accelerator.wait_for_everyone()
    accelerator.save_state(tmp)
    if write_extra is not None:
        write_extra(tmp)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        record = {"state": asdict(state), "config": config, "files": _file_sizes(tmp)}
        with open(os.path.join(tmp, STATE_FILE), "w") as f:
            json.dump(record, f, indent=1, default=str)
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(final):
            shutil.rmtree(final)
        os.rename(tmp, final)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(accelerator, path: str) -> TrainerState:
    """Restore weights, optimizer, scheduler and RNG states from ``path``; return the saved TrainerState."""
    saved = verify_checkpoint(path)
    accelerator.load_state(path)
    return TrainerState(**saved["state"])


def rotate_checkpoints(output_dir: str, keep: int | None) -> None:
    """Delete the oldest checkpoints beyond ``keep``; never the newest complete one."""
    if not keep:
        return
    dirs = checkpoint_dirs(output_dir)
    complete = [d for d in dirs if os.path.isfile(os.path.join(d, STATE_FILE))]
    newest_complete = complete[-1] if complete else None
    for path in dirs[: max(len(dirs) - keep, 0)]:
        if path != newest_complete:
            shutil.rmtree(path, ignore_errors=True)
