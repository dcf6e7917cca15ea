"""SFT's micro-batch (also its evaluation batch): the Collator's rows on the device, with what the loop counts
(``trainers.loop.base.MicroBatch``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainers.sft.tokenize import IGNORE


@dataclass(frozen=True)
class SFTBatch:
    """B rows of T positions: padded rows, packed rows (position ids restarting per document), or, padding-free,
    one row (B = 1) of every sample concatenated."""

    input_ids: torch.Tensor  # [B, T] long
    target_ids: torch.Tensor  # [B, T] long: the token each position is trained to predict, IGNORE (-100) if none
    attention_mask: torch.Tensor | None  # [B, T] 1 on real tokens; None for packed and padding-free rows
    position_ids: torch.Tensor | None  # [B, T] restarting per document; None for padded rows
    loss_mask: torch.Tensor  # [B, T] float: 1 where target_ids is trained
    num_input_tokens: torch.Tensor  # 0-d: the real (not padding) input tokens
    num_padded_tokens: int  # B x T: every input position, padding included (include_num_input_tokens_seen="all")

    @classmethod
    def from_collated(cls, collated: dict, device: torch.device) -> SFTBatch:
        """The Collator's output (trainers.sft.tokenize.Collator) on ``device``, with its loss mask and size."""
        on_device = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in collated.items()}
        input_ids, target_ids = on_device["input_ids"], on_device["target_ids"]
        return cls(input_ids=input_ids, target_ids=target_ids, attention_mask=on_device["attention_mask"],
                   position_ids=on_device["position_ids"], loss_mask=(target_ids != IGNORE).float(),
                   num_input_tokens=on_device["num_input_tokens"], num_padded_tokens=input_ids.numel())
