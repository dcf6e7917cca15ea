"""What a training run records, and when. A mixin of BaseTrainer: it uses the trainer's args, accelerator, state,
callbacks, trackers and ``evaluate()``.

``_start_run`` opens a run (progress bar, run info, trackers, ``on_train_begin``); after each optimizer step
``_log_eval_save`` logs the steps since the last record, evaluates and saves when due (by the config's strategies or
a callback's request); ``log()`` is transformers' Trainer.log, which evaluation uses too; ``_close_trackers`` and
``_train_summary`` end a run.
"""

from __future__ import annotations

import math
import os
import time

from transformers import trainer_pt_utils

from trainers.loop.checkpoint import update_best
from trainers.logs import RunLog, logger
from trainers.loop.trackers import flat_config, numeric_metrics


# The base loop's own metrics of a step record; the others are the trainer's (TRL's ``_metrics``: rewards,
# mean_token_accuracy, entropy, ...), which TRL's log() merges into whatever is logged next, train()'s summary included
LOOP_METRICS = frozenset({"loss", "learning_rate", "grad_norm", "nonfinite_steps", "step_time", "tokens_per_second",
                          "memory/peak_allocated_gb"})


class RunLogging:
    """Starting and ending a run's records, the log / evaluate / save schedule, and ``log()`` (module docstring)."""

    def _start_run(self) -> tuple[float, int]:
        """Open this train() call's records and fire on_train_begin (then the evaluation of eval_on_start).
        Returns the wall time it started at (train_runtime includes eval_on_start's evaluation) and the step it
        starts from."""
        args, acc = self.args, self.accelerator
        if acc.is_main_process:
            logger.info(
                f"effective batch size {self.effective_batch_size} = {self.per_process_train_batch_size} per device "
                f"x {acc.num_processes} processes x {args.gradient_accumulation_steps} accumulation steps; "
                f"{self.max_steps} optimizer steps ({self.steps_per_epoch} per epoch)")
        run_log = self.run_log = RunLog(acc, args.output_dir, self.max_steps, args.disable_tqdm)
        run_log.start(self.state.log_history, self.state.global_step)
        info = self.run_info()
        run_log.write_run_info(info)
        if self.trackers:
            project = args.run_name or os.path.basename(os.path.normpath(args.output_dir))
            acc.init_trackers(project, config=flat_config({**info.pop("config"), **info}))
            self._trackers_open = True
        started_at, first_step = time.time(), self.state.global_step
        self._unlogged: dict = {}  # logging_strategy='no': name -> (sum, steps) of every step's
        self.model.train()
        self._describe_run()
        self.callback_handler.new_training()
        self.callback_handler.fire("train_begin")
        if args.eval_on_start:  # as transformers: also when resuming, logged at the step it starts from
            self._record_evaluation()
        return started_at, first_step

    def _describe_run(self) -> None:
        """The TrainerState fields transformers' callbacks read, set at the start of each train()."""
        args, acc, state = self.args, self.accelerator, self.state
        state.max_steps, state.num_train_epochs = self.max_steps, math.ceil(self.max_steps / self.steps_per_epoch)
        state.logging_steps, state.save_steps = args.logging_steps, args.save_steps
        state.eval_steps = args.eval_steps or args.logging_steps
        state.train_batch_size = args.per_device_train_batch_size
        state.is_world_process_zero, state.is_local_process_zero = acc.is_main_process, acc.is_local_main_process

    def _progress(self, metrics: dict) -> dict:
        """What the progress bar shows beside step and time left: loss, reward (GRPO), tokens/s."""
        shown = {k: metrics[k] for k in ("loss", "reward") if k in metrics}
        shown["tok/s"] = round(metrics["tokens_per_second"])
        return shown

    def _window_means(self, window: list[dict]) -> dict:
        """The mean of each metric over the steps in ``window`` (every name, first-seen order)."""
        means = {}
        for name in dict.fromkeys(name for w in window for name in w):
            values = [w[name] for w in window if name in w]
            if name == "loss" and self.args.logging_nan_inf_filter:  # as transformers: the finite steps' mean
                values = [v for v in values if math.isfinite(v)] or values
            means[name] = sum(values) / len(values)
        return means

    def _summary_extras(self, window: list[dict]) -> dict:
        """The trainer's own metrics (not LOOP_METRICS) that train()'s closing summary carries, as TRL's trainers
        merge the metrics pending since their last record into it: the means of the steps not logged yet
        (``window``: the steps after the last multiple of logging_steps), with logging_strategy='no' the means over
        every step, and nothing when the last step was logged (TRL's log() clears what it merged)."""
        if window:
            pending = self._window_means(window)
        elif self._unlogged:
            pending = {name: total / count for name, (total, count) in self._unlogged.items()}
        else:
            pending = {}
        return {name: value for name, value in pending.items()
                if name not in LOOP_METRICS and name not in ("step", "epoch", "num_input_tokens_seen")}

    def _log_eval_save(self, window: list[dict], force_log: bool = False) -> None:
        """After an optimizer step: log the mean of the steps' metrics in ``window`` (emptied when logged), then
        evaluate and save the checkpoint when due. ``force_log``: log now (the run stops on a signal)."""
        args, state = self.args, self.state
        step, last = state.global_step, state.global_step == self.max_steps
        epoch_end = step % self.steps_per_epoch == 0
        # as transformers: 'steps' logs at multiples of logging_steps only (the steps after the last one go into
        # train()'s closing record); 'epoch' at each epoch's end, a cut-short last epoch's included
        log_due = {"steps": step % args.logging_steps == 0, "epoch": epoch_end or last, "no": False}
        callbacks = self.callback_handler  # a callback may ask for a log, an evaluation or a checkpoint
        if log_due[args.logging_strategy] or (step == 1 and args.logging_first_step) or force_log \
                or callbacks.requested("should_log"):
            record = {"step": step, "epoch": round(state.epoch, 4), **self._window_means(window)}
            record["num_tokens"] = state.num_tokens
            if args.include_num_input_tokens_seen != "no":
                record["num_input_tokens_seen"] = state.num_input_tokens_seen
            self._publish(record)
            window.clear()
            for warning in self.health.check(state.log_history):
                if self.accelerator.is_main_process:
                    logger.warning(f"health: {warning}")
            self.on_log(record)
            callbacks.fire("log", logs={k: v for k, v in record.items() if k != "step"})
        elif args.logging_strategy == "no":  # nothing logs these steps: train()'s summary has their means (TRL's)
            for name, value in window.pop().items():
                if name not in LOOP_METRICS and isinstance(value, (int, float)):
                    total, count = self._unlogged.get(name, (0.0, 0))
                    self._unlogged[name] = (total + value, count + 1)
        eval_due = (args.eval_strategy == "steps" and step % (args.eval_steps or args.logging_steps) == 0
                    and step >= args.eval_delay) or (
            args.eval_strategy == "epoch" and epoch_end and state.epoch >= args.eval_delay) \
            or callbacks.requested("should_evaluate")
        new_best = self._record_evaluation() if eval_due else False
        save_due = (args.save_strategy == "steps" and (step % args.save_steps == 0 or last)) or (
            args.save_strategy == "epoch" and (epoch_end or last)) or (args.save_strategy == "best" and new_best) \
            or callbacks.requested("should_save")
        if save_due:
            self.save_checkpoint()

    def _record_evaluation(self) -> bool:
        """Evaluate (which logs the metrics). Returns whether metric_for_best_model improved."""
        metrics = self.evaluate()
        args = self.args
        if args.metric_for_best_model is None:
            return False
        return update_best(self.state, metrics, args.metric_for_best_model, args.greater_is_better,
                           type(args).__name__)

    # ------------------------------------------------------------------ transformers' logging methods

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """transformers' Trainer.log: record ``logs`` at the current step (with ``epoch``, and
        ``num_input_tokens_seen`` when counted) in log_history, metrics.jsonl, the trackers while train() runs,
        and the callbacks' on_log. Call it on every process, as the trainer's own records are (the main process
        writes the file and the trackers). ``start_time`` is accepted for transformers' signature; records carry
        their own timing (step_time, tokens_per_second)."""
        record = {"step": self.state.global_step, "epoch": round(self.state.epoch, 4), **logs}
        if self.args.include_num_input_tokens_seen != "no":
            record.setdefault("num_input_tokens_seen", self.state.num_input_tokens_seen)
        self._publish(record)
        self.callback_handler.fire("log", logs={k: v for k, v in record.items() if k != "step"})

    def _publish(self, record: dict) -> None:
        """A metrics record into log_history, metrics.jsonl and the console, and to the trackers while open (train()
        finishes them at its end: a record after it stays in the history and the file)."""
        self.run_log.record(self.state.log_history, record)
        if self.trackers and self._trackers_open:
            self.accelerator.log(numeric_metrics(record), step=record["step"])

    # transformers' functions, bound as in its Trainer: they read is_world_process_zero, args.output_dir, state
    log_metrics = trainer_pt_utils.log_metrics  # "***** eval metrics *****" on the main process
    save_metrics = trainer_pt_utils.save_metrics  # output_dir/<split>_results.json and all_results.json
    save_state = trainer_pt_utils.save_state  # output_dir/trainer_state.json

    # ------------------------------------------------------------------ the end of a run

    def _close_trackers(self) -> None:
        """Flush and close the trackers at the end of train(); the process group stays for save_model/evaluate."""
        for tracker in self.accelerator.trackers:
            tracker.finish()
        self._trackers_open = False

    def _train_summary(self, training_loss: float, runtime: float, first_step: int) -> dict:
        """transformers' TrainOutput.metrics for this call of train(): its runtime and rates, the mean loss, the epoch."""
        steps, runtime = self.state.global_step - first_step, max(runtime, 1e-9)
        return {"train_runtime": round(runtime, 4),
                "train_samples_per_second": round(steps * self.effective_batch_size / runtime, 3),
                "train_steps_per_second": round(steps / runtime, 3),
                "total_flos": self.state.total_flos, "train_loss": training_loss, "epoch": self.state.epoch}
