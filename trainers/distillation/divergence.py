"""The per-token divergence of on-policy distillation (TRL 1.16's DistillationTrainer; Agarwal et al. 2024,
arXiv:2306.13649), computed from both models' hidden states and output heads a chunk of positions at a time, so
that neither model's [positions, vocabulary] logits exist beyond one chunk.

``beta`` picks the divergence, as TRL's: 0 is the forward KL(teacher || student), 1 the reverse KL(student ||
teacher), anything between the generalized Jensen-Shannon divergence beta KL(teacher || m) + (1 - beta)
KL(student || m) with the mixture m = (1 - beta) p_student + beta p_teacher. Both distributions are softmaxes of
the logits over ``temperature``. The gradient reaches the student only (its hidden states and head); the teacher's
logits are computed without one.
"""

from __future__ import annotations

import math

import torch
from torch.utils.checkpoint import checkpoint

from trainers.output_head import chunk_positions


def token_divergence(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """[c, V] float32 logits (already over the temperature) -> (the divergence [c], the student's entropy [c])."""
    log_ps = student_logits.log_softmax(-1)
    log_pt = teacher_logits.log_softmax(-1)
    ps = log_ps.exp()
    entropy = -(ps * log_ps).sum(-1)
    if beta == 0.0:  # forward KL(teacher || student)
        divergence = (log_pt.exp() * (log_pt - log_ps)).sum(-1)
    elif beta == 1.0:  # reverse KL(student || teacher)
        divergence = (ps * (log_ps - log_pt)).sum(-1)
    else:
        log_m = torch.logaddexp(log_ps + math.log(1 - beta), log_pt + math.log(beta))  # log of the mixture
        divergence = beta * (log_pt.exp() * (log_pt - log_m)).sum(-1) + (1 - beta) * (ps * (log_ps - log_m)).sum(-1)
    return divergence, entropy.detach()


def _logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float
            ) -> torch.Tensor:
    """[c, H] -> [c, V] float32 logits over the temperature: the product in the weight's dtype, then float32 (as
    the model's own head followed by an upcast, and as trainers/output_head.py scores the policy)."""
    logits = hidden.to(weight.dtype) @ weight.t()
    if bias is not None:
        logits = logits + bias
    return logits.float() / temperature


def _chunk(student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias, beta,
           temperature):
    """One chunk's divergence and entropy. The teacher's logits are made here, without a gradient, so that under
    checkpoint only the chunk's hidden states are kept for backward (which makes both logits again)."""
    with torch.no_grad():
        teacher_logits = _logits(teacher_hidden, teacher_weight, teacher_bias, temperature)  # [c, V]
    return token_divergence(_logits(student_hidden, student_weight, student_bias, temperature), teacher_logits, beta)


def chunked_divergence(student_hidden: torch.Tensor, student_weight: torch.Tensor, teacher_hidden: torch.Tensor,
                       teacher_weight: torch.Tensor, beta: float, temperature: float = 1.0,
                       student_bias: torch.Tensor | None = None, teacher_bias: torch.Tensor | None = None,
                       chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position divergence [N] (float32, with the student's gradient) and the student's entropy [N] (none)
    from the student's hidden states [N, H_s] and head [V, H_s] and the teacher's [N, H_t], [V, H_t] (the widths may
    differ; the vocabulary must not). ``chunk`` positions at a time (default: about output_head's CHUNK_BYTES of
    float32 logits per model); backward makes each chunk's logits again instead of keeping them, so no
    [positions, vocabulary] tensor outlives its chunk."""
    if student_weight.shape[0] != teacher_weight.shape[0]:
        raise ValueError(f"the student's head has {student_weight.shape[0]} outputs and the teacher's "
                         f"{teacher_weight.shape[0]}: distillation needs one vocabulary.")
    chunk = chunk or chunk_positions(student_weight.shape[0])
    teacher_hidden = teacher_hidden.detach()
    tracked = torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                              for t in (student_hidden, student_weight, student_bias))
    divergences, entropies = [], []
    for start in range(0, student_hidden.shape[0], chunk):
        rows = slice(start, start + chunk)
        inputs = (student_hidden[rows], student_weight, student_bias, teacher_hidden[rows], teacher_weight,
                  teacher_bias, beta, temperature)
        divergence, entropy = checkpoint(_chunk, *inputs, use_reentrant=False) if tracked else _chunk(*inputs)
        divergences.append(divergence)
        entropies.append(entropy)
    return torch.cat(divergences), torch.cat(entropies)
