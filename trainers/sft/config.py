"""SFTConfig: how rows become token sequences and which tokens carry the loss."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from trainers.config.training import TrainingConfig, resolve_pad_to_multiple_of
from trainers.config.options import check_field, opt, reject_unknown_options

TRUNCATION_MODES = ("keep_start", "keep_end")
PACKING_STRATEGIES = ("bfd", "bfd_split", "wrapped")  # TRL's; trainers/sft/packing.py pack_samples
LOSS_TYPES = ("nll", "dft", "chunked_nll")  # trainers/model/losses.py SFT_TOKEN_LOSSES
METRIC_INPUTS = ("inputs", "loss")  # what include_for_metrics may add to compute_metrics' arguments


@reject_unknown_options
@dataclass
class SFTConfig(TrainingConfig):
    """Supervised fine-tuning: how rows become token sequences and which tokens carry the loss."""

    learning_rate: float = opt(2e-5, "Peak learning rate of AdamW.", ge=0, finite=True)
    # Rows to token sequences
    dataset_text_field: str = opt("text", "Column holding raw text for language modelling.")
    max_length: int | None = opt(
        1024, "Truncate every tokenized sample to this many tokens (None: no truncation).", ge=1)
    truncation_mode: str = opt("keep_start", "Which end of an over-long sample to keep.", choices=TRUNCATION_MODES)
    packing: bool = opt(
        False, "Pack several samples into each row of max_length tokens (how: packing_strategy)."
    )
    packing_strategy: str = opt(
        "bfd", "How packing fills rows, as TRL. 'bfd': best-fit decreasing, whole samples (truncated to max_length "
        "first), no attention across samples. 'bfd_split': the same, but a sample longer than max_length is split "
        "into max_length pieces, each packed as a sample of its own. 'wrapped': every sample concatenated and cut "
        "into max_length chunks, each one sequence (samples in a chunk see the earlier ones; a sample may be cut "
        "in the middle); no token is dropped.", choices=PACKING_STRATEGIES
    )
    eval_packing: bool | None = opt(
        None, "Pack eval_dataset as well (None: as packing). The loss is the same either way; packing changes "
        "the speed and memory of evaluation."
    )
    padding_free: bool = opt(
        False, "Concatenate a micro-batch into one row without padding (implied by packing). Without packing it "
        "needs max_length=None, as in TRL (which does not enforce max_length on such rows).")
    pad_to_multiple_of: str | int | None = opt(
        "auto", "Pad each batch's sequence length up to a multiple of this (None: no extra padding); the loss is "
        "unchanged. TRL's 'auto' pads to 128 on AWS Neuron only, which this project does not run on, so it means "
        "None here (the field reads None once the config is built).", ge=1, choices=("auto",)
    )
    # The loss, and which tokens carry it
    loss_type: str = opt(
        "nll", "'nll': the token-level negative log-likelihood. 'dft': Dynamic Fine-Tuning (arXiv:2508.05629), "
        "each token's NLL weighted by its probability p (detached): -p log p, averaged as the NLL is. Not with "
        "compute_loss_func (as in TRL). 'chunked_nll': TRL's deprecated alias of 'nll' (read as 'nll', with TRL's "
        "FutureWarning).", choices=LOSS_TYPES
    )
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
    dataset_kwargs: dict | None = opt(
        None, "TRL's dataset preparation options; its only key is 'skip_prepare_dataset': True uses the rows as "
        "given: already tokenized ('input_ids', optionally 'labels' with -100 on untrained tokens, and 'seq_lengths' "
        "for rows packed beforehand), with no EOS added, no truncation and no packing."
    )
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
        self.pad_to_multiple_of = resolve_pad_to_multiple_of(self.pad_to_multiple_of, type(self).__name__)
        if self.loss_type == "chunked_nll":  # TRL 1.16's deprecated alias, with its warning
            warnings.warn("`loss_type='chunked_nll'` is deprecated and will be removed in v2.0.0. Use "
                          "`loss_type='nll'` (the default), which computes the loss the same way.", FutureWarning,
                          stacklevel=3)
            self.loss_type = "nll"
        super().__post_init__()  # also each field's own choices and bounds
        check_field(not ((self.packing or self.eval_packing) and self.max_length is None), type(self).__name__,
                    "max_length", self.max_length, "packing needs a max_length (the length of a packed row)")
        # padding_free=True without packing and with a max_length is refused by the trainer, as TRL refuses it
        # (SFTTrainer.prepare_data): TRL's SFTConfig accepts it
        self._check_dataset_kwargs()

    DATASET_KWARGS = ("skip_prepare_dataset",)  # TRL's only key

    def _check_dataset_kwargs(self) -> None:
        kwargs, name = self.dataset_kwargs or {}, type(self).__name__
        unknown = sorted(set(kwargs) - set(self.DATASET_KWARGS))
        check_field(not unknown, name, "dataset_kwargs", self.dataset_kwargs,
                    f"its only key is 'skip_prepare_dataset' (as in TRL), not {unknown}")
        skip = kwargs.get("skip_prepare_dataset", False)
        check_field(isinstance(skip, bool), name, "dataset_kwargs", self.dataset_kwargs,
                    "'skip_prepare_dataset' must be True or False")
        check_field(not (skip and (self.packing or self.eval_packing)), name, "dataset_kwargs", self.dataset_kwargs,
                    "skip_prepare_dataset uses the rows as given, and packing happens while preparing them: pack the "
                    "rows beforehand (input_ids with a 'seq_lengths' column) and set packing=False, or drop "
                    "skip_prepare_dataset")

    @property
    def skip_prepare_dataset(self) -> bool:
        """dataset_kwargs' skip_prepare_dataset: the rows are used as given (already tokenized)."""
        return bool((self.dataset_kwargs or {}).get("skip_prepare_dataset"))

    def truncation_length(self, pack: bool) -> int | None:
        """The length each sample is truncated to before packing (``pack``) or batching: max_length, except for
        the packing strategies that keep every token ('bfd_split', 'wrapped': they cut samples themselves)."""
        return None if pack and self.packing_strategy != "bfd" else self.max_length
