"""Training configurations: dataclasses with TRL's field names, validated at construction.

Every field carries its help text in ``metadata["help"]``; the CLI's ``--help`` and ``docs/config-reference.md`` are
generated from it. Errors name the field and what would be valid.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import os
from dataclasses import dataclass, field
from typing import Any

from trainers._trl_options import TRL_ONLY_OPTIONS
from trainers.errors import ConfigError
from trainers.logs import LOG_LEVELS
from trainers.schedules import check_scheduler_kwargs


def opt(default: Any, help: str) -> Any:
    """A dataclass field with a default and a help text (mutable defaults are copied per instance)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


# transformers' schedules, except the two stepped by an evaluation metric (reduce_lr_on_plateau, greedy)
LR_SCHEDULER_TYPES = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
                      "inverse_sqrt", "cosine_with_min_lr", "cosine_warmup_with_min_lr", "warmup_stable_decay")
STRATEGIES = ("no", "steps", "epoch")
SAVE_STRATEGIES = STRATEGIES + ("best",)
TOKEN_COUNTS = ("no", "all", "non_padding")
OPTIMIZERS = ("adamw_torch", "adamw_torch_fused")
SAMPLING_STRATEGIES = ("random", "sequential", "group_by_length")
DDP_BACKENDS = ("nccl", "gloo", "mpi", "xccl", "hccl", "cncl", "mccl")  # transformers' choices


def tf32_available() -> bool:
    """Whether TF32 can be switched on here (transformers' test: an Ampere or newer CUDA GPU)."""
    from transformers.utils import is_torch_tf32_available

    return is_torch_tf32_available()


def reject_unknown_options(cls):
    """Wrap a config's ``__init__`` so an unknown option gets a clear error instead of a bare ``TypeError``.

    A TRL option we do not implement is accepted only at TRL's default value (it then changes nothing);
    any other value is refused with a message that says so.
    """
    dataclass_init = cls.__init__
    known_fields = {f.name for f in dataclasses.fields(cls)}

    def __init__(self, *args, **kwargs):
        for name in list(kwargs):
            if name in known_fields:
                continue
            if name in TRL_ONLY_OPTIONS:
                _check_trl_only(cls.__name__, name, kwargs.pop(name))
                continue  # TRL's default: it changes nothing, so accepting it loses nothing.
            close = difflib.get_close_matches(name, sorted(known_fields), n=3)
            hint = f" Did you mean {', '.join('`' + c + '`' for c in close)}?" if close else ""
            raise ConfigError(f"{cls.__name__} has no option `{name}`.{hint}")
        dataclass_init(self, *args, **kwargs)

    def __getattr__(self, name):
        # Only reached when normal lookup fails: a TRL-only option reads as TRL's default, so a TRL script's
        # `if training_args.push_to_hub:` works unchanged.
        if name in TRL_ONLY_OPTIONS:
            return copy.deepcopy(TRL_ONLY_OPTIONS[name])
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __setattr__(self, name, value):
        if name in TRL_ONLY_OPTIONS and name not in known_fields:
            _check_trl_only(type(self).__name__, name, value)
            return  # setting TRL's default changes nothing
        object.__setattr__(self, name, value)

    __init__.__doc__ = dataclass_init.__doc__
    __init__.__signature__ = __import__("inspect").signature(dataclass_init)
    cls.__init__ = __init__
    cls.__getattr__ = __getattr__
    cls.__setattr__ = __setattr__
    return cls


def _check_trl_only(config_name: str, name: str, value: Any) -> None:
    """A TRL option this project does not implement: its TRL default is accepted, any other value refused."""
    trl_default = TRL_ONLY_OPTIONS[name]
    if value == trl_default or (value is None and trl_default is None):
        return
    raise ConfigError(
        f"{config_name}: `{name}={value!r}` is a TRL option that this project does not support "
        f"(only its default {trl_default!r} is accepted). Remove it; docs/migrating-from-trl.md lists "
        f"what is supported."
    )


_TYPES = {"int": int, "float": (int, float), "bool": bool, "str": str, "dict": dict, "None": type(None)}


def _matches(value: Any, annotation: str) -> bool:
    """Whether ``value`` fits a field annotation written as a string ("int | None", "list[float] | None", ...)."""
    for part in (p.strip() for p in annotation.split("|")):
        if part.startswith("list[") and isinstance(value, (list, tuple)):
            inner = part[5:-1]
            if all(_matches(item, inner) for item in value):
                return True
            continue
        expected = _TYPES.get(part)
        if expected is None:
            return True  # an annotation this check does not know: do not judge
        if isinstance(value, bool) and part in ("int", "float"):
            continue  # True is an int to Python, not to a user
        if isinstance(value, expected):
            return True
    return False


def _check_types(config) -> None:
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if not _matches(value, str(f.type)):
            raise ConfigError(f"{type(config).__name__}: `{f.name}={value!r}` is a {type(value).__name__}; "
                              f"expected {f.type}.")


def check_field(condition: bool, cls_name: str, name: str, value: Any, valid: str) -> None:
    if not condition:
        raise ConfigError(f"{cls_name}: `{name}={value!r}` is invalid; {valid}.")


@reject_unknown_options
@dataclass
class TrainingConfig:
    """Options shared by every trainer: batch sizes, optimizer, schedule, logging, evaluation and saving."""

    output_dir: str = opt("trainer_output", "Where checkpoints, metrics.jsonl and the final model are written.")
    per_device_train_batch_size: int = opt(
        8, "Training samples per process per micro-step (for GRPO: completions, not prompts)."
    )
    per_device_eval_batch_size: int = opt(8, "Evaluation samples per process per forward pass.")
    gradient_accumulation_steps: int = opt(
        1, "Micro-steps whose gradients are summed before one optimizer step. The effective batch size is "
        "per_device_train_batch_size x processes x gradient_accumulation_steps."
    )
    learning_rate: float = opt(5e-5, "Peak learning rate of AdamW.")
    weight_decay: float = opt(0.0, "AdamW decoupled weight decay.")
    adam_beta1: float = opt(0.9, "AdamW beta1.")
    adam_beta2: float = opt(0.999, "AdamW beta2.")
    adam_epsilon: float = opt(1e-8, "AdamW epsilon.")
    optim: str = opt("adamw_torch_fused", f"Optimizer: one of {OPTIMIZERS} (both are torch AdamW).")
    max_grad_norm: float | None = opt(1.0, "Clip the global gradient norm to this value; 0 or None disables clipping.")
    num_train_epochs: float = opt(3.0, "Passes over the training data (ignored when max_steps > 0).")
    max_steps: int = opt(-1, "Total optimizer steps; overrides num_train_epochs when > 0.")
    lr_scheduler_type: str = opt(
        "linear", f"Learning-rate schedule, transformers' own (the warm-up's first step runs at lr 0; 'constant' "
        f"ignores warm-up): one of {LR_SCHEDULER_TYPES}."
    )
    lr_scheduler_kwargs: dict | None = opt(
        None, "Extra arguments of the schedule, as in transformers: e.g. {'min_lr_rate': 0.1} for "
        "cosine_with_min_lr, {'num_cycles': 2} for cosine_with_restarts, {'num_decay_steps': 100} for "
        "warmup_stable_decay."
    )
    warmup_steps: float = opt(0, "Linear warmup length in optimizer steps; a value below 1 is a fraction of all steps.")
    warmup_ratio: float = opt(0.0, "Linear warmup as a fraction of all steps (used when warmup_steps is 0).")
    logging_strategy: str = opt(
        "steps", f"When to log metrics: one of {STRATEGIES}. 'steps': every logging_steps and at the last step; "
        "'epoch': at the end of each epoch and at the last step; 'no': never (logging_first_step still logs step 1)."
    )
    logging_steps: int = opt(10, "Log metrics every this many optimizer steps (logging_strategy='steps').")
    logging_nan_inf_filter: bool = opt(
        True, "Leave a non-finite step's loss out of the logged loss and train()'s training_loss (the step itself is "
        "skipped either way, and counted in nonfinite_steps)."
    )
    log_level: str = opt(
        "passive", f"Level of this project's and transformers' loggers on the main process: one of {LOG_LEVELS}; "
        "'passive' leaves them as they are."
    )
    log_level_replica: str = opt("warning", "log_level for the other processes.")
    logging_first_step: bool = opt(
        True, "Also log the first step (TRL's default is False; here the first loss is shown unless you turn it off).")
    eval_strategy: str = opt("no", f"When to evaluate on eval_dataset: one of {STRATEGIES}.")
    eval_on_start: bool = opt(
        False, "Evaluate once before the first training step (a check of the set-up), as transformers does.")
    eval_steps: int | None = opt(None, "Evaluate every this many steps (eval_strategy='steps'); defaults to logging_steps.")
    eval_delay: float = opt(0, "Skip evaluations before this many steps (eval_strategy='steps') or epochs ('epoch').")
    save_strategy: str = opt(
        "steps", f"When to write a checkpoint: one of {SAVE_STRATEGIES}; 'best' writes one after each evaluation "
        "that improves metric_for_best_model."
    )
    save_steps: int = opt(500, "Write a checkpoint every this many steps (save_strategy='steps').")
    save_total_limit: int | None = opt(
        None, "Keep at most this many checkpoints; the oldest are removed first, never the newest one nor the best "
        "(when metric_for_best_model is set)."
    )
    save_only_model: bool = opt(
        False, "Checkpoints hold only the model, in Hugging Face format (from_pretrained loads them): no optimizer, "
        "schedule or RNG state, so training cannot resume from them. A checkpoint written on a stop signal or "
        "after non-finite steps is always whole."
    )
    metric_for_best_model: str | None = opt(
        None, "Evaluation metric that ranks checkpoints (with or without the 'eval_' prefix, e.g. 'loss', "
        "'reward'); the best checkpoint is kept through rotation. Defaults to 'loss' with load_best_model_at_end."
    )
    greater_is_better: bool | None = opt(
        None, "Whether a higher metric_for_best_model is better; defaults to False for names ending in 'loss', "
        "else True."
    )
    load_best_model_at_end: bool = opt(
        False, "After the last step, load the best checkpoint by metric_for_best_model. Needs eval_strategy and "
        "save_strategy to match (save_steps a multiple of eval_steps), or save_strategy='best'."
    )
    include_num_input_tokens_seen: str | bool = opt(
        "no", f"Log num_input_tokens_seen, the input tokens trained on so far over all processes: one of "
        f"{TOKEN_COUNTS} ('all' counts padding too; True means 'all', False 'no')."
    )
    seed: int = opt(42, "Seed for model init, data order and sampling.")
    data_seed: int | None = opt(None, "Seed for the data order alone; None uses seed.")
    bf16: bool | None = opt(
        None, "Train in bfloat16 mixed precision. None follows the launch config (accelerate's mixed_precision)."
    )
    fp16: bool = opt(False, "Train in float16 mixed precision.")
    gradient_checkpointing: bool = opt(False, "Recompute activations in backward to save memory (slower).")
    gradient_checkpointing_kwargs: dict | None = opt(
        None, "Keyword arguments for torch.utils.checkpoint.checkpoint (default {'use_reentrant': False}), plus "
        "transformers' 'every_n_layers' (checkpoint every n-th decoder layer only) and 'offload' (GPU only: keep "
        "the saved activations in host memory)."
    )
    activation_checkpointing: bool | None = opt(
        None, "transformers 5's name for gradient_checkpointing: either may be given (if both, they must agree)."
    )
    activation_checkpointing_kwargs: dict | None = opt(
        None, "transformers 5's name for gradient_checkpointing_kwargs (if both are given, they must agree)."
    )
    report_to: str | list[str] = opt(
        "none", "Trackers to log to: 'none', 'all', or names such as 'tensorboard', 'wandb'. metrics.jsonl is always written."
    )
    run_name: str | None = opt(None, "A name for this run, shown by trackers.")
    disable_tqdm: bool = opt(False, "Hide the progress bar.")
    model_init_kwargs: dict | None = opt(
        None, "Keyword arguments for from_pretrained when `model` is a path (e.g. {'dtype': 'bfloat16'}); dtype defaults to float32."
    )
    trust_remote_code: bool = opt(False, "Allow custom modelling code from the model folder.")
    router_aux_loss_coef: float | None = opt(
        None, "Weight of a Mixture-of-Experts model's router load-balancing loss, added to the training loss. None "
        "takes the model config's; 0 turns it off. An error with a model that has no router."
    )
    train_sampling_strategy: str = opt(
        "random", f"Training order: one of {SAMPLING_STRATEGIES}. 'random' reshuffles every epoch (unless "
        "shuffle_dataset=False), 'sequential' keeps the dataset order, 'group_by_length' puts rows of similar length "
        "in the same batch (transformers' mega-batches; less padding; GRPO: by prompt length)."
    )
    shuffle_dataset: bool = opt(True, "Reshuffle the training rows every epoch (seeded, identical on every process).")
    remove_unused_columns: bool = opt(True, "Accepted for TRL compatibility; columns a trainer does not use are never fed to the model.")
    use_cpu: bool = opt(False, "Train on CPU even when a GPU is present.")
    resume_from_checkpoint: str | bool | None = opt(
        None, "A checkpoint folder to resume from, or True for the newest complete one in output_dir. TRL's "
        "scripts pass it to trainer.train(resume_from_checkpoint=...); train() called without that argument uses "
        "it too (transformers' Trainer ignores it there)."
    )
    do_train: bool = opt(False, "For your script, as in transformers: whether it should train. The trainer does not read it.")
    do_eval: bool = opt(
        False, "For your script, as in transformers: whether it should evaluate (set to True when eval_strategy "
        "is not 'no'). The trainer evaluates by eval_strategy."
    )
    do_predict: bool = opt(False, "For your script, as in transformers: whether it should predict. The trainer does not read it.")
    restore_callback_states_from_checkpoint: bool = opt(
        False, "On resume, rebuild the callbacks that keep a state (transformers' ExportableState, e.g. "
        "EarlyStoppingCallback's patience counter) from the checkpoint; checkpoints always hold those states."
    )
    local_rank: int = opt(
        -1, "The --local_rank that the deepspeed and torch.distributed.launch launchers pass to the script. Only "
        "checked: it must match the LOCAL_RANK the launcher sets; the process's place comes from the launcher."
    )
    torch_empty_cache_steps: int | None = opt(
        None, "Return the accelerator's cached memory to the device every this many steps (torch.cuda.empty_cache "
        "and the like; nothing on CPU): lower peak memory for a few percent of speed."
    )
    dataloader_drop_last: bool = opt(
        False, "Drop each epoch's last incomplete global batch (GRPO: its last incomplete generation round, which "
        "TRL always drops) instead of filling it up with rows from the start of the same epoch."
    )
    full_determinism: bool = opt(
        False, "Deterministic algorithms only (transformers' enable_full_determinism: "
        "torch.use_deterministic_algorithms, cuDNN deterministic, the CUDA variables it needs); slower."
    )
    tf32: bool | None = opt(
        None, "TF32 matmuls on an Ampere or newer GPU: True turns them on, False off, None leaves torch's "
        "setting. True without such a GPU is an error."
    )
    ddp_find_unused_parameters: bool | None = opt(
        None, "DistributedDataParallel's find_unused_parameters. None: False (DDP's faster default; transformers "
        "picks True unless gradient checkpointing is on). Set True when DDP reports parameters without gradients."
    )
    ddp_bucket_cap_mb: int | None = opt(None, "DistributedDataParallel's bucket_cap_mb (None: DDP's 25).")
    ddp_broadcast_buffers: bool | None = opt(
        None, "DistributedDataParallel's broadcast_buffers (None: DDP's True; GRPO's False, docs/distributed.md).")
    ddp_static_graph: bool | None = opt(None, "DistributedDataParallel's static_graph (None: DDP's False).")
    ddp_backend: str | None = opt(
        None, f"Process-group backend, one of {DDP_BACKENDS}. None: nccl on GPUs, gloo on CPU."
    )
    ddp_timeout: int = opt(1800, "Seconds a collective may wait for the other processes before failing.")
    max_consecutive_nonfinite_steps: int = opt(
        10, "Optimizer steps with a non-finite loss or gradient norm are skipped; after this many in a row, "
        "training stops with a checkpoint and an explanation."
    )

    def __post_init__(self):
        _check_types(self)
        name = type(self).__name__
        for f in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps",
                  "logging_steps", "save_steps", "max_consecutive_nonfinite_steps", "ddp_timeout"):
            value = getattr(self, f)
            check_field(isinstance(value, int) and not isinstance(value, bool) and value > 0, name, f, value,
                   "it must be a positive integer")
        check_field(isinstance(self.learning_rate, (int, float)) and not isinstance(self.learning_rate, bool)
               and self.learning_rate > 0
               and math.isfinite(self.learning_rate), name, "learning_rate", self.learning_rate,
               "it must be a positive number")
        check_field(self.weight_decay >= 0, name, "weight_decay", self.weight_decay, "it must be >= 0")
        for f in ("adam_beta1", "adam_beta2"):
            check_field(0 <= getattr(self, f) < 1, name, f, getattr(self, f), "it must be in [0, 1)")
        check_field(self.adam_epsilon > 0, name, "adam_epsilon", self.adam_epsilon, "it must be > 0")
        check_field(self.optim in OPTIMIZERS, name, "optim", self.optim, f"valid: {OPTIMIZERS}")
        check_field(self.max_grad_norm is None or self.max_grad_norm >= 0, name, "max_grad_norm", self.max_grad_norm,
               "it must be >= 0 (0 or None disables clipping)")
        check_field(math.isfinite(self.num_train_epochs) and (self.num_train_epochs > 0 or self.max_steps > 0), name, "num_train_epochs", self.num_train_epochs,
               "it must be > 0 unless max_steps > 0")
        check_field(isinstance(self.max_steps, int) and (self.max_steps > 0 or self.max_steps == -1), name, "max_steps",
               self.max_steps, "it must be a positive integer, or -1 to train for num_train_epochs")
        check_field(self.lr_scheduler_type in LR_SCHEDULER_TYPES, name, "lr_scheduler_type", self.lr_scheduler_type,
               f"valid: {LR_SCHEDULER_TYPES}")
        problem = check_scheduler_kwargs(self.lr_scheduler_type, self.lr_scheduler_kwargs or {})
        check_field(problem is None, name, "lr_scheduler_kwargs", self.lr_scheduler_kwargs, str(problem))
        check_field(self.warmup_steps >= 0, name, "warmup_steps", self.warmup_steps, "it must be >= 0")
        check_field(self.warmup_steps < 1 or float(self.warmup_steps).is_integer(), name, "warmup_steps",
               self.warmup_steps, "a value >= 1 counts steps and must be a whole number")
        check_field(0 <= self.warmup_ratio < 1, name, "warmup_ratio", self.warmup_ratio, "it must be in [0, 1)")
        check_field(not (self.warmup_steps and self.warmup_ratio), name, "warmup_ratio", self.warmup_ratio,
               "set warmup_steps or warmup_ratio, not both")
        for f in ("log_level", "log_level_replica"):
            check_field(getattr(self, f) in LOG_LEVELS, name, f, getattr(self, f), f"valid: {LOG_LEVELS}")
        check_field(self.train_sampling_strategy in SAMPLING_STRATEGIES, name, "train_sampling_strategy",
               self.train_sampling_strategy, f"valid: {SAMPLING_STRATEGIES} (transformers' 'batch_rebalance' is not "
               f"supported)")
        check_field(self.logging_strategy in STRATEGIES, name, "logging_strategy", self.logging_strategy,
               f"valid: {STRATEGIES}")
        check_field(self.eval_strategy in STRATEGIES, name, "eval_strategy", self.eval_strategy, f"valid: {STRATEGIES}")
        if isinstance(self.resume_from_checkpoint, str) and self.resume_from_checkpoint.lower() in ("true", "false"):
            self.resume_from_checkpoint = self.resume_from_checkpoint.lower() == "true" or None  # from a flag
        if self.eval_strategy != "no":
            self.do_eval = True  # transformers' rule, for scripts that read do_eval
        launcher_rank = os.environ.get("LOCAL_RANK")
        check_field(self.local_rank == -1 or launcher_rank is None or str(self.local_rank) == launcher_rank, name,
               "local_rank", self.local_rank, f"the launcher set LOCAL_RANK={launcher_rank} for this process")
        check_field(self.save_strategy in SAVE_STRATEGIES, name, "save_strategy", self.save_strategy,
               f"valid: {SAVE_STRATEGIES}")
        check_field(self.eval_steps is None or self.eval_steps > 0, name, "eval_steps", self.eval_steps,
               "it must be a positive integer")
        check_field(self.eval_delay >= 0, name, "eval_delay", self.eval_delay, "it must be >= 0")
        check_field(self.save_total_limit is None or self.save_total_limit > 0, name, "save_total_limit",
               self.save_total_limit, "it must be a positive integer or None")
        check_field(self.ddp_backend is None or self.ddp_backend in DDP_BACKENDS, name, "ddp_backend", self.ddp_backend,
               f"valid: {DDP_BACKENDS} or None")
        check_field(not self.tf32 or tf32_available(), name, "tf32", self.tf32,
               "TF32 needs an Ampere or newer NVIDIA GPU, and none is visible here; leave tf32 at None")
        for f in ("torch_empty_cache_steps", "ddp_bucket_cap_mb"):
            value = getattr(self, f)
            check_field(value is None or value > 0, name, f, value, "it must be a positive integer or None")
        if isinstance(self.include_num_input_tokens_seen, bool):  # transformers' mapping
            self.include_num_input_tokens_seen = "all" if self.include_num_input_tokens_seen else "no"
        check_field(self.include_num_input_tokens_seen in TOKEN_COUNTS, name, "include_num_input_tokens_seen",
               self.include_num_input_tokens_seen, f"valid: {TOKEN_COUNTS}, True or False")
        self._check_best_model(name)
        # transformers 5 renamed gradient_checkpointing(_kwargs) to activation_checkpointing(_kwargs); the old
        # names still work there. Either is accepted; afterwards both hold the same value.
        for old, new in (("gradient_checkpointing", "activation_checkpointing"),
                         ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs")):
            given, before = getattr(self, new), getattr(self, old)
            if given is not None:
                check_field(before in (None, False) or before == given, name, new, given,
                       f"it disagrees with {old}={before!r}; give one of the two")
                setattr(self, old, given)
            setattr(self, new, getattr(self, old))
        check_field(not (self.bf16 and self.fp16), name, "fp16", self.fp16, "set bf16 or fp16, not both")
        check_field(self.router_aux_loss_coef is None or (self.router_aux_loss_coef >= 0
                                                     and math.isfinite(self.router_aux_loss_coef)),
               name, "router_aux_loss_coef", self.router_aux_loss_coef, "it must be a number >= 0, or None")
        # None meant "all" in transformers 4 and means "none" elsewhere: refused rather than guessed
        check_field(isinstance(self.report_to, (str, list, tuple)), name, "report_to", self.report_to,
               "give 'none', 'all', a tracker name or a list of names")
        reports = [self.report_to] if isinstance(self.report_to, str) else list(self.report_to)
        check_field(all(isinstance(r, str) for r in reports), name, "report_to", self.report_to,
               "give a tracker name or a list of names")

    @property
    def ddp_kwargs(self) -> dict:
        """The DistributedDataParallel keyword arguments this config sets (the ddp_* options not None)."""
        names = {"ddp_find_unused_parameters": "find_unused_parameters", "ddp_bucket_cap_mb": "bucket_cap_mb",
                 "ddp_broadcast_buffers": "broadcast_buffers", "ddp_static_graph": "static_graph"}
        return {kwarg: getattr(self, option) for option, kwarg in names.items() if getattr(self, option) is not None}

    def _check_best_model(self, name: str) -> None:
        """transformers' rules for metric_for_best_model, load_best_model_at_end and save_strategy='best', plus
        one of ours: a best checkpoint is only found by evaluating, so each needs an eval_strategy."""
        if self.load_best_model_at_end:
            check_field(self.eval_strategy != "no" and self.save_strategy != "no", name, "load_best_model_at_end", True,
                   "it needs evaluations and checkpoints: set eval_strategy and save_strategy ('steps' or 'epoch')")
            if self.save_strategy != "best":
                check_field(self.save_strategy == self.eval_strategy, name, "load_best_model_at_end", True,
                       f"save_strategy ({self.save_strategy!r}) must match eval_strategy ({self.eval_strategy!r}), "
                       f"or be 'best', so that every checkpoint has an evaluation")
                eval_steps = self.eval_steps or self.logging_steps
                check_field(self.save_strategy != "steps" or self.save_steps % eval_steps == 0, name, "save_steps",
                       self.save_steps, f"with load_best_model_at_end it must be a multiple of eval_steps ({eval_steps})")
            if self.metric_for_best_model is None:
                self.metric_for_best_model = "loss"
        if self.save_strategy == "best":
            check_field(self.metric_for_best_model is not None, name, "save_strategy", self.save_strategy,
                   "'best' needs metric_for_best_model (or load_best_model_at_end=True, which defaults it to 'loss')")
        if self.metric_for_best_model is not None:
            check_field(self.eval_strategy != "no", name, "metric_for_best_model", self.metric_for_best_model,
                   "checkpoints are ranked by evaluating: set eval_strategy to 'steps' or 'epoch'")
        if self.greater_is_better is None and self.metric_for_best_model is not None:
            self.greater_is_better = not self.metric_for_best_model.endswith("loss")

    @property
    def data_order_seed(self) -> int:
        """The seed of the data order: data_seed, or seed when it is None."""
        return self.seed if self.data_seed is None else self.data_seed

    @property
    def warmup_fraction(self) -> float | None:
        """Warmup as a fraction of all steps, when it was given as one."""
        if 0 < self.warmup_steps < 1:
            return float(self.warmup_steps)
        return self.warmup_ratio or None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
