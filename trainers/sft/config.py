"""SFTConfig: how rows become token sequences and which tokens carry the loss."""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainers.configs import TrainingConfig, check_field, opt, reject_unknown_options

SFT_LOSS_TYPES = ("nll",)



TRUNCATION_MODES = ("keep_start", "keep_end")



@reject_unknown_options
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
        check_field(self.neftune_noise_alpha is None or (self.neftune_noise_alpha > 0
                                                    and math.isfinite(self.neftune_noise_alpha)),
               name, "neftune_noise_alpha", self.neftune_noise_alpha, "it must be a positive number, or None")
        check_field(self.max_length is None or (isinstance(self.max_length, int) and self.max_length > 0), name,
               "max_length", self.max_length, "it must be a positive integer or None")
        check_field(not ((self.packing or self.eval_packing) and self.max_length is None), name, "max_length",
               self.max_length, "packing needs a max_length (the length of a packed row)")
        check_field(self.truncation_mode in TRUNCATION_MODES, name, "truncation_mode", self.truncation_mode,
               f"valid: {TRUNCATION_MODES}")
        check_field(self.packing_strategy == "bfd", name, "packing_strategy", self.packing_strategy, "valid: ('bfd',)")
        check_field(self.loss_type in SFT_LOSS_TYPES, name, "loss_type", self.loss_type, f"valid: {SFT_LOSS_TYPES}")
        check_field(self.pad_to_multiple_of is None or self.pad_to_multiple_of > 0, name, "pad_to_multiple_of",
               self.pad_to_multiple_of, "it must be a positive integer or None")
        check_field(isinstance(self.include_for_metrics, list) and all(v in ("inputs", "loss")
                                                                  for v in self.include_for_metrics),
               name, "include_for_metrics", self.include_for_metrics, "it must be a list of 'inputs' and 'loss'")
