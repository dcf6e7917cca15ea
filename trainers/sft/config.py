"""SFTConfig: how rows become token sequences and which tokens carry the loss."""

from __future__ import annotations

from dataclasses import dataclass

from trainers.configs import TrainingConfig, check_field, opt, reject_unknown_options

TRUNCATION_MODES = ("keep_start", "keep_end")
METRIC_INPUTS = ("inputs", "loss")  # what include_for_metrics may add to compute_metrics' arguments


@reject_unknown_options
@dataclass
class SFTConfig(TrainingConfig):
    """Supervised fine-tuning: how rows become token sequences and which tokens carry the loss."""

    learning_rate: float = opt(2e-5, "Peak learning rate of AdamW.", gt=0, finite=True)
    # Rows to token sequences
    dataset_text_field: str = opt("text", "Column holding raw text for language modelling.")
    max_length: int | None = opt(
        1024, "Truncate every tokenized sample to this many tokens (None: no truncation).", ge=1)
    truncation_mode: str = opt("keep_start", "Which end of an over-long sample to keep.", choices=TRUNCATION_MODES)
    packing: bool = opt(
        False, "Pack several samples into each row of max_length tokens (best-fit decreasing, TRL's 'bfd'), "
        "padding-free, with no attention across samples."
    )
    eval_packing: bool | None = opt(
        None, "Pack eval_dataset as well (None: as packing). The loss is the same either way; packing changes "
        "the speed and memory of evaluation."
    )
    padding_free: bool = opt(False, "Concatenate a micro-batch into one row without padding (implied by packing).")
    pad_to_multiple_of: int | None = opt(None, "Pad each batch's length up to a multiple of this.", ge=1)
    # Which tokens carry the loss (always the token-level negative log-likelihood, TRL's loss_type='nll')
    completion_only_loss: bool | None = opt(
        None, "For prompt/completion data, train on completion tokens only. None means True for such data."
    )
    assistant_only_loss: bool = opt(False, "For `messages` data, train on assistant turns only (any chat template).")
    # Tokenizer and chat template
    eos_token: str | None = opt(None, "End-of-sequence token appended to samples; defaults to the tokenizer's.")
    pad_token: str | None = opt(None, "Padding token; defaults to the tokenizer's, then to its EOS token.")
    chat_template_path: str | None = opt(
        None, "A Jinja chat template file to use instead of the tokenizer's, or a tokenizer folder / Hub id whose "
        "template is cloned with the tokens it needs, its EOS and resized embeddings (TRL's clone_chat_template).")
    dataset_num_proc: int | None = opt(None, "Processes used to tokenize the dataset.")
    neftune_noise_alpha: float | None = opt(
        None, "NEFTune (arXiv:2310.05914): add uniform noise of scale alpha / sqrt(tokens x width) to the input "
        "embeddings of every training forward (not in evaluation), as transformers does. The paper uses 5.",
        gt=0, finite=True
    )
    # What the trainer's compute_metrics receives (transformers' evaluation options)
    prediction_loss_only: bool = opt(
        False, "Evaluate the loss and the token accuracy only: compute_metrics is not called and predict() returns "
        "no predictions."
    )
    include_for_metrics: list[str] = opt(
        [], "Also give compute_metrics the batches' 'inputs' (input ids) and/or 'loss' (each row's batch loss).",
        choices=METRIC_INPUTS)
    eval_do_concat_batches: bool = opt(
        True, "compute_metrics gets the batches concatenated into one array, padded with -100 (False: a list of them).")
    batch_eval_metrics: bool = opt(
        False, "Call compute_metrics on every evaluation batch, with compute_result=True on the last one (whose "
        "return is the metrics), instead of once on every prediction held in memory."
    )

    def __post_init__(self):
        super().__post_init__()  # also each field's own choices and bounds
        check_field(not ((self.packing or self.eval_packing) and self.max_length is None), type(self).__name__,
                    "max_length", self.max_length, "packing needs a max_length (the length of a packed row)")
