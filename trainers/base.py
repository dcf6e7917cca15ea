"""BaseTrainer: the loop shared by SFT and GRPO.

Read ``train`` top to bottom: for each optimizer step, take ``gradient_accumulation_steps`` micro-batches,
count what the whole step holds (over every process), then forward, loss, backward on each, step, log,
evaluate, save. A subclass supplies how a micro-batch is made (``micro_batch``) and how its loss is computed
(``compute_loss``); everything distributed goes through ``trainers.distributed``, and ``evaluate()`` with the
eval datasets behind it lives in ``trainers.evaluation``.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any, NamedTuple

import torch
from accelerate.utils import set_seed
from accelerate.utils.memory import clear_device_cache
from transformers import trainer_pt_utils
from transformers.trainer_utils import enable_full_determinism
from transformers.utils.import_utils import enable_tf32

from trainers import distributed as dist
from trainers.callbacks import CallbackHandler
from trainers.checkpoint import (
    TrainerState,
    load_checkpoint,
    load_model_only_checkpoint,
    resolve_resume_path,
    rotate_checkpoints,
    save_checkpoint,
    update_best,
    verify_checkpoint,
)
from trainers.configs import ConfigError, TrainingConfig, tf32_available
from trainers.errors import CheckpointError, NonFiniteError
from trainers.evaluation import Evaluation, named_eval_datasets
from trainers.health import HealthMonitor
from trainers.interrupts import StopOnSignal
from trainers.logs import RunLog, logger, set_log_level
from trainers.losses import BatchCounts
from trainers.modeling import (
    check_model_path,
    clone_chat_template,
    enable_activation_checkpointing,
    load_causal_lm,
    load_tokenizer,
    match_vocabulary,
    non_embedding_parameters,
    router_aux_loss_coef,
    train_added_tokens,
)
from trainers.optimizers import build_optimizer, check_optimizer_parameters, check_optimizers
from trainers.samplers import GlobalBatchSampler
from trainers.schedules import build_scheduler
from trainers.stats import Stats, StepStats
from trainers.trackers import flat_config, numeric_metrics, resolve_report_to


class TrainOutput(NamedTuple):
    global_step: int
    training_loss: float
    metrics: dict


class BaseTrainer(Evaluation):
    """Owns the model, tokenizer, optimizer, schedule, loop, logging, evaluation and checkpoints."""

    config_class: type[TrainingConfig] = TrainingConfig
    # DistributedDataParallel arguments where the config's ddp_* option is None (the config's win)
    ddp_defaults: dict = {}

    def __init__(self, model: Any, args: TrainingConfig | None = None, train_dataset=None, eval_dataset=None,
                 processing_class=None, peft_config=None, quantization_config=None, callbacks=None,
                 optimizers=(None, None), optimizer_cls_and_kwargs=None):
        self.callback_handler = CallbackHandler(callbacks, self)  # a wrong type fails before anything slow
        self._given_optimizer, self._given_scheduler = check_optimizers(optimizers, optimizer_cls_and_kwargs)
        self.optimizer_cls_and_kwargs = optimizer_cls_and_kwargs
        if self._given_optimizer is not None and isinstance(model, str):
            raise ConfigError("optimizers: an optimizer is built on a model's parameters, so `model` must be that "
                              "model instance, not a path.")
        if quantization_config is not None:  # TRL's scripts pass None unless asked to quantize
            raise ConfigError(f"{type(self).__name__}: quantization_config is not supported (no quantized loading "
                              f"or QLoRA here); pass None, or leave it out.")
        if args is None:
            name = model if isinstance(model, str) else type(model).__name__
            args = self.config_class(output_dir=f"{os.path.basename(str(name).rstrip('/'))}-{type(self).__name__}")
        if not isinstance(args, self.config_class):
            raise ConfigError(f"{type(self).__name__} needs args of type {self.config_class.__name__}, "
                              f"got {type(args).__name__}.")
        self.args = args
        if isinstance(model, str):
            check_model_path(model)  # before anything slow, and before the tokenizer is looked up there
        self.trackers = resolve_report_to(args.report_to)  # before anything slow: a missing package is an error
        self.accelerator = dist.build_accelerator(
            args.gradient_accumulation_steps, self._mixed_precision(), args.use_cpu, log_with=self.trackers,
            project_dir=args.output_dir, ddp_kwargs={**self.ddp_defaults, **args.ddp_kwargs}, backend=args.ddp_backend,
            timeout_seconds=args.ddp_timeout)
        if args.save_only_model and args.load_best_model_at_end and dist.is_deepspeed(self.accelerator):
            # a model-only checkpoint holds the gathered full weights, which a sharded engine cannot load back
            raise ConfigError(f"{type(args).__name__}: `save_only_model=True` with `load_best_model_at_end=True` "
                              f"does not work under DeepSpeed (as in transformers); drop one of them.")
        set_log_level(args.log_level if self.accelerator.is_main_process else args.log_level_replica)
        self.health = HealthMonitor()
        if args.full_determinism:
            enable_full_determinism(args.seed)  # seeds too
        else:
            set_seed(args.seed)
        if args.tf32 is not None and tf32_available():  # True without a GPU for it was refused by the config
            enable_tf32(args.tf32)
        template = getattr(args, "chat_template_path", None)
        self.processing_class = load_tokenizer(processing_class, model, getattr(args, "pad_token", None), template)
        # a tokenizer folder or Hub id as chat_template_path: its template and the tokens it needs (TRL's
        # clone_chat_template); the model's embeddings follow once it is loaded
        cloned = None if template is None or os.path.isfile(template) else \
            clone_chat_template(self.processing_class, template)
        # validates and tokenizes before the model loads; several named eval datasets (transformers' dict) each
        # become one set of evaluation rows, swapped in turn into the attributes EVAL_STATE names
        named = named_eval_datasets(eval_dataset)
        self.prepare_data(train_dataset, None if named else eval_dataset)
        self.eval_sets = {name: self._tokenized_eval_set(dataset, f"eval_dataset[{name!r}]")
                          for name, dataset in named.items()}
        for option, wants_eval in (("eval_strategy", args.eval_strategy != "no"),
                                   ("eval_on_start", args.eval_on_start)):
            if wants_eval and not self.has_eval_data():
                raise ConfigError(f"{type(args).__name__}: `{option}={getattr(args, option)!r}` needs an eval_dataset; "
                                  f"give one to the trainer, or leave {option} at its default.")
        self.steps_per_epoch = self.optimizer_steps_per_epoch()
        self.max_steps = args.max_steps if args.max_steps > 0 else max(
            1, math.ceil(args.num_train_epochs * self.steps_per_epoch))

        model = load_causal_lm(model, args.model_init_kwargs, args.trust_remote_code)
        if cloned is not None:
            match_vocabulary(model, self.processing_class)
            if cloned and peft_config is not None:
                train_added_tokens(peft_config, model, cloned)
        if peft_config is not None:
            model = self._wrap_peft(model, peft_config)
        if args.gradient_checkpointing:
            enable_activation_checkpointing(model, args.gradient_checkpointing_kwargs)
        self.is_peft = peft_config is not None
        # A Mixture-of-Experts model's router load-balancing loss joins the training loss (as in TRL)
        self.router_aux_loss_coef = router_aux_loss_coef(model, args.router_aux_loss_coef)
        # transformers' total_flos estimate: 6 x non-embedding parameters per input token (forward + backward)
        self.flos_per_token = 6 * non_embedding_parameters(model)
        # every eval dataset's model checks (vocabulary, context): the trainer's own, then each named one
        eval_sets = {"eval_dataset": None} if getattr(self, "eval_rows", None) is not None else {}
        eval_sets |= {f"eval_dataset[{name!r}]": eval_set for name, eval_set in self.eval_sets.items()}
        for label, eval_set in eval_sets.items():
            with self._eval_set(eval_set):
                self.check_eval_fit(model, label)
        self.after_load(model)

        if self._given_optimizer is not None:
            optimizer = self._given_optimizer
            check_optimizer_parameters(optimizer, model, self.accelerator)
        else:
            optimizer = build_optimizer(model, args, self.optimizer_cls_and_kwargs)
        dist.configure_deepspeed(self.accelerator, args.per_device_train_batch_size,
                                 args.gradient_accumulation_steps, args.max_grad_norm, model)
        self.model, self.optimizer = self.accelerator.prepare(model, optimizer)
        if args.ddp_kwargs and self.accelerator.num_processes > 1 and \
                not isinstance(self.model, torch.nn.parallel.DistributedDataParallel):
            names = ", ".join(f"ddp_{k}" for k in args.ddp_kwargs)
            logger.warning(f"DistributedDataParallel options ({names}) change nothing in this run: it uses "
                           f"{self.accelerator.distributed_type.value}, which syncs gradients itself.")
        # Stepped by the loop, once per optimizer step (Accelerate would step it once per process).
        self.lr_scheduler = self._given_scheduler or build_scheduler(self.optimizer, args, self.max_steps)
        self.accelerator.register_for_checkpointing(self.lr_scheduler)
        self.state = TrainerState()
        # metrics.jsonl and the console; train() replaces it with one that drives the progress bar
        self.run_log = RunLog(self.accelerator, args.output_dir, 0, disable_tqdm=True)
        self._trackers_open = False  # between init_trackers and finish, inside train()
        self.after_prepare()
        # From here on, random draws (sampling, dropout) differ per process; data order has its own generators.
        set_seed(args.seed + self.accelerator.process_index)
        self.callback_handler.fire("init_end")

    # ------------------------------------------------------------------ callbacks (transformers' contract)

    def add_callback(self, callback) -> None:
        """Add a transformers.TrainerCallback (an instance or its class) after the existing ones."""
        self.callback_handler.add(callback)

    def pop_callback(self, callback):
        """Remove and return the first callback that is ``callback`` (or an instance of that class); None if none."""
        return self.callback_handler.pop(callback)

    def remove_callback(self, callback) -> None:
        self.callback_handler.pop(callback)

    def is_world_process_zero(self) -> bool:
        """Whether this is the main process of the run (transformers' Trainer method)."""
        return self.accelerator.is_main_process

    def is_local_process_zero(self) -> bool:
        """Whether this is the main process of its machine (transformers' Trainer method)."""
        return self.accelerator.is_local_main_process

    def _describe_run(self) -> None:
        """The TrainerState fields transformers' callbacks read, set at the start of each train()."""
        args, acc, state = self.args, self.accelerator, self.state
        state.max_steps, state.num_train_epochs = self.max_steps, math.ceil(self.max_steps / self.steps_per_epoch)
        state.logging_steps, state.save_steps = args.logging_steps, args.save_steps
        state.eval_steps = args.eval_steps or args.logging_steps
        state.train_batch_size = args.per_device_train_batch_size
        state.is_world_process_zero, state.is_local_process_zero = acc.is_main_process, acc.is_local_main_process

    def batch_sampler(self, lengths: list[int], batch: int, unit: str) -> GlobalBatchSampler:
        """The training order of rows of these ``lengths`` in batches of ``batch`` rows (``unit`` names such a batch
        in messages): reshuffled every epoch (train_sampling_strategy="random" with shuffle_dataset), in dataset
        order ("sequential"), or in batches of similar lengths ("group_by_length"); the last incomplete batch
        filled up from the epoch's start or, with dataloader_drop_last, dropped."""
        args, name, num_rows = self.args, type(self.args).__name__, len(lengths)
        if args.dataloader_drop_last and num_rows < batch:
            raise ConfigError(f"{name}: `dataloader_drop_last=True` drops each epoch's last incomplete {unit}, and "
                              f"train_dataset's {num_rows} rows are fewer than one {unit} ({batch} rows): nothing "
                              f"would be trained. Use a smaller batch, or dataloader_drop_last=False.")
        strategy = args.train_sampling_strategy
        sampler = GlobalBatchSampler(num_rows, batch, args.data_order_seed,
                                     shuffle=args.shuffle_dataset and strategy != "sequential",
                                     drop_last=args.dataloader_drop_last,
                                     lengths=lengths if strategy == "group_by_length" else None)
        if self.accelerator.is_main_process and (sampler.padding_per_epoch or sampler.dropped_per_epoch):
            what = (f"leaves out {sampler.dropped_per_epoch} rows (dataloader_drop_last=True)"
                    if args.dataloader_drop_last else f"repeats {sampler.padding_per_epoch} rows to fill its last one")
            logger.info(f"train_dataset's {num_rows} rows are not a multiple of the {unit} ({batch} rows): each "
                        f"epoch {what}.")
        return sampler

    # ------------------------------------------------------------------ what subclasses provide

    def prepare_data(self, train_dataset, eval_dataset) -> None:
        raise NotImplementedError

    def optimizer_steps_per_epoch(self) -> int:
        raise NotImplementedError

    def micro_batch(self, step: int, accumulation_index: int) -> dict:
        """This process's micro-batch ``accumulation_index`` of optimizer step ``step``; must hold ``loss_mask``."""
        raise NotImplementedError

    def compute_loss(self, model, batch: dict, counts: BatchCounts) -> tuple[torch.Tensor, Stats]:
        """The micro-batch's share of the step's loss (normalized by ``counts``), and statistics to log."""
        raise NotImplementedError

    def evaluation_stats(self) -> Stats:
        """This process's share of evaluation statistics over ``eval_dataset``."""
        raise NotImplementedError

    def eval_rows_per_batch(self) -> int:
        """How many eval rows one evaluation batch holds on each process (eval_steps_per_second)."""
        raise NotImplementedError

    def after_load(self, model) -> None:
        """Called with the loaded (and PEFT-wrapped) model before it is prepared."""

    def after_prepare(self) -> None:
        """Called once the model is prepared (GRPO sets up its reference model and rewards here)."""

    def on_log(self, record: dict) -> None:
        """Called on every process after a metrics record is written."""

    def run_info(self) -> dict:
        """What ``training_args.json`` records about this run (``trainers report`` shows it)."""
        return {"trainer": type(self).__name__, "model": getattr(self.unwrapped_model.config, "_name_or_path", None),
                "num_processes": self.accelerator.num_processes, "effective_batch_size": self.effective_batch_size,
                "max_steps": self.max_steps, "config": self.args.to_dict()}

    def step_metrics(self) -> dict:
        """Metrics a subclass measured outside ``compute_loss`` during the last step (already global)."""
        return {}

    def add_router_loss(self, loss: torch.Tensor, out: dict, counts: BatchCounts, stats: Stats) -> torch.Tensor:
        """``loss`` plus the MoE router load-balancing loss of this micro-batch (``out["aux_loss"]``, from a
        forward with ``with_router_loss``) weighted by router_aux_loss_coef and averaged over the step's
        micro-batches, as TRL adds it; logged as ``aux_loss``. Unchanged for models without a router."""
        if not self.router_aux_loss_coef:
            return loss
        aux = out["aux_loss"].float()  # a mean over this micro-batch's tokens
        stats["aux_loss"] = (aux.detach(), 1.0)
        return loss + self.router_aux_loss_coef * aux / counts.micro_batches

    def save_extra_state(self, folder: str) -> None:
        """Per-process state a subclass needs to resume exactly (called on every process)."""

    def load_extra_state(self, folder: str) -> None:
        pass

    # ------------------------------------------------------------------ set-up helpers

    def _mixed_precision(self) -> str | None:
        if self.args.bf16:
            return "bf16"
        if self.args.fp16:
            return "fp16"
        if self.args.bf16 is False:
            return "no"
        return None  # follow the launch configuration

    @property
    def effective_batch_size(self) -> int:
        """Samples per optimizer step over all processes: per-device x processes x accumulation."""
        return (self.args.per_device_train_batch_size * self.accelerator.num_processes
                * self.args.gradient_accumulation_steps)

    def _wrap_peft(self, model, peft_config):
        from peft import get_peft_model

        return get_peft_model(model, peft_config)

    @property
    def unwrapped_model(self):
        return dist.unwrap(self.accelerator, self.model)

    # ------------------------------------------------------------------ the loop

    def train(self, resume_from_checkpoint: bool | str | None = None) -> TrainOutput:
        args, acc = self.args, self.accelerator
        if resume_from_checkpoint is None:
            resume_from_checkpoint = args.resume_from_checkpoint
        resume_path = resolve_resume_path(resume_from_checkpoint, args.output_dir)
        if resume_path is not None:
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
        if acc.is_main_process:
            logger.info(
                f"effective batch size {self.effective_batch_size} = {args.per_device_train_batch_size} per device "
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
        window: list[dict] = []
        step_losses: list[float] = []  # every step of this call, whatever logging_steps is (TrainOutput's mean)
        self.model.train()
        self._describe_run()
        callbacks = self.callback_handler
        callbacks.new_training()
        callbacks.fire("train_begin")
        if args.eval_on_start:  # as transformers: also when resuming, logged at the step it starts from
            self._record_evaluation()
        with StopOnSignal() as stop:
            while self.state.global_step < self.max_steps:
                step = self.state.global_step
                callbacks.new_step()
                if step % self.steps_per_epoch == 0 or step == first_step:  # a resumed run starts mid-epoch
                    callbacks.fire("epoch_begin")
                callbacks.fire("step_begin")
                started = time.perf_counter()
                batches = [self.micro_batch(step, a) for a in range(args.gradient_accumulation_steps)]
                step_stats = self._optimizer_step(batches, stop_requested=bool(stop.received))
                step_stats.update(self.step_metrics())
                step_stats["step_time"] = time.perf_counter() - started
                self.state.global_step += 1
                self.state.epoch = self.state.global_step / self.steps_per_epoch
                tokens = int(step_stats.pop("num_input_tokens"))  # all processes
                padded = int(step_stats.pop("num_padded_tokens"))  # all processes, padding included
                self.state.num_tokens += tokens
                self.state.total_flos += float(self.flos_per_token * padded)  # padding included, as transformers
                if args.include_num_input_tokens_seen != "no":
                    counted = padded if args.include_num_input_tokens_seen == "all" else tokens
                    self.state.num_input_tokens_seen += counted
                step_stats["tokens_per_second"] = tokens / step_stats["step_time"]
                stop_requested = step_stats.pop("stop_requested") > 0
                window.append(step_stats)
                if math.isfinite(step_stats["loss"]) or not args.logging_nan_inf_filter:
                    step_losses.append(step_stats["loss"])
                run_log.advance(self._progress(step_stats))
                callbacks.fire("step_end")
                if self.state.global_step % self.steps_per_epoch == 0:
                    callbacks.fire("epoch_end")
                self._log_eval_save(window, force_log=stop_requested)
                self._check_nonfinite(step_stats["grad_norm"])
                if args.torch_empty_cache_steps and self.state.global_step % args.torch_empty_cache_steps == 0:
                    clear_device_cache()  # nothing to return on CPU
                if stop_requested:
                    run_log.close()
                    self._stop_on_signal(stop.received)
                if callbacks.requested("should_training_stop"):  # e.g. transformers' EarlyStoppingCallback
                    if acc.is_main_process:
                        logger.info(f"a callback stopped training at step {self.state.global_step}")
                    break
        run_log.close()
        if args.load_best_model_at_end and self.state.best_model_checkpoint is not None:
            self._load_best_model()
        elif args.load_best_model_at_end and acc.is_main_process:
            # e.g. the evaluation before training (eval_on_start) stayed the best: there is no checkpoint of it
            logger.warning(f"load_best_model_at_end: no checkpoint holds the best evaluation "
                           f"({args.metric_for_best_model} {self.state.best_metric} at step "
                           f"{self.state.best_global_step}); the final weights stay.")
        if args.save_total_limit == 1 and self.state.best_model_checkpoint is not None and acc.is_main_process:
            # rotation kept the newest checkpoint beside the best for resuming; training is over (transformers)
            rotate_checkpoints(args.output_dir, 1, best=self.state.best_model_checkpoint, keep_newest=False)
        acc.wait_for_everyone()
        callbacks.fire("train_end")
        for tracker in acc.trackers:  # flushed and closed; the process group stays for save_model/evaluate
            tracker.finish()
        self._trackers_open = False
        training_loss = sum(step_losses) / max(len(step_losses), 1)
        return TrainOutput(self.state.global_step, training_loss,
                           self._train_summary(training_loss, time.time() - started_at, first_step))

    def _train_summary(self, training_loss: float, runtime: float, first_step: int) -> dict:
        """transformers' TrainOutput.metrics for this call of train(): its runtime and rates, the mean loss, the epoch."""
        steps, runtime = self.state.global_step - first_step, max(runtime, 1e-9)
        return {"train_runtime": round(runtime, 4),
                "train_samples_per_second": round(steps * self.effective_batch_size / runtime, 3),
                "train_steps_per_second": round(steps / runtime, 3),
                "total_flos": self.state.total_flos, "train_loss": training_loss, "epoch": self.state.epoch}

    def _progress(self, step_stats: dict) -> dict:
        """What the progress bar shows beside step and time left: loss, reward (GRPO), tokens/s."""
        shown = {k: step_stats[k] for k in ("loss", "reward") if k in step_stats}
        shown["tok/s"] = round(step_stats["tokens_per_second"])
        return shown

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

    def _optimizer_step(self, batches: list[dict], stop_requested: bool = False) -> dict:
        """Forward/backward every micro-batch of one optimizer step, then step. Returns the step's metrics.

        A step whose gradient norm is not finite (a non-finite loss makes it so) is not applied: its
        gradients are dropped (DeepSpeed does the same inside its step). ``stop_requested`` is this process's
        signal flag; the returned ``stop_requested`` is the sum over processes, so all stop together."""
        acc = self.accelerator
        counts, local_input_tokens, local_padded_tokens = self._count(batches)
        # accelerator.backward divides by the accumulation steps and DDP/DeepSpeed average over processes;
        # our losses are already normalized by global counts, so undo both.
        scale = acc.num_processes * self.args.gradient_accumulation_steps
        loss_sum = torch.zeros((), device=acc.device)
        step_stats = StepStats(acc.device)
        grad_norm = None
        for index, batch in enumerate(batches):
            with acc.accumulate(self.model), dist.explained_ddp_errors():
                loss, stats = self.compute_loss(self.model, batch, counts)
                acc.backward(loss * scale)
                loss_sum += loss.detach().float()
                step_stats.add(stats)
                if acc.sync_gradients:
                    assert index == len(batches) - 1, "gradient sync must happen on the last micro-batch"
                    norm = self._clip_gradients()
                    grad_norm = None if norm is None else float(norm)
                    self.callback_handler.fire("pre_optimizer_step")
                    if grad_norm is None or math.isfinite(grad_norm):
                        self.optimizer.step()
                    self.callback_handler.fire("optimizer_step")
                    self.optimizer.zero_grad(set_to_none=True)
                else:
                    self.callback_handler.fire("substep_end")
        learning_rate = self.lr_scheduler.get_last_lr()[0]
        self.lr_scheduler.step()
        head = {"loss": loss_sum, "num_input_tokens": local_input_tokens, "num_padded_tokens": local_padded_tokens,
                "stop_requested": float(stop_requested)}  # summed over processes with the statistics
        sums, stats_metrics = step_stats.reduce(acc, [torch.as_tensor(v, device=acc.device) for v in head.values()])
        metrics = dict(zip(head, sums)) | stats_metrics
        metrics["learning_rate"] = learning_rate
        metrics["grad_norm"] = grad_norm
        metrics["nonfinite_steps"] = self.state.total_nonfinite + (grad_norm is not None and not math.isfinite(grad_norm))
        return metrics

    def _count(self, batches: list[dict]) -> tuple[BatchCounts, float, float]:
        """Tokens and sequences the loss covers in this step, summed over micro-batches and processes; and this
        process's input tokens, without and with padding."""
        acc = self.accelerator
        local = torch.zeros(4, device=acc.device)
        for batch in batches:
            mask = batch["loss_mask"]
            local[0] += mask.sum()
            local[1] += (mask.sum(-1) > 0).sum()
            local[2] += batch["num_input_tokens"]
            local[3] += batch["num_padded_tokens"]
        tokens, sequences = dist.all_reduce_sum(acc, local[:2]).tolist()
        counts = BatchCounts(tokens=tokens, sequences=sequences, micro_batches=acc.num_processes * len(batches),
                             max_completion_length=getattr(self.args, "max_completion_length", 1))
        return counts, float(local[2]), float(local[3])

    def _clip_gradients(self):
        max_norm = self.args.max_grad_norm or float("inf")
        params = [p for p in self.model.parameters() if p.requires_grad]
        return self.accelerator.clip_grad_norm_(params, max_norm)

    def _log_eval_save(self, window: list[dict], force_log: bool = False) -> None:
        args, state = self.args, self.state
        step, last = state.global_step, state.global_step == self.max_steps
        epoch_end = step % self.steps_per_epoch == 0
        log_due = {"steps": step % args.logging_steps == 0 or last, "epoch": epoch_end or last, "no": False}
        callbacks = self.callback_handler  # a callback may ask for a log, an evaluation or a checkpoint
        if log_due[args.logging_strategy] or (step == 1 and args.logging_first_step) or force_log \
                or callbacks.requested("should_log"):
            record = {"step": step, "epoch": round(state.epoch, 4)}
            for name in dict.fromkeys(name for w in window for name in w):  # every name, first-seen order
                values = [w[name] for w in window if name in w]
                if name == "loss" and args.logging_nan_inf_filter:  # as transformers: the finite steps' mean
                    values = [v for v in values if math.isfinite(v)] or values
                record[name] = sum(values) / len(values)
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
        elif args.logging_strategy == "no":
            window.clear()  # nothing will log these steps
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

    # ------------------------------------------------------------------ logging (transformers' methods)

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

    # ------------------------------------------------------------------ evaluation, checkpoints, saving

    def _record_evaluation(self) -> bool:
        """Evaluate (which logs the metrics). Returns whether metric_for_best_model improved."""
        metrics = self.evaluate()
        args = self.args
        if args.metric_for_best_model is None:
            return False
        return update_best(self.state, metrics, args.metric_for_best_model, args.greater_is_better,
                           type(args).__name__)

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

    def end(self) -> None:
        """Finish the trackers and destroy the distributed process group (transformers' Trainer.end). Call it
        once, at the very end of a script: train, evaluate and save_model need the other processes."""
        self.accelerator.end_training()

    def save_model(self, output_dir: str | None = None) -> None:
        """Save the model in Hugging Face format (safetensors) with its tokenizer; under ZeRO-3 the full weights
        are gathered first; with PEFT only the adapter is saved. Every process must call this."""
        output_dir = output_dir or self.args.output_dir
        state_dict = dist.full_state_dict(self.accelerator, self.model)
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
