"""GRPO's padding-free forward (``GRPOConfig.padding_free``): a micro-batch's sequences in one row, without padding.

A micro-batch holds rows of prompt (left-padded to the longest prompt) + completion (right-padded to the longest
completion): with ragged lengths much of it is padding, which a padded forward computes like any token. Here
each row's real tokens are cut out and laid end to end in one row, with positions restarting at 0 for each
sequence, as SFT's packing does; transformers reads the restarting positions as sequence boundaries, so no token
attends across them. Only completion positions go through the output head (the chunked head,
trainers/model/output_head.py), and their scores are put back in the [B, C] layout of the padded forward, equal to it
(tests/unit/test_packed_forward.py).
"""

from __future__ import annotations

import torch

from trainers.model.cpu_attention import float32_attention_on_cpu
from trainers.model.modeling import positions_from_mask, split_scores
from trainers.model.output_head import HeadPlan, scoring_head, true_positions


def packed_logprobs(model: torch.nn.Module, plan: HeadPlan, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                    completion_ids: torch.Tensor, completion_attention: torch.Tensor, temperature: float = 1.0,
                    with_entropy: bool = False, entropy_grad: bool = False,
                    with_router_loss: bool = False, counts: tuple[int, int] | None = None
                    ) -> dict[str, torch.Tensor]:
    """Per-token log-probs (and entropy, with a gradient if ``entropy_grad``; the MoE router loss as "aux_loss"
    with ``with_router_loss``) of completions, from one forward over the micro-batch's real tokens.

    prompt_ids, prompt_mask: [B, P] left-padded. completion_ids, completion_attention: [B, C] right-padded.
    ``plan``: the model's output head (``plan_head``; the packed row is scored by it, never as full logits).
    ``counts``: (real tokens, real completion tokens) as host integers (``RowWidths.counts``), else read from
    the masks (on a GPU, a host stall). Returns tensors of shape [B, C], 0 at padding."""
    P, C = prompt_ids.shape[1], completion_ids.shape[1]
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # [B, P + C]
    attention_mask = torch.cat([prompt_mask, completion_attention], dim=1)
    tokens, completion_tokens = counts if counts is not None else (None, None)
    real = true_positions(attention_mask != 0, tokens)  # [N] of the B x (P + C) positions, row after row
    # what each padded position predicts: position P - 1 + k the completion's token k (where it is real)
    targets = torch.full_like(input_ids, -1)
    targets[:, P - 1: P + C - 1] = completion_ids.masked_fill(completion_attention == 0, -1)
    kwargs = {"input_ids": input_ids.flatten()[real].unsqueeze(0),  # [1, N]
              # restarting per sequence
              "position_ids": positions_from_mask(attention_mask).flatten()[real].unsqueeze(0),
              "use_cache": False}
    if with_router_loss:
        kwargs["output_router_logits"] = True
    with float32_attention_on_cpu(model, input_ids.device), \
            scoring_head(plan, targets.flatten()[real].unsqueeze(0), temperature, with_entropy, entropy_grad,
                         kept=completion_tokens):
        outputs = model(**kwargs)
    scores = outputs.logits[0]  # [N, 3]
    padded = scores.new_zeros((input_ids.numel(), 3)).index_copy(0, real, scores).view(*input_ids.shape, 3)
    out = split_scores(padded[:, P - 1: P + C - 1], with_entropy)  # [B, C] each
    if with_router_loss:
        out["aux_loss"] = outputs.aux_loss
    return out
