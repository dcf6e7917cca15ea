"""Checkpoints and the saved model. A mixin of BaseTrainer: it uses the trainer's args, accelerator, state, model
and callbacks, and the subclass's ``save_extra_state`` / ``load_extra_state``.

Resuming from a checkpoint (``_resume``), writing one (``save_checkpoint``, with rotation that keeps the best), the
best model at the end of training (``_settle_best_model``), ``save_model`` in Hugging Face format, and the two ways a
run stops that checkpoint first: a signal (``_stop_on_signal``) and too many non-finite steps in a row
(``_check_nonfinite``). The checkpoint files themselves are trainers.loop.checkpoint's.
"""

from __future__ import annotations

import math
import os

import torch

from trainers.parallel import distributed as dist
from trainers.loop.checkpoint import (
    load_checkpoint,
    load_model_only_checkpoint,
    resolve_resume_path,
    rotate_checkpoints,
    save_checkpoint,
    verify_checkpoint,
)
from trainers.errors import CheckpointError, NonFiniteError
from trainers.loop.interrupts import StopOnSignal
from trainers.logs import logger


class Saving:
    """Resume, checkpoints, the best model, save_model, and the stops that checkpoint (module docstring)."""

    def _resume(self, resume_from_checkpoint: bool | str | None) -> None:
        """Restore the checkpoint ``resume_from_checkpoint`` names (True: the newest in output_dir; None/False:
        none) into the model, optimizer, schedule, ``self.state`` and the subclass's extra state."""
        args, acc = self.args, self.accelerator
        resume_path = resolve_resume_path(resume_from_checkpoint, args.output_dir)
        if resume_path is None:
            return
        self.state = load_checkpoint(acc, resume_path)
        self.load_extra_state(resume_path)
        if args.restore_callback_states_from_checkpoint:
            self.callback_handler.restore(self.state.stateful_callbacks)
        if acc.is_main_process:
            logger.info(f"resumed from {resume_path} at step {self.state.global_step}")
        best = self.state.best_model_checkpoint
        if best is not None and not os.path.isdir(best):
            logger.warning(f"the best checkpoint {best} recorded in the resumed state is gone; the best "
                           f"checkpoint will be chosen among those written from here on.")
            self.state.best_model_checkpoint = None

    def save_checkpoint(self, whole: bool = False) -> str:
        """Write ``output_dir/checkpoint-<step>`` (model-only with save_only_model, unless ``whole``) and
        rotate old ones away, keeping the best."""
        args, state = self.args, self.state
        if state.best_global_step is not None:  # the best evaluation's checkpoint, once it exists
            best = os.path.join(args.output_dir, f"checkpoint-{state.best_global_step}")
            if state.best_global_step == state.global_step or os.path.isdir(best):
                state.best_model_checkpoint = best
        state.stateful_callbacks = self.callback_handler.states()
        model_only = args.save_only_model and not whole
        path = save_checkpoint(self.accelerator, args.output_dir, state.global_step, state, args.to_dict(),
                               write_extra=self.save_extra_state, write_model=self.save_model if model_only else None)
        if self.accelerator.is_main_process:
            rotate_checkpoints(args.output_dir, args.save_total_limit, best=state.best_model_checkpoint)
        self.accelerator.wait_for_everyone()
        self.callback_handler.fire("save")
        return path

    def _checkpoint_now(self) -> str:
        """A whole (resumable) checkpoint of the current step: the one just written, or a new one (also when
        save_only_model wrote a model-only one at this step)."""
        path = os.path.join(self.args.output_dir, f"checkpoint-{self.state.global_step}")
        try:
            if not verify_checkpoint(path).get("model_only"):
                return path
        except CheckpointError:
            pass
        return self.save_checkpoint(whole=True)

    def _stop_on_signal(self, signum: int) -> None:
        """A process received SIGTERM/SIGINT: every process checkpoints this step and exits non-zero."""
        path = self._checkpoint_now()
        if self.accelerator.is_main_process:
            logger.error(f"stopped by a signal after step {self.state.global_step}; checkpoint written to {path}. "
                         f"Resume with trainer.train(resume_from_checkpoint=True), or run the same command with "
                         f"--resume_from_checkpoint true.")
        raise SystemExit(StopOnSignal.exit_code(signum))

    def _check_nonfinite(self, grad_norm: float | None) -> None:
        """Count optimizer steps skipped for a non-finite loss or gradient norm; stop after too many in a row."""
        state = self.state
        if grad_norm is None or math.isfinite(grad_norm):
            state.consecutive_nonfinite = 0
            return
        state.consecutive_nonfinite += 1
        state.total_nonfinite += 1
        if state.consecutive_nonfinite < self.args.max_consecutive_nonfinite_steps:
            if self.accelerator.is_main_process:
                logger.warning(f"step {state.global_step}: non-finite loss or gradient norm; the update was skipped "
                               f"({state.consecutive_nonfinite} in a row, {state.total_nonfinite} in total).")
            return
        path = self._checkpoint_now()
        raise NonFiniteError(
            f"{state.consecutive_nonfinite} consecutive optimizer steps (up to step {state.global_step}) had a "
            f"non-finite loss or gradient norm, so their updates were skipped and training stopped "
            f"(max_consecutive_nonfinite_steps={self.args.max_consecutive_nonfinite_steps}). The checkpoint {path} "
            f"holds the weights from before them. Usual causes: a learning rate too high "
            f"(learning_rate={self.args.learning_rate}), fp16 overflow (try bf16), or rows that produce inf/NaN "
            f"(check the data and the reward functions).")

    def _settle_best_model(self) -> None:
        """At the end of training: load_best_model_at_end's best checkpoint back, and with save_total_limit=1 the
        newest checkpoint rotated away beside the best (it was kept for resuming), as transformers does."""
        args, acc, state = self.args, self.accelerator, self.state
        if args.load_best_model_at_end and state.best_model_checkpoint is not None:
            self._load_best_model()
        elif args.load_best_model_at_end and acc.is_main_process:
            # e.g. the evaluation before training (eval_on_start) stayed the best: there is no checkpoint of it
            logger.warning(f"load_best_model_at_end: no checkpoint holds the best evaluation "
                           f"({args.metric_for_best_model} {state.best_metric} at step "
                           f"{state.best_global_step}); the final weights stay.")
        if args.save_total_limit == 1 and state.best_model_checkpoint is not None and acc.is_main_process:
            rotate_checkpoints(args.output_dir, 1, best=state.best_model_checkpoint, keep_newest=False)

    def _load_best_model(self) -> None:
        """load_best_model_at_end: a whole checkpoint is restored as on resume (weights, optimizer, schedule; as
        transformers does under DeepSpeed), a model-only one into the model's weights. ``self.state`` stays."""
        path, acc = self.state.best_model_checkpoint, self.accelerator
        if acc.is_main_process:
            logger.info(f"loading the best model from {path} ({self.args.metric_for_best_model} "
                        f"{self.state.best_metric:.6g} at step {self.state.best_global_step})")
        if verify_checkpoint(path).get("model_only"):
            load_model_only_checkpoint(self.unwrapped_model, path)
        else:
            acc.load_state(path)
        acc.wait_for_everyone()

    def save_model(self, output_dir: str | None = None) -> None:
        """Save the model in Hugging Face format (safetensors) with its tokenizer; under ZeRO-3 the full weights
        are gathered first; with PEFT only the adapter is saved. Every process must call this."""
        output_dir = output_dir or self.args.output_dir
        state_dict = dist.full_state_dict(self.accelerator, self.model_wrapped)
        if self.accelerator.is_main_process:
            _drop_tied_copies(self.unwrapped_model, state_dict)
            os.makedirs(output_dir, exist_ok=True)
            self.unwrapped_model.save_pretrained(output_dir, state_dict=state_dict, safe_serialization=True)
            self.processing_class.save_pretrained(output_dir)
        self.accelerator.wait_for_everyone()


def _drop_tied_copies(model, state_dict: dict) -> None:
    """DeepSpeed returns tied weights (e.g. lm_head = embed_tokens) as separate copies, which transformers cannot
    recognise as tied when saving; keep only the weight the model loads, as a plain save would."""
    for tied, source in (getattr(model, "all_tied_weights_keys", None) or {}).items():
        if tied in state_dict and source in state_dict and torch.equal(state_dict[tied], state_dict[source]):
            del state_dict[tied]
