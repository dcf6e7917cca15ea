"""BaseTrainer: the loop shared by SFT and GRPO.

Read ``train`` top to bottom: for each optimizer step, ``prepare_step``, then its micro-batches (``step_batches``:
``gradient_accumulation_steps`` of them, unless a subclass regroups them), counted over every process
(``batch_counts``), then forward, loss, backward on each and the optimizer step (``_optimizer_step``),
``after_optimizer_step``, the step's bookkeeping, then log, evaluate, save, and the checks that stop a run. A
subclass supplies how a micro-batch is made (``micro_batch``, returning a ``MicroBatch``) and how its loss is
computed (``compute_loss``). Everything distributed goes through ``trainers.parallel.distributed``; the
rest of the trainer is in mixins: ``evaluate()`` and the eval datasets (``trainers.loop.evaluation``), what a run
records and when it logs, evaluates and saves (``trainers.loop.run_logging``), checkpoints, resuming, the best
model and ``save_model`` (``trainers.loop.saving``), and transformers' Trainer attributes and methods for scripts and
callbacks (``trainers.loop.trainer_attributes``). The training order comes from ``trainers.data.samplers``.
"""

from __future__ import annotations

import math
import os
import time
import warnings
from typing import Any, NamedTuple, Protocol

import torch
from accelerate.utils import set_seed
from accelerate.utils.memory import clear_device_cache
from transformers import TrainingArguments
from transformers.trainer_utils import enable_full_determinism
from transformers.utils.import_utils import enable_tf32

from trainers.parallel import distributed as dist
from trainers.loop import health
from trainers.loop.callbacks import CallbackHandler
from trainers.loop.checkpoint import TrainerState
from trainers.config.training import TrainingConfig, config_from_training_arguments, tf32_available
from trainers.errors import ConfigError, DatasetFormatError
from trainers.loop.evaluation import Evaluation, named_eval_datasets
from trainers.loop.health import HealthMonitor
from trainers.loop.interrupts import StopOnSignal
from trainers.logs import RunLog, logger, set_log_level
from trainers.model.losses import BatchCounts
from trainers.model.modeling import (
    check_model_path,
    clone_chat_template,
    enable_activation_checkpointing,
    load_causal_lm,
    load_tokenizer,
    match_vocabulary,
    non_embedding_parameters,
    padding_free_attention,
    router_aux_loss_coef,
    train_added_tokens,
)
from trainers.optim.optimizers import build_optimizer, check_optimizer_parameters, check_optimizers, step_unless_nonfinite
from trainers.loop.run_logging import RunLogging
from trainers.data.samplers import GlobalBatchSampler, per_process_batch_size, training_sampler
from trainers.loop.saving import Saving
from trainers.optim.schedules import build_scheduler
from trainers.loop.stats import Stats, StepStats
from trainers.loop.trackers import resolve_report_to
from trainers.loop.trainer_attributes import TrainerAttributes


class TrainOutput(NamedTuple):
    global_step: int
    training_loss: float
    metrics: dict


class MicroBatch(Protocol):
    """What the loop reads of a micro-batch: ``micro_batch`` returns one and ``compute_loss`` gets it back. A
    subclass's micro-batch (a frozen dataclass: SFTBatch, GRPO's) carries its model inputs beside these."""

    @property
    def loss_mask(self) -> torch.Tensor:  # [B, T] float: 1 on the tokens the loss covers
        ...

    @property
    def num_input_tokens(self) -> torch.Tensor | float:  # 0-d: the real (not padding) tokens fed to the model
        ...

    @property
    def num_padded_tokens(self) -> torch.Tensor | float:  # 0-d: the positions fed to the model, padding included
        ...


class BaseTrainer(Evaluation, RunLogging, Saving, TrainerAttributes):
    """Owns the model, tokenizer, optimizer, schedule and the loop; evaluation, logging, checkpoints and
    transformers' Trainer attributes come from its mixins (see the module docstring)."""

    config_class: type[TrainingConfig] = TrainingConfig
    _tag_names: tuple[str, ...] = ("trainers",)  # added to the model's model_tags (TRL's attribute, its ["trl", "sft"])
    # DistributedDataParallel arguments where the config's ddp_* option is None (the config's win)
    ddp_defaults: dict = {}
    HEALTH_RULES: tuple = health.RULES  # the warnings its run can raise (trainers/loop/health.py); a trainer adds its own

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
        if isinstance(args, TrainingArguments):  # a plain transformers one (or TRL's): converted, as TRL's SFTTrainer
            args = config_from_training_arguments(self.config_class, args)
        if not isinstance(args, self.config_class):
            raise ConfigError(f"{type(self).__name__} needs args of type {self.config_class.__name__}, "
                              f"got {type(args).__name__}.")
        self.args = args
        if isinstance(model, str):
            check_model_path(model)  # before anything slow, and before the tokenizer is looked up there
        self.trackers = resolve_report_to(args.report_to)  # before anything slow: a missing package is an error
        self.accelerator = dist.build_accelerator(
            args.gradient_accumulation_steps, args.mixed_precision, args.use_cpu, log_with=self.trackers,
            project_dir=args.output_dir, ddp_kwargs={**self.ddp_defaults, **args.ddp_kwargs}, backend=args.ddp_backend,
            timeout_seconds=args.ddp_timeout)
        # rows per process per micro-batch: accelerator_config's split_batches divides the per_device_* sizes
        self.per_process_train_batch_size = per_process_batch_size(args, "per_device_train_batch_size",
                                                                   self.accelerator.num_processes)
        self.per_process_eval_batch_size = per_process_batch_size(args, "per_device_eval_batch_size",
                                                                  self.accelerator.num_processes)
        if args.save_only_model and args.load_best_model_at_end and dist.is_deepspeed(self.accelerator):
            # a model-only checkpoint holds the gathered full weights, which a sharded engine cannot load back
            raise ConfigError(f"{type(args).__name__}: `save_only_model=True` with `load_best_model_at_end=True` "
                              f"does not work under DeepSpeed (as in transformers); drop one of them.")
        set_log_level(args.log_level if self.accelerator.is_main_process else args.log_level_replica)
        self.health = HealthMonitor(self.HEALTH_RULES)
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
        if train_dataset is None:  # TRL's words
            raise DatasetFormatError(f"`train_dataset` is required: {type(self).__name__} trains on it.")
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

        chosen_by_user = not isinstance(model, str) or "attn_implementation" in (args.model_init_kwargs or {})
        model = self.load_model(model)
        self._choose_padding_free_attention(model, chosen_by_user)
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
        if hasattr(model, "add_model_tags"):  # transformers' model card tags, as TRL adds its own
            model.add_model_tags(self._tag_names)

        if self._given_optimizer is not None:
            optimizer = self._given_optimizer
            check_optimizer_parameters(optimizer, model, self.accelerator)
        else:
            optimizer = build_optimizer(model, args, self.optimizer_cls_and_kwargs)
        dist.configure_deepspeed(self.accelerator, self.per_process_train_batch_size,
                                 args.gradient_accumulation_steps, args.max_grad_norm, model)
        # transformers' pair: model_wrapped is what trains (DDP, a DeepSpeed engine, or the model itself), model
        # the PreTrainedModel inside it (what user code, callbacks and save_model read)
        self.model_wrapped, self.optimizer = self.accelerator.prepare(model, optimizer)
        self.model = dist.unwrap(self.accelerator, self.model_wrapped)
        if args.ddp_kwargs and self.accelerator.num_processes > 1 and \
                not isinstance(self.model_wrapped, torch.nn.parallel.DistributedDataParallel):
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
        self.is_in_train = False
        self.after_prepare()
        # From here on, random draws (sampling, dropout) differ per process; data order has its own generators.
        set_seed(args.seed + self.accelerator.process_index)
        self.callback_handler.fire("init_end")

    # ------------------------------------------------------------------ what subclasses provide

    def prepare_data(self, train_dataset, eval_dataset) -> None:
        raise NotImplementedError

    def optimizer_steps_per_epoch(self) -> int:
        raise NotImplementedError

    def prepare_step(self, step: int) -> None:
        """Called on every process at the start of optimizer step ``step``, before its ``micro_batch`` calls.
        Does nothing here; GRPO builds its generation rounds here."""

    def micro_batch(self, step: int, accumulation_index: int) -> MicroBatch:
        """This process's micro-batch ``accumulation_index`` of optimizer step ``step`` (see ``MicroBatch``)."""
        raise NotImplementedError

    def step_batches(self, step: int) -> list[MicroBatch]:
        """This process's micro-batches of optimizer step ``step``: ``micro_batch`` for each of the
        gradient_accumulation_steps. A subclass may regroup them (GRPO's token_budget), as many on every process."""
        return [self.micro_batch(step, a) for a in range(self.args.gradient_accumulation_steps)]

    def compute_loss(self, model, batch: MicroBatch, counts: BatchCounts) -> tuple[torch.Tensor, Stats]:
        """The micro-batch's share of the step's loss (normalized by ``counts``), and statistics to log."""
        raise NotImplementedError

    def evaluation_stats(self) -> Stats:
        """This process's share of evaluation statistics over ``eval_dataset``."""
        raise NotImplementedError

    def eval_rows_per_batch(self) -> int:
        """How many eval rows one evaluation batch holds on each process (eval_steps_per_second)."""
        raise NotImplementedError

    def load_model(self, model):
        """The model to train from ``model`` (a path, a Hub id or an instance): a causal LM here; the reward
        trainer loads a sequence classifier."""
        return load_causal_lm(model, self.args.model_init_kwargs, self.args.trust_remote_code)

    def _choose_padding_free_attention(self, model, chosen_by_user: bool) -> None:
        """Padding-free rows on CUDA: a varlen attention where one is installed, else a warning
        (modeling.padding_free_attention)."""
        config = getattr(model, "config", None)
        if not getattr(self.args, "padding_free", False) or config is None:
            return
        from transformers.utils import is_flash_attn_2_available

        device = self.accelerator.device.type
        switch, warning = padding_free_attention(device, getattr(config, "_attn_implementation", None),
                                                 chosen_by_user, device == "cuda" and is_flash_attn_2_available())
        if switch is not None:
            model.set_attn_implementation(switch)
            logger.info(f"padding_free=True on CUDA: attention {switch!r} (varlen, no block-diagonal mask)")
        if warning is not None and self.accelerator.is_main_process:
            warnings.warn(warning, stacklevel=3)

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

    def after_optimizer_step(self, metrics: dict) -> None:
        """Called on every process right after each optimizer step (``_optimizer_step``), before ``global_step``
        counts it and before anything is logged, with the step's metrics, already reduced over processes. Entries
        added to ``metrics`` are logged with the step's (GRPO: its rounds' metrics, the adaptive entropy
        coefficient). Does nothing here; a subclass uses it instead of overriding ``_optimizer_step``."""

    def add_router_loss(self, loss: torch.Tensor, out: dict, counts: BatchCounts, stats: Stats) -> torch.Tensor:
        """``loss`` plus the MoE router load-balancing loss of this micro-batch (``out["aux_loss"]``, from a
        forward with ``with_router_loss``) weighted by router_aux_loss_coef and averaged over the step's
        micro-batches, as TRL adds it; logged as ``aux_loss``. Unchanged for models without a router."""
        if not self.router_aux_loss_coef or out.get("aux_loss") is None:  # None: a MoE sequence classifier's
            return loss  # output has no router loss, and TRL adds none
        aux = out["aux_loss"].float()  # a mean over this micro-batch's tokens
        stats["aux_loss"] = (aux.detach(), 1.0)
        return loss + self.router_aux_loss_coef * aux / counts.micro_batches

    def save_extra_state(self, folder: str) -> None:
        """Per-process state a subclass needs to resume exactly (called on every process)."""

    def load_extra_state(self, folder: str) -> None:
        pass

    # ------------------------------------------------------------------ set-up helpers

    def _wrap_peft(self, model, peft_config):
        from peft import get_peft_model

        return get_peft_model(model, peft_config)

    def batch_sampler(self, lengths: list[int], batch: int, unit: str) -> GlobalBatchSampler:
        """The training order of rows of these ``lengths`` in global batches of ``batch`` rows, by the config's
        data-order options (trainers.data.samplers.training_sampler); ``unit`` names such a batch in messages."""
        return training_sampler(self.args, lengths, batch, unit, log=self.accelerator.is_main_process)

    # ------------------------------------------------------------------ the loop

    def train(self, resume_from_checkpoint: bool | str | None = None) -> TrainOutput:
        """Train to ``max_steps`` (from a checkpoint with ``resume_from_checkpoint``: True for the newest in
        output_dir, or its path; None: the config's). Returns the final step, the mean loss of this call's steps,
        and transformers' summary metrics."""
        args = self.args
        self.is_in_train = True  # transformers' flag; False again when train() returns
        self._resume(args.resume_from_checkpoint if resume_from_checkpoint is None else resume_from_checkpoint)
        started_at, first_step = self._start_run()
        window: list[dict] = []  # the metrics of the steps since the last log record
        step_losses: list[float] = []  # every step of this call, whatever logging_steps is (TrainOutput's mean)
        with StopOnSignal() as stop:
            while self.state.global_step < self.max_steps:
                step = self.state.global_step
                started = self._begin_step(step, first_step)
                self.prepare_step(step)
                batches = self.step_batches(step)
                metrics = self._optimizer_step(batches, stop_requested=bool(stop.received))
                self.after_optimizer_step(metrics)
                self.derive_metrics(metrics, "")
                self._account_step(metrics, time.perf_counter() - started)
                stop_requested = metrics.pop("stop_requested") > 0  # a signal reached some process
                self._end_step(metrics, window, step_losses)
                self._log_eval_save(window, force_log=stop_requested)
                self._check_nonfinite(metrics["grad_norm"])
                if args.torch_empty_cache_steps and self.state.global_step % args.torch_empty_cache_steps == 0:
                    clear_device_cache()  # nothing to return on CPU
                if stop_requested:
                    self.run_log.close()
                    self._stop_on_signal(stop.received)
                if self._stopped_by_callback():
                    break
        return self._finish_run(started_at, first_step, step_losses, window)

    def _begin_step(self, step: int, first_step: int) -> float:
        """Fire the callbacks that open step ``step`` (on_epoch_begin too at an epoch's start, or the first step of
        a resumed run, which starts mid-epoch); returns the time the step starts from (its step_time)."""
        callbacks = self.callback_handler
        callbacks.new_step()
        if step % self.steps_per_epoch == 0 or step == first_step:
            callbacks.fire("epoch_begin")
        callbacks.fire("step_begin")
        return time.perf_counter()

    def _account_step(self, metrics: dict, step_time: float) -> None:
        """Count the step just done in ``self.state`` (global_step, epoch, tokens, FLOs), moving the step's token
        counts out of ``metrics`` into it; adds step_time and tokens_per_second to ``metrics``."""
        args, state = self.args, self.state
        state.global_step += 1
        state.epoch = state.global_step / self.steps_per_epoch
        tokens = int(metrics.pop("num_input_tokens"))  # all processes
        padded = int(metrics.pop("num_padded_tokens"))  # all processes, padding included
        state.num_tokens += tokens
        state.total_flos += float(self.flos_per_token * padded)  # padding included, as transformers
        if args.include_num_input_tokens_seen != "no":
            state.num_input_tokens_seen += padded if args.include_num_input_tokens_seen == "all" else tokens
        metrics["step_time"] = step_time
        metrics["tokens_per_second"] = tokens / step_time
        if self.accelerator.device.type == "cuda":  # the step's peak GPU memory, the largest over the processes
            metrics["memory/peak_allocated_gb"] = gpu_peak_gb(self.accelerator)

    def _end_step(self, metrics: dict, window: list[dict], step_losses: list[float]) -> None:
        """The step's metrics into the log ``window`` and its loss into ``step_losses`` (unless logging_nan_inf_filter
        keeps a non-finite one out); the progress bar advances; on_step_end (and on_epoch_end) fire."""
        window.append(metrics)
        if math.isfinite(metrics["loss"]) or not self.args.logging_nan_inf_filter:
            step_losses.append(metrics["loss"])
        self.run_log.advance(self._progress(metrics))
        self.callback_handler.fire("step_end")
        if self.state.global_step % self.steps_per_epoch == 0:
            self.callback_handler.fire("epoch_end")

    def _stopped_by_callback(self) -> bool:
        """Whether a callback asked training to stop (e.g. transformers' EarlyStoppingCallback)."""
        if not self.callback_handler.requested("should_training_stop"):
            return False
        if self.accelerator.is_main_process:
            logger.info(f"a callback stopped training at step {self.state.global_step}")
        return True

    def _finish_run(self, started_at: float, first_step: int, step_losses: list[float], window: list[dict]
                    ) -> TrainOutput:
        """Close the progress bar, log the run's summary (transformers' last log_history entry: train_runtime, the
        rates, total_flos, train_loss, epoch, step; with the trainer's metrics, as TRL: ``_summary_extras``),
        settle the best model, fire on_train_end, close the trackers; train()'s output."""
        self.run_log.close()
        training_loss = sum(step_losses) / max(len(step_losses), 1)
        summary = self._train_summary(training_loss, time.time() - started_at, first_step)
        closing = {name: value for name, value in summary.items() if name != "epoch"}  # log() adds the epoch
        self.log({**self._summary_extras(window), **closing})
        self._settle_best_model()
        self.accelerator.wait_for_everyone()
        self.callback_handler.fire("train_end")
        self._close_trackers()
        self.is_in_train = False
        return TrainOutput(self.state.global_step, training_loss, summary)

    def _optimizer_step(self, batches: list[MicroBatch], stop_requested: bool = False) -> dict:
        """Forward/backward every micro-batch of one optimizer step, then step. Returns the step's metrics, reduced
        over processes: ``loss``, ``num_input_tokens``, ``num_padded_tokens`` and ``stop_requested`` (sums), the
        ``compute_loss`` statistics, ``learning_rate``, ``grad_norm`` (None where the backend reports none) and
        ``nonfinite_steps``.

        A step whose gradient norm is not finite (a non-finite loss makes it so) is not applied: its
        gradients are dropped (DeepSpeed does the same inside its step). ``stop_requested`` is this process's
        signal flag; the returned ``stop_requested`` is the sum over processes, so all stop together."""
        acc = self.accelerator
        counts = self.batch_counts(batches)
        # this process's input tokens, without and with padding (summed over processes with the statistics)
        local_input_tokens = float(sum(batch.num_input_tokens for batch in batches))
        local_padded_tokens = float(sum(batch.num_padded_tokens for batch in batches))
        # accelerator.backward divides by the configured accumulation steps (whatever len(batches) is) and
        # DDP/DeepSpeed average over processes; our losses are already normalized by global counts, so undo both.
        scale = acc.num_processes * self.args.gradient_accumulation_steps
        loss_sum = torch.zeros((), device=acc.device)
        step_stats = StepStats(acc.device)
        grad_norm = None
        for index, batch in enumerate(batches):
            last = index == len(batches) - 1  # gradients are synced across processes in its backward
            with dist.accumulating(acc, self.model_wrapped, sync=last), dist.explained_ddp_errors():
                loss, stats = self.compute_loss(self.model_wrapped, batch, counts)
                acc.backward(loss * scale)
                loss_sum += loss.detach().float()
                step_stats.add(stats)
                if last:
                    norm = self._clip_gradients()
                    grad_norm = None if norm is None else float(norm)
                    self.callback_handler.fire("pre_optimizer_step")
                    step_unless_nonfinite(self.optimizer, grad_norm)  # fp16's scaler steps (and skips) itself
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

    def batch_counts(self, batches: list[MicroBatch]) -> BatchCounts:
        """What one optimizer step's losses are normalized by (``compute_loss``'s ``counts``): the loss tokens and
        sequences of its micro-batches ``batches``, summed over them and over the processes (a collective: every
        process calls it), and how many micro-batches the step has in all."""
        acc = self.accelerator
        local = torch.zeros(2, device=acc.device)
        for batch in batches:
            mask = batch.loss_mask  # [B, T]
            local[0] += mask.sum()
            local[1] += (mask.sum(-1) > 0).sum()
        tokens, sequences = dist.all_reduce_sum(acc, local).tolist()
        return BatchCounts(tokens=tokens, sequences=sequences, micro_batches=acc.num_processes * len(batches))

    def _clip_gradients(self):
        max_norm = self.args.max_grad_norm or float("inf")
        params = [p for p in self.model.parameters() if p.requires_grad]
        return self.accelerator.clip_grad_norm_(params, max_norm)


def gpu_peak_gb(accelerator) -> float:
    """The most GPU memory torch's allocator held during the step just done, in GiB, the largest over the
    processes (one small all-reduce per step); the peak is reset for the next step. CUDA only: on CPU the run logs
    no memory (the planner's calibration measures peak RSS from outside, benchmarks/memory_job.py)."""
    device = accelerator.device
    peak = torch.tensor([float(torch.cuda.max_memory_allocated(device))], device=device)
    torch.cuda.reset_peak_memory_stats(device)
    return float(dist.all_reduce_max(accelerator, peak)) / 2**30
