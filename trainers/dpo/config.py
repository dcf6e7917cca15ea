"""DPOConfig: TRL 1.16's DPO options (its names, defaults and rules) on the shared TrainingConfig."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

from trainers.config.training import TrainingConfig, resolve_pad_to_multiple_of
from trainers.dpo.losses import DPO_LOSSES, F_DIVERGENCE_LOSSES
from trainers.config.options import check_field, opt, reject_unknown_options

TRUNCATION_MODES = ("keep_start", "keep_end")
F_DIVERGENCES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")


@reject_unknown_options
@dataclass
class DPOConfig(TrainingConfig):
    """Direct preference optimization (arXiv:2305.18290) and its variants: how preference pairs become token
    sequences, the loss (``loss_type``, trainers/dpo/losses.py) and the reference model."""

    learning_rate: float = opt(1e-6, "Peak learning rate of AdamW (TRL's DPO default).", ge=0, finite=True)
    # Rows to token sequences
    max_length: int | None = opt(
        1024, "Truncate each prompt + completion sequence (chosen and rejected alike) to this many tokens; a row "
        "whose prompt alone reaches it is dropped (with keep_start), as in TRL. None: no truncation.", ge=1)
    truncation_mode: str = opt(
        "keep_start", "Which end of an over-long sequence to keep ('keep_end' is deprecated in TRL: it cuts the "
        "prompt's start).", choices=TRUNCATION_MODES)
    padding_free: bool = opt(
        False, "TRL 1.16 turns it off with a warning (it needs FlashAttention there); the same here: the pairs are "
        "trained padded.")
    pad_to_multiple_of: str | int | None = opt(
        "auto", "Pad each batch's sequence length up to a multiple of this (None: no extra padding). TRL's 'auto' "
        "pads to 128 on AWS Neuron only: None here.", ge=1, choices=("auto",))
    pad_token: str | None = opt(None, "Padding token; defaults to the tokenizer's, then to its EOS token "
                                      "(deprecated in TRL).")
    dataset_num_proc: int | None = opt(None, "Processes used to tokenize the dataset.")
    disable_dropout: bool = opt(True, "Turn off dropout in the policy and the reference model.")
    # The loss
    loss_type: list[str] | str = opt(
        ["sigmoid"], "The loss, or several summed with loss_weights (e.g. ['sigmoid', 'sft'] for RPO): "
        f"{', '.join(DPO_LOSSES)} (docs/dpo.md).", choices=tuple(DPO_LOSSES))
    loss_weights: list[float] | None = opt(None, "One finite weight per loss_type (None: 1 each).")
    beta: float = opt(0.1, "Inverse temperature of the implicit reward (IPO's tau): how far the policy may move "
                           "from the reference.", gt=0, finite=True)
    label_smoothing: float = opt(
        0.0, "Probability that a pair's preference is flipped: robust (< 0.5), exo_pair (> 0), aot and "
        "aot_unpaired read it.", ge=0, lt=1)
    f_divergence_type: str = opt(
        "reverse_kl", "The divergence the log-ratios are scored by (arXiv:2309.16240); other than reverse_kl only "
        f"with loss types {', '.join(sorted(F_DIVERGENCE_LOSSES))}.", choices=F_DIVERGENCES)
    f_alpha_divergence_coef: float = opt(0.5, "alpha of alpha_divergence.", finite=True)
    ld_alpha: float | None = opt(
        None, "LD-DPO (arXiv:2409.06411): the weight of each completion's tokens past the shorter one's length "
        "in its log-prob (None: 1, plain sums).", ge=0, le=1)
    use_weighting: bool = opt(
        False, "WPO (arXiv:2406.11827): weight each pair's loss by the policy's length-normalized probability of "
        "both completions (detached).")
    discopop_tau: float = opt(0.05, "DiscoPOP's temperature.", gt=0, finite=True)
    # The reference model
    precompute_ref_log_probs: bool = opt(
        False, "Compute the reference's log-probs of every pair once before training (and of the eval pairs), so "
        "no reference model is kept during training.")
    precompute_ref_batch_size: int | None = opt(
        None, "Pairs per forward when precomputing (None: per_device_train_batch_size, "
        "per_device_eval_batch_size for eval).", ge=1)
    sync_ref_model: bool = opt(
        False, "TR-DPO (arXiv:2404.09656): every ref_model_sync_steps steps move the reference toward the policy.")
    ref_model_mixup_alpha: float = opt(0.6, "ref = alpha x policy + (1 - alpha) x ref at each sync.", ge=0, le=1)
    ref_model_sync_steps: int = opt(512, "Optimizer steps between reference syncs.", ge=1)

    def __post_init__(self):
        if isinstance(self.loss_type, str):  # TRL accepts one name
            self.loss_type = [self.loss_type]
        self.pad_to_multiple_of = resolve_pad_to_multiple_of(self.pad_to_multiple_of, type(self).__name__)
        if self.pad_token is not None:
            warnings.warn("DPOConfig.pad_token is deprecated in TRL; set the tokenizer's pad token instead.",
                          FutureWarning, stacklevel=3)
        if self.truncation_mode == "keep_end":
            warnings.warn("truncation_mode='keep_end' is deprecated in TRL (it cuts the prompt's start).",
                          FutureWarning, stacklevel=3)
        super().__post_init__()  # also each field's own choices and bounds
        name, losses = type(self).__name__, list(self.loss_type)
        check_field(bool(losses), name, "loss_type", self.loss_type, "give at least one loss type")
        weights = self.loss_weights
        check_field(weights is None or (len(weights) == len(losses) and all(
                    isinstance(w, (int, float)) and math.isfinite(w) for w in weights)), name, "loss_weights",
                    weights, f"give one finite weight per loss_type ({len(losses)}: {losses})")
        check_field(self.f_divergence_type == "reverse_kl" or set(losses) <= F_DIVERGENCE_LOSSES, name,
                    "f_divergence_type", self.f_divergence_type,
                    f"only reverse_kl works with {sorted(set(losses) - F_DIVERGENCE_LOSSES)} (they use the raw "
                    f"log-ratios)")
        check_field("exo_pair" not in losses or self.label_smoothing > 0, name, "label_smoothing",
                    self.label_smoothing, "loss_type 'exo_pair' needs label_smoothing > 0 (as TRL)")
        check_field("robust" not in losses or self.label_smoothing < 0.5, name, "label_smoothing",
                    self.label_smoothing, "loss_type 'robust' needs label_smoothing < 0.5 (it divides by 1 - 2 x it)")
        check_field(not (self.use_weighting and {"aot", "aot_unpaired"} & set(losses)), name, "use_weighting",
                    self.use_weighting, "WPO weighting does not apply to the aot losses (as TRL)")
        check_field(not (self.sync_ref_model and self.precompute_ref_log_probs), name, "sync_ref_model",
                    self.sync_ref_model, "a precomputed reference cannot move: drop precompute_ref_log_probs")

    @property
    def weights(self) -> list[float]:
        """loss_weights, 1 for each loss type when None."""
        return list(self.loss_weights) if self.loss_weights is not None else [1.0] * len(self.loss_type)
