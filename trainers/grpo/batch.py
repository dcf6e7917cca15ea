"""A GRPO generation round's rows on one process (``Rollout``) and the micro-batches cut from them.

A round is sampled and scored once (trainers/grpo.py) and then serves ``steps_per_generation`` micro-steps,
``num_iterations`` times over; each micro-batch is a contiguous slice with its all-padding columns trimmed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainers.modeling import positions_from_mask


@dataclass(frozen=True)
class Rollout:
    """One generation round's rows on this process (N = per_device_train_batch_size x steps_per_generation)."""

    prompt_ids: torch.Tensor  # [N, P] left-padded
    prompt_mask: torch.Tensor  # [N, P]
    completion_ids: torch.Tensor  # [N, C] right-padded, cut after the first EOS
    completion_attention: torch.Tensor  # [N, C] 1 on real completion tokens
    loss_mask: torch.Tensor  # [N, C] float: tokens that count in the loss
    advantages: torch.Tensor  # [N]
    old_logps: torch.Tensor | None  # [N, C] log-probs under the policy that sampled (None: equal to current)
    ref_logps: torch.Tensor | None  # [N, C] log-probs under the reference model (beta > 0)
    # a rollout function's log-probs: [N, C], NaN where it gave none; and the loss's importance weights
    # pi_old / pi_sampler for them (vllm_importance_sampling_correction): [N, C] per token, [N, 1] per completion
    sampler_logps: torch.Tensor | None = None
    sampler_weights: torch.Tensor | None = None

    def micro_batch(self, start: int, end: int) -> dict:
        """Rows [start, end), with all-padding columns trimmed on both sides."""
        prompt_mask = self.prompt_mask[start:end]
        first, width = unpadded_columns(prompt_mask, self.completion_attention[start:end])
        cut = lambda t: None if t is None else t[start:end, :width]  # noqa: E731
        batch = {
            "prompt_ids": self.prompt_ids[start:end, first:], "prompt_mask": prompt_mask[:, first:],
            "completion_ids": cut(self.completion_ids), "completion_attention": cut(self.completion_attention),
            "loss_mask": cut(self.loss_mask), "advantages": self.advantages[start:end],
            "old_logps": cut(self.old_logps), "ref_logps": cut(self.ref_logps),
            "sampler_logps": cut(self.sampler_logps), "sampler_weights": cut(self.sampler_weights),
        }
        batch["num_input_tokens"] = batch["prompt_mask"].sum() + batch["completion_attention"].sum()
        # include_num_input_tokens_seen: TRL's GRPO counts the real prompt and completion tokens in every mode
        batch["num_padded_tokens"] = batch["num_input_tokens"]
        return batch

    def to(self, device) -> "Rollout":
        return Rollout(**{k: None if v is None else v.to(device) for k, v in self.__dict__.items()})


def unpadded_columns(prompt_mask: torch.Tensor, completion_attention: torch.Tensor) -> tuple[int, int]:
    """The first prompt column that is not padding in every row, and the completion width that is (at least 1).
    prompt_mask: [B, P] left-padded; completion_attention: [B, C] right-padded."""
    first = int((prompt_mask.sum(0) > 0).nonzero()[0]) if prompt_mask.any() else prompt_mask.shape[1] - 1
    return first, max(int(completion_attention.sum(1).max()), 1)


def policy_rows(batch: dict, rows: torch.Tensor) -> dict:
    """The forward's inputs (prompt and completion ids and masks) of some rows of a micro-batch, all-padding
    columns trimmed. rows: [b] indices."""
    first, width = unpadded_columns(batch["prompt_mask"][rows], batch["completion_attention"][rows])
    return {"prompt_ids": batch["prompt_ids"][rows, first:], "prompt_mask": batch["prompt_mask"][rows, first:],
            "completion_ids": batch["completion_ids"][rows, :width],
            "completion_attention": batch["completion_attention"][rows, :width]}


def policy_inputs(batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """prompt + completion -> (input_ids, attention_mask, position_ids), each [B, P + C].

    Position ids count real tokens only (``positions_from_mask``).
    """
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_attention"]], dim=1)
    return input_ids, attention_mask, positions_from_mask(attention_mask)
