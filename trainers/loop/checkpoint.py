"""Checkpoints: everything a run needs to continue bit-for-bit, written atomically.

A checkpoint is written into ``output_dir/.tmp-checkpoint-N`` and renamed to ``checkpoint-N`` only once every
process has finished writing, so a folder named ``checkpoint-N`` is always whole. ``trainer_state.json`` is
written last and lists every file with its size; loading checks that list first.

Contents: weights, optimizer and scheduler (through ``accelerator.save_state``: plain files, or DeepSpeed's
sharded format), the RNG states of every process, ``trainer_state.json`` (step, data position, metrics
history), and whatever the trainer adds per process (GRPO's buffered generation round).

A model-only checkpoint (``save_only_model``) holds the model in Hugging Face format and ``trainer_state.json``
(marked ``"model_only": true``); it can be loaded, not resumed from.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import warnings
from dataclasses import asdict, dataclass, field

from trainers.errors import CheckpointError, ConfigError

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
    num_input_tokens_seen: int = 0  # include_num_input_tokens_seen's count ("all" includes padding)
    total_flos: float = 0.0  # transformers' estimate: 6 x non-embedding parameters x input tokens, all processes
    best_metric: float | None = None  # metric_for_best_model's best evaluation so far
    best_global_step: int | None = None  # the step of that evaluation
    best_model_checkpoint: str | None = None  # the checkpoint written at that step, once there is one
    log_history: list[dict] = field(default_factory=list)
    # What transformers' TrainerState also tells callbacks about the run; set at the start of each train()
    max_steps: int = 0
    num_train_epochs: int = 0
    logging_steps: int = 0
    eval_steps: int = 0
    save_steps: int = 0
    train_batch_size: int = 0  # per process
    is_world_process_zero: bool = True
    is_local_process_zero: bool = True
    stateful_callbacks: dict = field(default_factory=dict)  # callback class name -> its state() (list if several)

    def save_to_json(self, path: str) -> None:
        """transformers' TrainerState.save_to_json (trainer.save_state() writes output_dir/trainer_state.json)."""
        with open(path, "w") as f:
            json.dump(asdict(self), f, indent=2, sort_keys=True)


def update_best(state: TrainerState, metrics: dict, metric: str, greater_is_better: bool, config_name: str) -> bool:
    """Record ``metrics[metric]`` (``eval_`` prefixed when missing) in ``state`` as the best value and its step
    when it is strictly better, as transformers does; a NaN never is. Returns whether it was."""
    name = metric if metric.startswith("eval_") else f"eval_{metric}"
    if name not in metrics:
        raise ConfigError(f"{config_name}: `metric_for_best_model={metric!r}` is not among the evaluation "
                          f"metrics: {sorted(metrics)}.")
    value = metrics[name]
    if not math.isfinite(value):
        return False
    better = state.best_metric is None or (value > state.best_metric if greater_is_better
                                           else value < state.best_metric)
    if better:
        state.best_metric, state.best_global_step = value, state.global_step
    return better


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


def verify_resumable(path: str) -> dict:
    """``verify_checkpoint``, and a ``CheckpointError`` for a model-only checkpoint, which cannot be resumed."""
    saved = verify_checkpoint(path)
    if saved.get("model_only"):
        raise CheckpointError(
            f"Checkpoint '{path}' was written with save_only_model=True: it holds the model but no optimizer, "
            f"schedule or RNG state, so training cannot resume from it. Load it as a model "
            f"(from_pretrained, or as the trainer's model to start a new run), or train with save_only_model=False.")
    return saved


def resolve_resume_path(resume_from_checkpoint, output_dir: str) -> str | None:
    """``True`` -> the newest resumable checkpoint in output_dir (skipping damaged and model-only ones with a
    warning); a path -> that checkpoint, verified; ``None``/``False`` -> None."""
    if resume_from_checkpoint in (None, False):
        return None
    if resume_from_checkpoint is True:
        skipped = []
        for path in reversed(checkpoint_dirs(output_dir)):
            try:
                verify_resumable(path)
                return path
            except CheckpointError as error:
                skipped.append(str(error))
                warnings.warn(f"Skipping a checkpoint that cannot be resumed: {error}", stacklevel=3)
        why = f" The newest one: {skipped[0]}" if skipped else ""
        raise CheckpointError(
            f"resume_from_checkpoint=True but '{output_dir}' holds no complete checkpoint to resume from.{why}"
        )
    verify_resumable(str(resume_from_checkpoint))
    return str(resume_from_checkpoint)


def _file_sizes(root: str) -> dict[str, int]:
    sizes = {}
    for folder, _, files in os.walk(root):
        for name in files:
            full = os.path.join(folder, name)
            sizes[os.path.relpath(full, root)] = os.path.getsize(full)
    return sizes


def save_checkpoint(accelerator, output_dir: str, step: int, state: TrainerState, config: dict,
                    write_extra=None, write_model=None) -> str:
    """Write ``output_dir/checkpoint-<step>`` atomically. Every process must call this together.

    ``write_extra(folder)`` lets a trainer add its own per-process files (called on every process).
    ``write_model(folder)``, when given, makes a model-only checkpoint: it writes the model (called on every
    process) in place of ``accelerator.save_state`` and ``write_extra``.
    """
    final = os.path.join(output_dir, f"{CHECKPOINT_PREFIX}{step}")
    tmp = os.path.join(output_dir, f"{_TMP_PREFIX}{step}")
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    accelerator.wait_for_everyone()
    if write_model is not None:
        write_model(tmp)
    else:
        accelerator.save_state(tmp)
        if write_extra is not None:
            write_extra(tmp)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        record = {"state": asdict(state), "config": config, "files": _file_sizes(tmp)}
        if write_model is not None:
            record["model_only"] = True
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
    saved = verify_resumable(path)
    accelerator.load_state(path)
    return TrainerState(**saved["state"])


def load_model_only_checkpoint(model, path: str) -> None:
    """Load the weights of a model-only checkpoint (Hugging Face format, as ``save_model`` wrote it) into
    ``model``, the unwrapped (not DeepSpeed-sharded) model it was saved from: a PEFT model's adapter, or the
    full state dict, whose tied copies were left out when saving."""
    from safetensors.torch import load_file

    if hasattr(model, "peft_config"):
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, load_file(os.path.join(path, "adapter_model.safetensors")))
        return
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
    else:
        shards = ["model.safetensors"]
    state_dict = {}
    for shard in shards:
        state_dict.update(load_file(os.path.join(path, shard)))
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    if unexpected or set(missing) - tied:
        raise CheckpointError(f"Checkpoint '{path}' does not match the model: missing "
                              f"{sorted(set(missing) - tied)[:5]}, unexpected {sorted(unexpected)[:5]}.")


def rotate_checkpoints(output_dir: str, keep: int | None, best: str | None = None, keep_newest: bool = True) -> None:
    """Delete the oldest checkpoints beyond ``keep``; never ``best``, nor (with ``keep_newest``) the newest
    complete one. As in transformers, the best counts as the second newest, so ``keep=1`` with a best that is
    not the newest leaves two."""
    if not keep:
        return
    dirs = checkpoint_dirs(output_dir)
    complete = [d for d in dirs if os.path.isfile(os.path.join(d, STATE_FILE))]
    protected = {os.path.normpath(complete[-1])} if complete and keep_newest else set()
    order = [d for d in dirs if best is None or os.path.normpath(d) != os.path.normpath(best)]
    if best is not None and len(order) < len(dirs):
        protected.add(os.path.normpath(best))
        order.insert(len(order) - 1 if keep_newest and order else len(order), best)
    for path in order[: max(len(order) - keep, 0)]:
        if os.path.normpath(path) not in protected:
            shutil.rmtree(path, ignore_errors=True)
