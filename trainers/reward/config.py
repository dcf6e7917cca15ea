"""RewardConfig: TRL 1.16's reward-model options on the shared TrainingConfig."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from trainers.config.training import TrainingConfig, resolve_pad_to_multiple_of
from trainers.config.options import opt, reject_unknown_options


@reject_unknown_options
@dataclass
class RewardConfig(TrainingConfig):
    """A reward model: a sequence classifier (one score per sequence) trained so chosen completions score above
    rejected ones (Bradley-Terry)."""

    learning_rate: float = opt(1e-4, "Peak learning rate of AdamW (TRL's reward default).", ge=0, finite=True)
    max_length: int | None = opt(
        1024, "A pair whose chosen or rejected sequence (prompt + completion) is longer is dropped, with a warning "
        "that counts them (TRL drops them silently). None: no limit.", ge=1)
    pad_to_multiple_of: str | int | None = opt(
        "auto", "Pad each batch's sequence length up to a multiple of this (None: no extra padding). TRL's 'auto' "
        "pads to 128 on AWS Neuron only: None here.", ge=1, choices=("auto",))
    eos_token: str | None = opt(None, "End-of-sequence token appended to text completions; defaults to the "
                                      "tokenizer's.")
    pad_token: str | None = opt(None, "Padding token; defaults to the tokenizer's, then to its EOS token "
                                      "(deprecated in TRL).")
    chat_template_path: str | None = opt(
        None, "A Jinja template file, or a tokenizer folder whose template (and the tokens it needs) to use.")
    dataset_num_proc: int | None = opt(None, "Processes used to tokenize the dataset.")
    disable_dropout: bool = opt(True, "Turn off dropout in the model.")
    center_rewards_coefficient: float | None = opt(
        None, "Add this times the mean of (chosen + rejected score)^2, pulling scores toward mean zero "
        "(arXiv:2312.09244, eq. 2; 0.01 is the paper's). None: off.", ge=0, finite=True)

    def __post_init__(self):
        self.pad_to_multiple_of = resolve_pad_to_multiple_of(self.pad_to_multiple_of, type(self).__name__)
        if self.pad_token is not None:
            warnings.warn("RewardConfig.pad_token is deprecated in TRL; set the tokenizer's pad token instead.",
                          FutureWarning, stacklevel=3)
        super().__post_init__()
