"""Pure tensor functions: log-probs from logits, entropy, SFT's token losses, and how a loss is averaged.

Nothing here knows about models, processes or configs. Shapes: B sequences, T positions, V vocabulary.
``mask`` is 1.0 where a token counts and 0.0 elsewhere.

How losses are averaged (the ``aggregate_*`` functions; GRPO's loss types name theirs in
trainers/grpo/objectives.py, ``AGGREGATIONS``) is what makes a result independent of how a global batch is split
into micro-batches and processes: each micro-batch's loss is a sum divided by a *global* count (tokens or
sequences in the whole optimizer step), so summing micro-batch gradients gives the gradient of the global
loss. The trainer multiplies by processes x accumulation steps to undo the averaging done by DDP/DeepSpeed
and by ``accelerator.backward``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

# ----------------------------------------------------------------------------------------------------------------
# Log-probabilities and entropy, computed in row chunks so [B, T, V] float32 never exists at once.
# ----------------------------------------------------------------------------------------------------------------


def selective_log_softmax(logits: torch.Tensor, index: torch.Tensor, chunk_rows: int = 4) -> torch.Tensor:
    """log softmax(logits)[index] for every position.

    logits: [B, T, V] (any float dtype; upcast to float32 one chunk of rows at a time)
    index:  [B, T] token ids (negative ids are treated as 0; mask them yourself)
    returns [B, T] float32
    """
    index = index.clamp(min=0)
    out = []
    for rows, idx in zip(logits.split(chunk_rows), index.split(chunk_rows)):
        rows = rows.float()  # [b, T, V]
        picked = rows.gather(-1, idx.unsqueeze(-1)).squeeze(-1)  # [b, T]
        out.append(picked - torch.logsumexp(rows, dim=-1))
    return torch.cat(out)


def logps_and_entropy(logits: torch.Tensor, index: torch.Tensor, chunk_rows: int = 4,
                      entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``selective_log_softmax`` and ``entropy_from_logits`` in one pass over the logits (they share the
    log-sum-exp). The entropy carries a gradient only with ``entropy_grad`` (an entropy bonus; it keeps each
    chunk's probabilities for backward). Returns ([B, T], [B, T]) float32."""
    index = index.clamp(min=0)
    logps, entropies = [], []
    for rows, idx in zip(logits.split(chunk_rows), index.split(chunk_rows)):
        rows = rows.float()  # [b, T, V]
        lse = torch.logsumexp(rows, dim=-1)  # [b, T]
        logps.append(rows.gather(-1, idx.unsqueeze(-1)).squeeze(-1) - lse)
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            probs = torch.exp(rows - lse.unsqueeze(-1))
            entropies.append(lse - (probs * rows).sum(-1))  # H = lse - E_p[logit]
    return torch.cat(logps), torch.cat(entropies)


def entropy_from_logits(logits: torch.Tensor, chunk_rows: int = 4) -> torch.Tensor:
    """Entropy of softmax(logits) at every position: [B, T, V] -> [B, T] float32."""
    out = []
    for rows in logits.split(chunk_rows):
        logp = rows.float().log_softmax(-1)  # [b, T, V]
        out.append(-(logp.exp() * logp).sum(-1))
    return torch.cat(out)


# ----------------------------------------------------------------------------------------------------------------
# Aggregation: per-token losses [B, T] -> the scalar this micro-batch contributes to the global loss.
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BatchCounts:
    """Counts over one whole optimizer step (every micro-batch on every process)."""

    tokens: float  # masked-in tokens
    sequences: float  # sequences (completions)
    micro_batches: int  # processes x accumulation steps


def aggregate_token_mean(per_token: torch.Tensor, mask: torch.Tensor, counts: BatchCounts) -> torch.Tensor:
    """Σ loss·mask / (tokens in the whole step). DAPO's normalization, and SFT's NLL."""
    return (per_token * mask).sum() / max(counts.tokens, 1.0)


def aggregate_sequence_mean(per_token: torch.Tensor, mask: torch.Tensor, counts: BatchCounts) -> torch.Tensor:
    """Mean over sequences of each sequence's token mean (GRPO, arXiv:2402.03300 eq. 3)."""
    per_sequence = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)  # [B]
    return per_sequence.sum() / max(counts.sequences, 1.0)


def aggregate_micro_batch_token_mean(per_token: torch.Tensor, mask: torch.Tensor, counts: BatchCounts) -> torch.Tensor:
    """Token mean within this micro-batch, averaged over micro-batches (BNPO, TRL's definition)."""
    return (per_token * mask).sum() / mask.sum().clamp(min=1.0) / counts.micro_batches


def aggregate_sequence_sum(per_token: torch.Tensor, mask: torch.Tensor, counts: BatchCounts) -> torch.Tensor:
    """Mean over sequences of each sequence's token *sum*: LUSPO, GSPO scaled by each completion's length so
    long completions are not under-weighted (TRL's loss_type="luspo")."""
    return (per_token * mask).sum() / max(counts.sequences, 1.0)



# ----------------------------------------------------------------------------------------------------------------
# SFT's per-token losses (SFTConfig.loss_type): each position's log p(target) [B, T] -> its loss [B, T], then
# averaged over the step's trained tokens (aggregate_token_mean) whichever it is
# ----------------------------------------------------------------------------------------------------------------


def nll_token_loss(logps: torch.Tensor) -> torch.Tensor:
    """The negative log-likelihood -log p: [B, T] -> [B, T]."""
    return -logps


def dft_token_loss(logps: torch.Tensor) -> torch.Tensor:
    """Dynamic Fine-Tuning (arXiv:2508.05629; TRL's loss_type='dft'): the NLL weighted by the token's own
    probability, held constant, -sg(p) log p with p = exp(log p): [B, T] -> [B, T]. Its gradient is the NLL's
    scaled by p, so tokens the model finds unlikely pull less."""
    return -logps * logps.detach().exp()


SFT_TOKEN_LOSSES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"nll": nll_token_loss, "dft": dft_token_loss}


# ----------------------------------------------------------------------------------------------------------------
# Advantages
# ----------------------------------------------------------------------------------------------------------------


# ----------------------------------------------------------------------------------------------------------------
# The clipped policy objective (GRPO / DAPO / Dr. GRPO / BNPO / GSPO) and the KL penalty
# ----------------------------------------------------------------------------------------------------------------
