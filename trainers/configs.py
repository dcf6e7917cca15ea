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
import warnings
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


def _reject_unknown_options(cls):
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


def _check(condition: bool, cls_name: str, name: str, value: Any, valid: str) -> None:
    if not condition:
        raise ConfigError(f"{cls_name}: `{name}={value!r}` is invalid; {valid}.")


@_reject_unknown_options
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
            _check(isinstance(value, int) and not isinstance(value, bool) and value > 0, name, f, value,
                   "it must be a positive integer")
        _check(isinstance(self.learning_rate, (int, float)) and not isinstance(self.learning_rate, bool)
               and self.learning_rate > 0
               and math.isfinite(self.learning_rate), name, "learning_rate", self.learning_rate,
               "it must be a positive number")
        _check(self.weight_decay >= 0, name, "weight_decay", self.weight_decay, "it must be >= 0")
        for f in ("adam_beta1", "adam_beta2"):
            _check(0 <= getattr(self, f) < 1, name, f, getattr(self, f), "it must be in [0, 1)")
        _check(self.adam_epsilon > 0, name, "adam_epsilon", self.adam_epsilon, "it must be > 0")
        _check(self.optim in OPTIMIZERS, name, "optim", self.optim, f"valid: {OPTIMIZERS}")
        _check(self.max_grad_norm is None or self.max_grad_norm >= 0, name, "max_grad_norm", self.max_grad_norm,
               "it must be >= 0 (0 or None disables clipping)")
        _check(math.isfinite(self.num_train_epochs) and (self.num_train_epochs > 0 or self.max_steps > 0), name, "num_train_epochs", self.num_train_epochs,
               "it must be > 0 unless max_steps > 0")
        _check(isinstance(self.max_steps, int) and (self.max_steps > 0 or self.max_steps == -1), name, "max_steps",
               self.max_steps, "it must be a positive integer, or -1 to train for num_train_epochs")
        _check(self.lr_scheduler_type in LR_SCHEDULER_TYPES, name, "lr_scheduler_type", self.lr_scheduler_type,
               f"valid: {LR_SCHEDULER_TYPES}")
        problem = check_scheduler_kwargs(self.lr_scheduler_type, self.lr_scheduler_kwargs or {})
        _check(problem is None, name, "lr_scheduler_kwargs", self.lr_scheduler_kwargs, str(problem))
        _check(self.warmup_steps >= 0, name, "warmup_steps", self.warmup_steps, "it must be >= 0")
        _check(self.warmup_steps < 1 or float(self.warmup_steps).is_integer(), name, "warmup_steps",
               self.warmup_steps, "a value >= 1 counts steps and must be a whole number")
        _check(0 <= self.warmup_ratio < 1, name, "warmup_ratio", self.warmup_ratio, "it must be in [0, 1)")
        _check(not (self.warmup_steps and self.warmup_ratio), name, "warmup_ratio", self.warmup_ratio,
               "set warmup_steps or warmup_ratio, not both")
        for f in ("log_level", "log_level_replica"):
            _check(getattr(self, f) in LOG_LEVELS, name, f, getattr(self, f), f"valid: {LOG_LEVELS}")
        _check(self.train_sampling_strategy in SAMPLING_STRATEGIES, name, "train_sampling_strategy",
               self.train_sampling_strategy, f"valid: {SAMPLING_STRATEGIES} (transformers' 'batch_rebalance' is not "
               f"supported)")
        _check(self.logging_strategy in STRATEGIES, name, "logging_strategy", self.logging_strategy,
               f"valid: {STRATEGIES}")
        _check(self.eval_strategy in STRATEGIES, name, "eval_strategy", self.eval_strategy, f"valid: {STRATEGIES}")
        if isinstance(self.resume_from_checkpoint, str) and self.resume_from_checkpoint.lower() in ("true", "false"):
            self.resume_from_checkpoint = self.resume_from_checkpoint.lower() == "true" or None  # from a flag
        if self.eval_strategy != "no":
            self.do_eval = True  # transformers' rule, for scripts that read do_eval
        launcher_rank = os.environ.get("LOCAL_RANK")
        _check(self.local_rank == -1 or launcher_rank is None or str(self.local_rank) == launcher_rank, name,
               "local_rank", self.local_rank, f"the launcher set LOCAL_RANK={launcher_rank} for this process")
        _check(self.save_strategy in SAVE_STRATEGIES, name, "save_strategy", self.save_strategy,
               f"valid: {SAVE_STRATEGIES}")
        _check(self.eval_steps is None or self.eval_steps > 0, name, "eval_steps", self.eval_steps,
               "it must be a positive integer")
        _check(self.eval_delay >= 0, name, "eval_delay", self.eval_delay, "it must be >= 0")
        _check(self.save_total_limit is None or self.save_total_limit > 0, name, "save_total_limit",
               self.save_total_limit, "it must be a positive integer or None")
        _check(self.ddp_backend is None or self.ddp_backend in DDP_BACKENDS, name, "ddp_backend", self.ddp_backend,
               f"valid: {DDP_BACKENDS} or None")
        _check(not self.tf32 or tf32_available(), name, "tf32", self.tf32,
               "TF32 needs an Ampere or newer NVIDIA GPU, and none is visible here; leave tf32 at None")
        for f in ("torch_empty_cache_steps", "ddp_bucket_cap_mb"):
            value = getattr(self, f)
            _check(value is None or value > 0, name, f, value, "it must be a positive integer or None")
        if isinstance(self.include_num_input_tokens_seen, bool):  # transformers' mapping
            self.include_num_input_tokens_seen = "all" if self.include_num_input_tokens_seen else "no"
        _check(self.include_num_input_tokens_seen in TOKEN_COUNTS, name, "include_num_input_tokens_seen",
               self.include_num_input_tokens_seen, f"valid: {TOKEN_COUNTS}, True or False")
        self._check_best_model(name)
        # transformers 5 renamed gradient_checkpointing(_kwargs) to activation_checkpointing(_kwargs); the old
        # names still work there. Either is accepted; afterwards both hold the same value.
        for old, new in (("gradient_checkpointing", "activation_checkpointing"),
                         ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs")):
            given, before = getattr(self, new), getattr(self, old)
            if given is not None:
                _check(before in (None, False) or before == given, name, new, given,
                       f"it disagrees with {old}={before!r}; give one of the two")
                setattr(self, old, given)
            setattr(self, new, getattr(self, old))
        _check(not (self.bf16 and self.fp16), name, "fp16", self.fp16, "set bf16 or fp16, not both")
        _check(self.router_aux_loss_coef is None or (self.router_aux_loss_coef >= 0
                                                     and math.isfinite(self.router_aux_loss_coef)),
               name, "router_aux_loss_coef", self.router_aux_loss_coef, "it must be a number >= 0, or None")
        # None meant "all" in transformers 4 and means "none" elsewhere: refused rather than guessed
        _check(isinstance(self.report_to, (str, list, tuple)), name, "report_to", self.report_to,
               "give 'none', 'all', a tracker name or a list of names")
        reports = [self.report_to] if isinstance(self.report_to, str) else list(self.report_to)
        _check(all(isinstance(r, str) for r in reports), name, "report_to", self.report_to,
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
            _check(self.eval_strategy != "no" and self.save_strategy != "no", name, "load_best_model_at_end", True,
                   "it needs evaluations and checkpoints: set eval_strategy and save_strategy ('steps' or 'epoch')")
            if self.save_strategy != "best":
                _check(self.save_strategy == self.eval_strategy, name, "load_best_model_at_end", True,
                       f"save_strategy ({self.save_strategy!r}) must match eval_strategy ({self.eval_strategy!r}), "
                       f"or be 'best', so that every checkpoint has an evaluation")
                eval_steps = self.eval_steps or self.logging_steps
                _check(self.save_strategy != "steps" or self.save_steps % eval_steps == 0, name, "save_steps",
                       self.save_steps, f"with load_best_model_at_end it must be a multiple of eval_steps ({eval_steps})")
            if self.metric_for_best_model is None:
                self.metric_for_best_model = "loss"
        if self.save_strategy == "best":
            _check(self.metric_for_best_model is not None, name, "save_strategy", self.save_strategy,
                   "'best' needs metric_for_best_model (or load_best_model_at_end=True, which defaults it to 'loss')")
        if self.metric_for_best_model is not None:
            _check(self.eval_strategy != "no", name, "metric_for_best_model", self.metric_for_best_model,
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


SFT_LOSS_TYPES = ("nll",)
TRUNCATION_MODES = ("keep_start", "keep_end")


@_reject_unknown_options
@dataclass
class SFTConfig(TrainingConfig):
    """Supervised fine-tuning: how rows become token sequences and which tokens carry the loss."""

    learning_rate: float = opt(2e-5, "Peak learning rate of AdamW.")
    dataset_text_field: str = opt("text", "Column holding raw text for language modelling.")
    max_length: int | None = opt(1024, "Truncate every tokenized sample to this many tokens (None: no truncation).")
    truncation_mode: str = opt("keep_start", f"Which end of an over-long sample to keep: one of {TRUNCATION_MODES}.")
    packing: bool = opt(
        False, "Pack several samples into each row of max_length tokens (best-fit decreasing), padding-free, "
        "with no attention across samples."
    )
    packing_strategy: str = opt("bfd", "Packing algorithm: 'bfd' (best-fit decreasing).")
    eval_packing: bool | None = opt(
        None, "Pack eval_dataset as well (None: as packing). The loss is the same either way; packing changes "
        "the speed and memory of evaluation."
    )
    padding_free: bool = opt(False, "Concatenate a micro-batch into one row without padding (implied by packing).")
    pad_to_multiple_of: int | None = opt(None, "Pad each batch's length up to a multiple of this.")
    completion_only_loss: bool | None = opt(
        None, "For prompt/completion data, train on completion tokens only. None means True for such data."
    )
    assistant_only_loss: bool = opt(False, "For `messages` data, train on assistant turns only (any chat template).")
    eos_token: str | None = opt(None, "End-of-sequence token appended to samples; defaults to the tokenizer's.")
    pad_token: str | None = opt(None, "Padding token; defaults to the tokenizer's, then to its EOS token.")
    chat_template_path: str | None = opt(
        None, "A Jinja chat template file to use instead of the tokenizer's, or a tokenizer folder / Hub id whose "
        "template is cloned with the tokens it needs, its EOS and resized embeddings (TRL's clone_chat_template).")
    dataset_num_proc: int | None = opt(None, "Processes used to tokenize the dataset.")
    loss_type: str = opt("nll", f"Loss: one of {SFT_LOSS_TYPES} (token-level negative log-likelihood).")
    neftune_noise_alpha: float | None = opt(
        None, "NEFTune (arXiv:2310.05914): add uniform noise of scale alpha / sqrt(tokens x width) to the input "
        "embeddings of every training forward (not in evaluation), as transformers does. The paper uses 5."
    )
    # What the trainer's compute_metrics receives (transformers' evaluation options)
    prediction_loss_only: bool = opt(
        False, "Evaluate the loss and the token accuracy only: compute_metrics is not called and predict() returns "
        "no predictions."
    )
    include_for_metrics: list[str] = opt(
        [], "Also give compute_metrics the batches' 'inputs' (input ids) and/or 'loss' (each row's batch loss).")
    eval_do_concat_batches: bool = opt(
        True, "compute_metrics gets the batches concatenated into one array, padded with -100 (False: a list of them).")
    batch_eval_metrics: bool = opt(
        False, "Call compute_metrics on every evaluation batch, with compute_result=True on the last one (whose "
        "return is the metrics), instead of once on every prediction held in memory."
    )

    def __post_init__(self):
        super().__post_init__()
        name = type(self).__name__
        _check(self.neftune_noise_alpha is None or (self.neftune_noise_alpha > 0
                                                    and math.isfinite(self.neftune_noise_alpha)),
               name, "neftune_noise_alpha", self.neftune_noise_alpha, "it must be a positive number, or None")
        _check(self.max_length is None or (isinstance(self.max_length, int) and self.max_length > 0), name,
               "max_length", self.max_length, "it must be a positive integer or None")
        _check(not ((self.packing or self.eval_packing) and self.max_length is None), name, "max_length",
               self.max_length, "packing needs a max_length (the length of a packed row)")
        _check(self.truncation_mode in TRUNCATION_MODES, name, "truncation_mode", self.truncation_mode,
               f"valid: {TRUNCATION_MODES}")
        _check(self.packing_strategy == "bfd", name, "packing_strategy", self.packing_strategy, "valid: ('bfd',)")
        _check(self.loss_type in SFT_LOSS_TYPES, name, "loss_type", self.loss_type, f"valid: {SFT_LOSS_TYPES}")
        _check(self.pad_to_multiple_of is None or self.pad_to_multiple_of > 0, name, "pad_to_multiple_of",
               self.pad_to_multiple_of, "it must be a positive integer or None")
        _check(isinstance(self.include_for_metrics, list) and all(v in ("inputs", "loss")
                                                                  for v in self.include_for_metrics),
               name, "include_for_metrics", self.include_for_metrics, "it must be a list of 'inputs' and 'loss'")


GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
SCALE_REWARDS = ("group", "batch", "none")
MULTI_OBJECTIVE_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
IS_CORRECTION_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
GENERATION_ENGINES = ("auto", "lean", "hf")


@_reject_unknown_options
@dataclass
class GRPOConfig(TrainingConfig):
    """Group Relative Policy Optimization: generation, rewards, advantages and the clipped policy loss."""

    learning_rate: float = opt(1e-6, "Peak learning rate of AdamW.")
    remove_unused_columns: bool = opt(False, "Accepted for TRL compatibility; every dataset column reaches the reward functions.")
    num_generations: int = opt(8, "Completions sampled per prompt (the group size G); at least 2.")
    num_generations_eval: int | None = opt(None, "Completions sampled per eval prompt (default: num_generations).")
    max_completion_length: int = opt(512, "Maximum tokens generated per completion.")
    generation_batch_size: int | None = opt(
        None, "Completions generated per round over all processes. Default: per_device_train_batch_size x "
        "processes x steps_per_generation."
    )
    steps_per_generation: int | None = opt(
        None, "Micro-steps served by one generation round. Default: gradient_accumulation_steps."
    )
    num_iterations: int = opt(1, "Passes over each generation round (mu); > 1 reuses rollouts with old log-probs.")
    temperature: float = opt(1.0, "Sampling temperature.")
    top_p: float = opt(1.0, "Nucleus sampling: keep the smallest token set with this probability mass.")
    top_k: int | None = opt(0, "Keep only the k most likely tokens when sampling; 0 disables.")
    min_p: float | None = opt(None, "Drop tokens whose probability is below min_p x the top token's.")
    repetition_penalty: float = opt(1.0, "Penalty on tokens already in the prompt or completion (1.0: none).")
    generation_kwargs: dict | None = opt(None, "Extra keyword arguments for the generation call.")
    chat_template_kwargs: dict | None = opt(None, "Extra keyword arguments for apply_chat_template on prompts.")
    beta: float = opt(0.0, "Weight of the k3 KL penalty to the frozen reference model; 0 loads no reference model.")
    use_bias_correction_kl: bool = opt(
        True, "Multiply the per-token KL by the importance ratio (differentiable), which makes its gradient the "
        "unbiased reverse-KL gradient (DeepSeek-V3.2), as TRL does by default; False uses the plain k3 term."
    )
    sync_ref_model: bool = opt(
        False, "Move the reference model toward the policy every ref_model_sync_steps steps (TR-DPO, "
        "arXiv:2404.09656): ref = (1 - ref_model_mixup_alpha) x ref + ref_model_mixup_alpha x policy. Needs beta > 0 "
        "and a full (not PEFT) model."
    )
    ref_model_mixup_alpha: float = opt(0.6, "sync_ref_model: the policy's share in each update of the reference.")
    ref_model_sync_steps: int = opt(512, "sync_ref_model: update the reference after every this many steps.")
    epsilon: float = opt(0.2, "Lower clipping range of the importance ratio: 1 - epsilon.")
    epsilon_high: float | None = opt(
        None, "Upper clipping range: 1 + epsilon_high (DAPO clip-higher). Default: epsilon. With loss_type='cispo' "
        "it is the largest importance weight, ε_max (5.0 recommended)."
    )
    delta: float | None = opt(None, "Also clip the ratio from above at delta for negative advantages (two-sided GRPO).")
    importance_sampling_level: str = opt(
        "token", f"Importance ratio per 'token' (GRPO) or per 'sequence' (GSPO); one of {IMPORTANCE_SAMPLING_LEVELS}."
    )
    loss_type: str = opt(
        "dapo", f"The policy loss and how token losses are averaged: one of {GRPO_LOSS_TYPES} (docs/grpo.md)."
    )
    sapo_temperature_pos: float = opt(1.0, "loss_type='sapo': gate temperature for tokens with a positive advantage.")
    sapo_temperature_neg: float = opt(
        1.05, "loss_type='sapo': gate temperature for tokens with a zero or negative advantage."
    )
    vespo_k_pos: float = opt(2.0, "loss_type='vespo': power k of the Gamma weight where the advantage is >= 0.")
    vespo_lambda_pos: float = opt(3.0, "loss_type='vespo': decay lambda of the Gamma weight where the advantage is >= 0.")
    vespo_k_neg: float = opt(3.0, "loss_type='vespo': power k of the Gamma weight where the advantage is < 0.")
    vespo_lambda_neg: float = opt(2.0, "loss_type='vespo': decay lambda of the Gamma weight where the advantage is < 0.")
    top_entropy_quantile: float = opt(
        1.0, "Keep in the policy loss only the top-rho fraction of completion tokens by entropy (arXiv:2506.01939; "
        "the paper uses 0.2): the cut is the (1 - rho) quantile over every process's tokens of the micro-batch. "
        "1.0 keeps all; 0.0 only the highest-entropy token."
    )
    off_policy_mask_threshold: float | None = opt(
        None, "DeepSeek-V3.2's off-policy sequence mask: drop from the policy loss a completion with a negative "
        "advantage whose mean log pi_old - log pi exceeds this (e.g. 0.5). None disables."
    )
    entropy_coef: float = opt(
        0.0, "Entropy bonus: the loss subtracts entropy_coef x the mean entropy of each micro-batch's loss tokens "
        "(whatever loss_type), so that the policy keeps exploring. 0 disables; with use_adaptive_entropy, the "
        "starting value."
    )
    use_adaptive_entropy: bool = opt(
        False, "Adapt entropy_coef after every step (Skywork-OR1): up by entropy_coef_delta when the step's entropy "
        "was at or below entropy_target, down otherwise; the bonus applies only while entropy is at or below it."
    )
    entropy_coef_min: float = opt(0.0, "use_adaptive_entropy: the lowest entropy_coef.")
    entropy_coef_max: float = opt(1.0, "use_adaptive_entropy: the highest entropy_coef.")
    entropy_coef_delta: float = opt(0.005, "use_adaptive_entropy: how far entropy_coef moves per step.")
    entropy_target: float = opt(0.2, "use_adaptive_entropy: the entropy (nats per token) to hold.")
    scale_rewards: str = opt(
        "group", f"Divide advantages by the reward std of the 'group', the whole 'batch', or 'none'; one of {SCALE_REWARDS}."
    )
    multi_objective_aggregation: str = opt(
        "sum_then_normalize", "How several reward functions become one advantage: 'sum_then_normalize' (the "
        "weighted sum, then scale_rewards) or 'normalize_then_sum' (GDPO: each function normalized within its "
        "group, then the weighted sum normalized over the batch; scale_rewards is not used)."
    )
    reward_weights: list[float] | None = opt(None, "Weight of each reward function in the sum (default: all 1).")
    mask_truncated_completions: bool = opt(False, "Exclude completions that hit max_completion_length from the loss.")
    dynamic_sampling: bool = opt(
        False, "Drop groups whose rewards are all equal (zero advantage) from the loss, and log how many."
    )
    disable_dropout: bool = opt(False, "Set every dropout probability in the policy to 0.")
    skip_zero_gradient_rows: bool = opt(
        True, "Leave out of the backward the completions whose loss gradient is zero by construction: those "
        "without loss tokens (dynamic_sampling's dropped groups, mask_truncated_completions) are not forwarded "
        "at all, and, with beta=0 and no entropy bonus, those with advantage 0 (a group whose rewards are all "
        "equal) are forwarded without gradients, for the logged entropy. Same loss, gradients and metrics. Off "
        "under ZeRO-3 and FSDP (their forwards are collective) and with an MoE router loss. False trains every "
        "completion, as TRL does."
    )
    generation_engine: str = opt(
        "auto", f"How completions are sampled: one of {GENERATION_ENGINES}. 'lean' is this project's engine for "
        "Llama/Mistral/Qwen2/Qwen3 models (static KV cache, shared prompt prefill); 'hf' is transformers' generate; "
        "'auto' uses 'lean' where it applies."
    )
    ds3_gather_for_generation: bool = opt(
        True, "Under ZeRO-3, gather the full weights once for generation (fast); False generates layer by layer "
        "(slow, but never holds the whole model)."
    )
    log_completions: bool = opt(False, "Print a table of sampled completions at each logging step and append them to completions.jsonl.")
    num_completions_to_print: int | None = opt(None, "Rows of that table (default: all of one round).")
    use_vllm: bool = opt(False, "Not supported: generation uses the policy itself.")
    vllm_importance_sampling_correction: bool = opt(
        True, "When a rollout_func returns its sampler's logprobs, weight the loss by the importance ratio "
        "pi_old / pi_sampler (the trainer's log-probs against the sampler's, computed once per round), which "
        "corrects for another engine's numerics or a stale sampler; vllm_importance_sampling_mode says how. TRL "
        "applies it with use_vllm; here a rollout_func is the only other sampler. False: no correction."
    )
    vllm_importance_sampling_mode: str = opt(
        "sequence_mask", f"One of {IS_CORRECTION_MODES}: the ratio per 'token_*' or per completion ('sequence_*', "
        "the product over its model tokens); '*_truncate' clips it to [clip_min, clip_max], '*_mask' sets it "
        "to 0 outside (the token or completion leaves the loss)."
    )
    vllm_importance_sampling_clip_max: float | None = opt(
        3.0, "Upper bound C_max of that ratio (None: no upper bound)."
    )
    vllm_importance_sampling_clip_min: float | None = opt(
        None, "Lower bound C_min of that ratio (None: no lower bound)."
    )
    vllm_importance_sampling_cap: float | None = opt(
        None, "Deprecated in TRL: sets vllm_importance_sampling_clip_max (with a FutureWarning)."
    )

    def __post_init__(self):
        if isinstance(self.scale_rewards, bool):  # TRL accepts booleans: True -> "group", False -> "none".
            self.scale_rewards = "group" if self.scale_rewards else "none"
        super().__post_init__()
        name = type(self).__name__
        _check(self.metric_for_best_model not in ("loss", "eval_loss"), name, "metric_for_best_model",
               self.metric_for_best_model, "GRPO evaluation measures rewards, not a loss: give 'reward' or "
               "'rewards/<function>/mean' (load_best_model_at_end defaults it to 'loss')")
        _check(isinstance(self.num_generations, int) and self.num_generations >= 2, name, "num_generations",
               self.num_generations, "GRPO compares completions within a group, so it needs at least 2")
        _check(self.num_generations_eval is None or (isinstance(self.num_generations_eval, int)
                                                      and self.num_generations_eval >= 1),
               name, "num_generations_eval", self.num_generations_eval, "it must be a positive integer or None")
        _check(isinstance(self.max_completion_length, int) and self.max_completion_length > 0, name,
               "max_completion_length", self.max_completion_length, "it must be a positive integer")
        _check(isinstance(self.num_iterations, int) and self.num_iterations > 0, name, "num_iterations",
               self.num_iterations, "it must be a positive integer")
        _check(self.temperature > 0, name, "temperature", self.temperature, "it must be > 0")
        _check(0 < self.top_p <= 1, name, "top_p", self.top_p, "it must be in (0, 1]")
        _check(self.top_k is None or self.top_k >= 0, name, "top_k", self.top_k, "it must be >= 0 (0 disables)")
        _check(self.beta >= 0, name, "beta", self.beta, "it must be >= 0")
        _check(not self.sync_ref_model or self.beta > 0, name, "sync_ref_model", self.sync_ref_model,
               "with beta=0 there is no reference model to synchronize: set beta > 0, or leave it False")
        _check(0 <= self.ref_model_mixup_alpha <= 1, name, "ref_model_mixup_alpha", self.ref_model_mixup_alpha,
               "it must be in [0, 1]")
        _check(isinstance(self.ref_model_sync_steps, int) and self.ref_model_sync_steps > 0, name,
               "ref_model_sync_steps", self.ref_model_sync_steps, "it must be a positive integer")
        _check(self.epsilon > 0, name, "epsilon", self.epsilon, "it must be > 0")
        _check(self.epsilon_high is None or self.epsilon_high > 0, name, "epsilon_high", self.epsilon_high,
               "it must be > 0")
        _check(self.delta is None or self.delta > 1, name, "delta", self.delta, "it must be > 1")
        _check(self.loss_type in GRPO_LOSS_TYPES, name, "loss_type", self.loss_type, f"valid: {GRPO_LOSS_TYPES}")
        for f in ("sapo_temperature_pos", "sapo_temperature_neg"):
            _check(getattr(self, f) > 0, name, f, getattr(self, f), "it must be > 0")
        for f in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"):
            _check(0 <= getattr(self, f) < math.inf, name, f, getattr(self, f), "it must be a finite number >= 0")
        _check(0 <= self.top_entropy_quantile <= 1, name, "top_entropy_quantile", self.top_entropy_quantile,
               "it must be in [0, 1] (1 keeps every token)")
        _check(self.off_policy_mask_threshold is None or (self.off_policy_mask_threshold >= 0
                                                          and math.isfinite(self.off_policy_mask_threshold)),
               name, "off_policy_mask_threshold", self.off_policy_mask_threshold, "it must be a number >= 0, or None")
        for f in ("entropy_coef", "entropy_coef_min", "entropy_coef_max", "entropy_coef_delta", "entropy_target"):
            _check(math.isfinite(getattr(self, f)), name, f, getattr(self, f), "it must be a finite number")
        _check(self.entropy_coef_min <= self.entropy_coef_max, name, "entropy_coef_min", self.entropy_coef_min,
               f"it must be <= entropy_coef_max ({self.entropy_coef_max})")
        _check(self.entropy_coef_delta >= 0 and self.entropy_target >= 0, name, "entropy_coef_delta",
               self.entropy_coef_delta, f"it and entropy_target ({self.entropy_target}) must be >= 0")
        _check(self.scale_rewards in SCALE_REWARDS, name, "scale_rewards", self.scale_rewards,
               f"valid: {SCALE_REWARDS}")
        _check(self.multi_objective_aggregation in MULTI_OBJECTIVE_AGGREGATIONS, name, "multi_objective_aggregation",
               self.multi_objective_aggregation, f"valid: {MULTI_OBJECTIVE_AGGREGATIONS}")
        _check(self.importance_sampling_level in IMPORTANCE_SAMPLING_LEVELS, name, "importance_sampling_level",
               self.importance_sampling_level, f"valid: {IMPORTANCE_SAMPLING_LEVELS}")
        _check(self.generation_engine in GENERATION_ENGINES, name, "generation_engine", self.generation_engine,
               f"valid: {GENERATION_ENGINES}")
        _check(not self.use_vllm, name, "use_vllm", self.use_vllm,
               "vLLM generation is not supported yet; completions come from the policy itself")
        for f in ("generation_batch_size", "steps_per_generation", "num_completions_to_print"):
            value = getattr(self, f)
            _check(value is None or (isinstance(value, int) and value > 0), name, f, value,
                   "it must be a positive integer or None")
        _check(self.generation_batch_size is None or self.steps_per_generation is None, name,
               "steps_per_generation", self.steps_per_generation,
               "set generation_batch_size or steps_per_generation, not both")
        _check(self.vllm_importance_sampling_mode in IS_CORRECTION_MODES, name, "vllm_importance_sampling_mode",
               self.vllm_importance_sampling_mode, f"valid: {IS_CORRECTION_MODES}")
        if self.vllm_importance_sampling_cap is not None:  # TRL's deprecated name
            warnings.warn("vllm_importance_sampling_cap is deprecated (as in TRL); use "
                          "vllm_importance_sampling_clip_max instead.", FutureWarning, stacklevel=3)
            self.vllm_importance_sampling_clip_max = self.vllm_importance_sampling_cap
        for f in ("vllm_importance_sampling_clip_min", "vllm_importance_sampling_clip_max"):
            value = getattr(self, f)
            _check(value is None or (value >= 0 and math.isfinite(value)), name, f, value,
                   "it must be a finite number >= 0, or None")
        low, high = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        _check(low is None or high is None or low < high, name, "vllm_importance_sampling_clip_min", low,
               f"it must be less than vllm_importance_sampling_clip_max ({high})")
        # Divisibility of the batch sizes by num_generations needs the process count: checked by the trainer.

    @property
    def clip_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high
