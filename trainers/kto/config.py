"""KTOConfig: TRL 1.16's KTO options (its names, defaults and rules) on the shared TrainingConfig."""

from __future__ import annotations

from dataclasses import dataclass

from trainers.config.training import TrainingConfig, resolve_pad_to_multiple_of
from trainers.config.options import check_field, opt, reject_unknown_options

KTO_LOSS_TYPES = ("kto", "apo_zero_unpaired")


@reject_unknown_options
@dataclass
class KTOConfig(TrainingConfig):
    """Kahneman-Tversky optimization (arXiv:2402.01306): completions labelled desirable or not, no pairs needed;
    the reference point is a KL estimate from mismatched prompt-completion pairs."""

    learning_rate: float = opt(1e-6, "Peak learning rate of AdamW (TRL's KTO default).", ge=0, finite=True)
    train_sampling_strategy: str = opt(
        "sequential", "Training order (TRL's KTO default: 'sequential'). The KL estimate pairs each row with its "
        "neighbour's completion within its micro-batch, a pairing made once in dataset order, so loss_type='kto' "
        "needs 'sequential', as in TRL.", choices=("random", "sequential", "group_by_length"))
    max_length: int | None = opt(
        1024, "Truncate each prompt + completion to this many tokens (its start kept); a row whose prompt alone "
        "reaches it is dropped, with a warning, as TRL drops it. None: no truncation.", ge=1)
    pad_to_multiple_of: str | int | None = opt(
        "auto", "Pad each batch's sequence length up to a multiple of this (None: no extra padding). TRL's 'auto' "
        "pads to 128 on AWS Neuron only: None here.", ge=1, choices=("auto",))
    dataset_num_proc: int | None = opt(None, "Processes used to tokenize the dataset.")
    disable_dropout: bool = opt(True, "Turn off dropout in the policy and the reference model.")
    loss_type: str = opt(
        "kto", "'kto': KTO's value function around the KL reference point. 'apo_zero_unpaired': APO-zero on "
        "unpaired data (arXiv:2408.06266), no KL term.", choices=KTO_LOSS_TYPES)
    beta: float = opt(0.1, "How far the policy may move from the reference (the reward's scale).", gt=0, finite=True)
    desirable_weight: float = opt(1.0, "Weight of the desirable completions' losses (lambda_D).", ge=0, finite=True)
    undesirable_weight: float = opt(1.0, "Weight of the undesirable completions' losses (lambda_U).", ge=0,
                                    finite=True)
    precompute_ref_log_probs: bool = opt(
        False, "Compute the reference's log-probs of every row (and of its KL pair) once before training, so no "
        "reference model is kept during training.")
    precompute_ref_batch_size: int | None = opt(
        None, "Rows per forward when precomputing (None: per_device_train_batch_size, per_device_eval_batch_size "
        "for eval).", ge=1)
    sync_ref_model: bool = opt(
        False, "TR-DPO (arXiv:2404.09656): every ref_model_sync_steps steps move the reference toward the policy.")
    ref_model_mixup_alpha: float = opt(0.6, "ref = alpha x policy + (1 - alpha) x ref at each sync.", ge=0, le=1)
    ref_model_sync_steps: int = opt(512, "Optimizer steps between reference syncs.", ge=1)

    def __post_init__(self):
        self.pad_to_multiple_of = resolve_pad_to_multiple_of(self.pad_to_multiple_of, type(self).__name__)
        super().__post_init__()
        name = type(self).__name__
        check_field(not (self.sync_ref_model and self.precompute_ref_log_probs), name, "sync_ref_model",
                    self.sync_ref_model, "a precomputed reference cannot move: drop precompute_ref_log_probs")

    @property
    def uses_kl(self) -> bool:
        """Whether the loss has KTO's KL reference point (its mismatched pairs are then forwarded too)."""
        return self.loss_type == "kto"
