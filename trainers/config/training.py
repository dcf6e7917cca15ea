"""Training configurations: dataclasses with TRL's field names, validated at construction.

Every field is declared with ``opt(default, help, <constraints>)`` (trainers/config/options.py): the help text
(``metadata["help"]``) feeds the CLI's ``--help`` and ``docs/config-reference.md``; the constraints (allowed values,
bounds) are checked for every field at construction and shown in the reference. Only rules relating several fields
are written by hand in ``__post_init__``. Errors name the field and what would be valid. This module holds
TrainingConfig, the options every trainer shares, and how transformers' values for them are taken in (a
TrainingArguments, accelerator_config, pad_to_multiple_of).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any

from trainers.errors import ConfigError
from trainers.logs import LOG_LEVELS
from trainers.config.options import check_constraints, check_field, check_types, opt, reject_unknown_options
from trainers.optim.schedules import check_scheduler_kwargs

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


def resolve_pad_to_multiple_of(value: Any, cls_name: str) -> Any:
    """TRL's pad_to_multiple_of values as an int or None: 'auto' (a multiple of 128 on AWS Neuron, which compiles
    once per input shape; no padding elsewhere, and this project runs elsewhere) -> None; text from a command line
    ('8', 'none', 'null') -> 8 or None. Other values are returned for the field's own checks."""
    if not isinstance(value, str):
        return value
    if value == "auto" or value.lower() in ("none", "null"):
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{cls_name}: `pad_to_multiple_of={value!r}` is invalid; it must be an int >= 1, "
                          f"'auto' or None.") from None


SECRET_FIELDS = ("hub_token", "vllm_server_api_key")  # masked by TrainingConfig.to_dict


def config_from_training_arguments(config_class: type, arguments) -> Any:
    """A transformers.TrainingArguments (or a subclass such as TRL's configs) as ``config_class``, as TRL's
    SFTTrainer converts one: every field through ``to_dict()``, so options this project does not take are refused
    by name, as they would be given directly."""
    fields = arguments.to_dict()
    fields["hub_token"] = arguments.hub_token  # to_dict masks it
    try:
        return config_class(**fields)
    except ConfigError as error:
        raise ConfigError(f"args: the {type(arguments).__name__} given was converted to {config_class.__name__}, "
                          f"which refuses it: {error}") from None


# transformers' AcceleratorConfig keys and their defaults. Batches here are not DataLoaders: every process computes
# its own rows of each global batch from one seeded order, so only the keys below that describe such batches apply.
ACCELERATOR_CONFIG_DEFAULTS = {"split_batches": False, "dispatch_batches": None, "even_batches": True,
                               "use_seedable_sampler": True, "non_blocking": False,
                               "gradient_accumulation_kwargs": None, "use_configured_state": False}
# The keys accepted only at their default, and why
ACCELERATOR_CONFIG_FIXED = {
    "even_batches": "batches are always even here: the last global batch of an epoch is filled up with rows from the "
                    "start of the epoch (dataloader_drop_last=True drops it instead)",
    "use_seedable_sampler": "the data order is always a function of the seed (data_seed or seed)",
    "non_blocking": "batches are built on each process and copied to its device directly",
    "gradient_accumulation_kwargs": "set gradient_accumulation_steps instead",
    "use_configured_state": "the trainer builds its Accelerator from the launch configuration",
}


def accelerator_config_dict(value: Any, config_name: str) -> dict | None:
    """transformers' accelerator_config (None, a dict, a JSON file's path, or an AcceleratorConfig) as a dict of the
    keys given, checked: an unknown key, a wrong type, or a key that applies only at its default is an error."""
    option = f"{config_name}: accelerator_config"
    if value is None:
        return None
    if isinstance(value, str):
        if not os.path.isfile(value):
            raise ConfigError(f"{option}={value!r}: no such JSON file.")
        with open(value, encoding="utf-8") as f:
            try:
                value = json.load(f)
            except json.JSONDecodeError as error:
                raise ConfigError(f"{option}={value!r} is not valid JSON: {error}.") from None
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):  # transformers' AcceleratorConfig
        value = dataclasses.asdict(value)
    if not isinstance(value, dict):
        raise ConfigError(f"{option} must be a dict, a JSON file's path or an AcceleratorConfig, got "
                          f"{type(value).__name__}.")
    for key, given in value.items():
        if key not in ACCELERATOR_CONFIG_DEFAULTS:
            raise ConfigError(f"{option} has no key {key!r}; transformers' keys are {sorted(ACCELERATOR_CONFIG_DEFAULTS)}.")
        if key in ("split_batches", "dispatch_batches"):
            if not (isinstance(given, bool) or (given is None and key == "dispatch_batches")):
                raise ConfigError(f"{option}[{key!r}]={given!r} must be True or False.")
        elif given != ACCELERATOR_CONFIG_DEFAULTS[key] and not (key == "gradient_accumulation_kwargs" and given == {}):
            raise ConfigError(f"{option}[{key!r}]={given!r} is not supported (only transformers' default "
                              f"{ACCELERATOR_CONFIG_DEFAULTS[key]!r}): {ACCELERATOR_CONFIG_FIXED[key]}.")
    return dict(value)


@reject_unknown_options
@dataclass
class TrainingConfig:
    """Options shared by every trainer: batch sizes, optimizer, schedule, logging, evaluation and saving."""

    output_dir: str = opt("trainer_output", "Where checkpoints, metrics.jsonl and the final model are written.")
    # Batches
    per_device_train_batch_size: int = opt(
        8, "Training samples per process per micro-step (for GRPO: completions, not prompts).", ge=1
    )
    per_device_eval_batch_size: int = opt(8, "Evaluation samples per process per forward pass.", ge=1)
    gradient_accumulation_steps: int = opt(
        1, "Micro-steps whose gradients are summed before one optimizer step. The effective batch size is "
        "per_device_train_batch_size x processes x gradient_accumulation_steps.", ge=1
    )
    # Optimizer and schedule
    learning_rate: float = opt(5e-5, "Peak learning rate of AdamW.", ge=0, finite=True)
    weight_decay: float = opt(0.0, "AdamW decoupled weight decay.", ge=0)
    adam_beta1: float = opt(0.9, "AdamW beta1.", ge=0, lt=1)
    adam_beta2: float = opt(0.999, "AdamW beta2.", ge=0, lt=1)
    adam_epsilon: float = opt(1e-8, "AdamW epsilon.", gt=0)
    optim: str = opt("adamw_torch_fused", "Optimizer (both are torch AdamW).", choices=OPTIMIZERS)
    max_grad_norm: float | None = opt(1.0, "Clip the global gradient norm to this value.", ge=0,
                                      note="0 or None disables clipping")
    num_train_epochs: float = opt(
        3.0, "Passes over the training data (ignored when max_steps > 0; must be > 0 otherwise).", finite=True)
    max_steps: int = opt(-1, "Total optimizer steps; overrides num_train_epochs when > 0.", choices=(-1,), ge=1,
                         note="-1 trains for num_train_epochs")
    lr_scheduler_type: str = opt(
        "linear", "Learning-rate schedule, transformers' own (the warm-up's first step runs at lr 0; 'constant' "
        "ignores warm-up).", choices=LR_SCHEDULER_TYPES
    )
    lr_scheduler_kwargs: dict | None = opt(
        None, "Extra arguments of the schedule, as in transformers: e.g. {'min_lr_rate': 0.1} for "
        "cosine_with_min_lr, {'num_cycles': 2} for cosine_with_restarts, {'num_decay_steps': 100} for "
        "warmup_stable_decay."
    )
    warmup_steps: float = opt(
        0, "Linear warmup length in optimizer steps (a whole number); a value below 1 is a fraction of all steps.",
        ge=0)
    warmup_ratio: float = opt(
        0.0, "Linear warmup as a fraction of all steps (used when warmup_steps is 0).", ge=0, lt=1)
    # Logging
    logging_strategy: str = opt(
        "steps", "When to log metrics. 'steps': every logging_steps (as transformers: the steps after the last "
        "multiple are in train()'s closing record); 'epoch': at the end of each epoch and at the last step; 'no': "
        "never (logging_first_step still logs step 1; train()'s closing record has the run's means).",
        choices=STRATEGIES
    )
    logging_steps: int = opt(10, "Log metrics every this many optimizer steps (logging_strategy='steps').", ge=1)
    logging_nan_inf_filter: bool = opt(
        True, "Leave a non-finite step's loss out of the logged loss and train()'s training_loss (the step itself is "
        "skipped either way, and counted in nonfinite_steps)."
    )
    log_level: str = opt(
        "passive", "Level of this project's and transformers' loggers on the main process; 'passive' leaves them "
        "as they are.", choices=LOG_LEVELS
    )
    log_level_replica: str = opt("warning", "log_level for the other processes.", choices=LOG_LEVELS)
    logging_first_step: bool = opt(False, "Also log the first step.")
    # Evaluation and checkpoints
    eval_strategy: str = opt("no", "When to evaluate on eval_dataset.", choices=STRATEGIES)
    eval_on_start: bool = opt(
        False, "Evaluate once before the first training step (a check of the set-up), as transformers does.")
    eval_steps: int | None = opt(
        None, "Evaluate every this many steps (eval_strategy='steps'); defaults to logging_steps.", ge=1)
    eval_delay: float = opt(
        0, "Skip evaluations before this many steps (eval_strategy='steps') or epochs ('epoch').", ge=0)
    save_strategy: str = opt(
        "steps", "When to write a checkpoint; 'best' writes one after each evaluation that improves "
        "metric_for_best_model.", choices=SAVE_STRATEGIES
    )
    save_steps: int = opt(500, "Write a checkpoint every this many steps (save_strategy='steps').", ge=1)
    save_total_limit: int | None = opt(
        None, "Keep at most this many checkpoints; the oldest are removed first, never the newest one nor the best "
        "(when metric_for_best_model is set).", ge=1
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
        "no", "Log num_input_tokens_seen, the input tokens trained on so far over all processes ('all' counts "
        "padding too).", choices=TOKEN_COUNTS, note="True means 'all', False 'no'"
    )
    # Seeds, precision, memory
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
    # Trackers, model loading, data order
    report_to: str | list[str] = opt(
        "none", "Trackers to log to: 'none', 'all', or names such as 'tensorboard', 'wandb'. metrics.jsonl is always "
        "written. None is refused (transformers 4 read it as 'all', others as 'none')."
    )
    run_name: str | None = opt(None, "A name for this run, shown by trackers.")
    disable_tqdm: bool = opt(False, "Hide the progress bar.")
    model_init_kwargs: dict | None = opt(
        None, "Keyword arguments for from_pretrained when `model` is a path (e.g. {'dtype': 'bfloat16'}); dtype defaults to float32."
    )
    trust_remote_code: bool = opt(False, "Allow custom modelling code from the model folder.")
    router_aux_loss_coef: float | None = opt(
        None, "Weight of a Mixture-of-Experts model's router load-balancing loss, added to the training loss. None "
        "takes the model config's; 0 turns it off. An error with a model that has no router.", ge=0, finite=True
    )
    train_sampling_strategy: str = opt(
        "random", "Training order. 'random' reshuffles every epoch (unless shuffle_dataset=False), 'sequential' "
        "keeps the dataset order, 'group_by_length' puts rows of similar length in the same batch (transformers' "
        "mega-batches; less padding; GRPO: by prompt length).", choices=SAMPLING_STRATEGIES,
        note="transformers' 'batch_rebalance' is not supported"
    )
    shuffle_dataset: bool = opt(True, "Reshuffle the training rows every epoch (seeded, identical on every process).")
    remove_unused_columns: bool = opt(True, "Accepted for TRL compatibility; columns a trainer does not use are never fed to the model.")
    use_cpu: bool = opt(False, "Train on CPU even when a GPU is present.")
    resume_from_checkpoint: str | bool | None = opt(
        None, "A checkpoint folder to resume from, or True for the newest complete one in output_dir. TRL's "
        "scripts pass it to trainer.train(resume_from_checkpoint=...); train() called without that argument uses "
        "it too (transformers' Trainer ignores it there)."
    )
    # For scripts, resuming and launchers
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
        "and the like; nothing on CPU): lower peak memory for a few percent of speed.", ge=1
    )
    dataloader_drop_last: bool = opt(
        False, "Drop each epoch's last incomplete global batch (GRPO: its last incomplete generation round, which "
        "TRL always drops) instead of filling it up with rows from the start of the same epoch."
    )
    dataloader_num_workers: int = opt(
        0, "For a streamed train_dataset (a datasets.IterableDataset): background threads that prepare (tokenize, "
        "pack) the next chunks of the stream while the model trains; the batches are the same as with 0. Map-style "
        "datasets are tokenized before training (dataset_num_proc processes) and batched from memory: nothing to "
        "overlap, so it has no effect there.", ge=0
    )
    dataloader_prefetch_factor: int | None = opt(
        None, "Chunks of a streamed train_dataset prepared ahead per worker (None: 2, torch's default); needs "
        "dataloader_num_workers > 0.", ge=1
    )
    dataloader_persistent_workers: bool = opt(
        False, "Accepted for transformers' scripts (needs dataloader_num_workers > 0): the prefetch threads live as "
        "long as the trainer either way, across epochs."
    )
    full_determinism: bool = opt(
        False, "Deterministic algorithms only (transformers' enable_full_determinism: "
        "torch.use_deterministic_algorithms, cuDNN deterministic, the CUDA variables it needs); slower."
    )
    tf32: bool | None = opt(
        None, "TF32 matmuls on an Ampere or newer GPU: True turns them on, False off, None leaves torch's "
        "setting. True without such a GPU is an error."
    )
    # Distributed training and failures
    ddp_find_unused_parameters: bool | None = opt(
        None, "DistributedDataParallel's find_unused_parameters. None: False (DDP's faster default; transformers "
        "picks True unless gradient checkpointing is on). Set True when DDP reports parameters without gradients."
    )
    ddp_bucket_cap_mb: int | None = opt(None, "DistributedDataParallel's bucket_cap_mb (None: DDP's 25).", ge=1)
    ddp_broadcast_buffers: bool | None = opt(
        None, "DistributedDataParallel's broadcast_buffers (None: DDP's True; GRPO's False, docs/distributed.md).")
    ddp_static_graph: bool | None = opt(None, "DistributedDataParallel's static_graph (None: DDP's False).")
    ddp_backend: str | None = opt(
        None, "Process-group backend (transformers' choices). None: nccl on GPUs, gloo on CPU.", choices=DDP_BACKENDS
    )
    ddp_timeout: int = opt(1800, "Seconds a collective may wait for the other processes before failing.", ge=1)
    max_consecutive_nonfinite_steps: int = opt(
        10, "Optimizer steps with a non-finite loss or gradient norm are skipped; after this many in a row, "
        "training stops with a checkpoint and an explanation.", ge=1
    )
    accelerator_config: dict | None = opt(
        None, "transformers' accelerator_config (a dict, a path to a JSON file, or an AcceleratorConfig): "
        "'split_batches' (True: per_device_train_batch_size and per_device_eval_batch_size are the batch of all "
        "processes together, split among them) and 'dispatch_batches' (accepted: every process reads the same "
        "data order and takes its own rows, which are the rows a dispatched batch would give it); the other keys "
        "only at transformers' defaults."
    )

    def __post_init__(self):
        self.accelerator_config = accelerator_config_dict(self.accelerator_config, type(self).__name__)
        check_types(self)
        # Values transformers also takes, turned into the form the checks expect
        if isinstance(self.resume_from_checkpoint, str) and self.resume_from_checkpoint.lower() in ("true", "false"):
            self.resume_from_checkpoint = self.resume_from_checkpoint.lower() == "true" or None  # from a flag
        if isinstance(self.include_num_input_tokens_seen, bool):  # transformers' mapping
            self.include_num_input_tokens_seen = "all" if self.include_num_input_tokens_seen else "no"
        check_constraints(self)  # each field's own choices and bounds, declared with opt()
        # Rules that relate fields to each other or to the environment
        name = type(self).__name__
        check_field(self.num_train_epochs > 0 or self.max_steps > 0, name, "num_train_epochs", self.num_train_epochs,
                    "it must be > 0 unless max_steps > 0")
        problem = check_scheduler_kwargs(self.lr_scheduler_type, self.lr_scheduler_kwargs or {})
        check_field(problem is None, name, "lr_scheduler_kwargs", self.lr_scheduler_kwargs, str(problem))
        check_field(self.warmup_steps < 1 or float(self.warmup_steps).is_integer(), name, "warmup_steps",
                    self.warmup_steps, "a value >= 1 counts steps and must be a whole number")
        check_field(not (self.warmup_steps and self.warmup_ratio), name, "warmup_ratio", self.warmup_ratio,
                    "set warmup_steps or warmup_ratio, not both")
        if self.eval_strategy != "no":
            self.do_eval = True  # transformers' rule, for scripts that read do_eval
        launcher_rank = os.environ.get("LOCAL_RANK")
        check_field(self.local_rank == -1 or launcher_rank is None or str(self.local_rank) == launcher_rank, name,
                    "local_rank", self.local_rank, f"the launcher set LOCAL_RANK={launcher_rank} for this process")
        check_field(not self.tf32 or tf32_available(), name, "tf32", self.tf32,
                    "TF32 needs an Ampere or newer NVIDIA GPU, and none is visible here; leave tf32 at None")
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
        for option in ("dataloader_prefetch_factor", "dataloader_persistent_workers"):  # transformers' rule
            check_field(not getattr(self, option) or self.dataloader_num_workers > 0, name, option,
                        getattr(self, option), "it applies to worker threads: set dataloader_num_workers > 0")

    @property
    def split_batches(self) -> bool:
        """accelerator_config's split_batches: the per_device_*_batch_size options count all processes' rows."""
        return bool((self.accelerator_config or {}).get("split_batches"))

    @property
    def mixed_precision(self) -> str | None:
        """bf16 and fp16 as Accelerate's mixed_precision; None follows the launch configuration."""
        if self.bf16:
            return "bf16"
        if self.fp16:
            return "fp16"
        if self.bf16 is False:
            return "no"
        return None  # follow the launch configuration

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
        """Every field, secrets masked (``hub_token``, a server's API key: ``<HUB_TOKEN>``, as transformers masks
        them): this is what training_args.json and checkpoints record."""
        fields = dataclasses.asdict(self)
        for name in SECRET_FIELDS:
            if fields.get(name) is not None:
                fields[name] = f"<{name.upper()}>"
        return fields
