"""The per-token divergence of on-policy distillation (TRL 1.16's DistillationTrainer; Agarwal et al. 2024,
arXiv:2306.13649), computed from both models' hidden states and output heads a chunk of positions at a time, so
that neither model's [positions, vocabulary] logits exist beyond one chunk (``chunked_divergence``: its gradient
written out, ``DivergenceHead``; each chunk's gradient of the logits kept within output_head's budget, made again
past it).

``beta`` picks the divergence, as TRL's: 0 is the forward KL(teacher || student), 1 the reverse KL(student ||
teacher), anything between the generalized Jensen-Shannon divergence beta KL(teacher || m) + (1 - beta)
KL(student || m) with the mixture m = (1 - beta) p_student + beta p_teacher. Both distributions are softmaxes of
the logits over ``temperature``. The gradient reaches the student only (its hidden states and head); the teacher's
logits are computed without one.

A served teacher gives only its top-k log-probs per position (``chunked_support_divergence``): the divergence is
then between both distributions coarsened to those tokens (and the sampled one), plus, with ``add_tail``, one
outcome for the rest of the vocabulary. Merging outcomes never increases an f-divergence (the data-processing
inequality), so this is a lower bound of the full divergence, equal to it when the support is the vocabulary.
"""

from __future__ import annotations

import math

import torch
from torch.utils.checkpoint import checkpoint

from trainers.model.output_head import SAVED_BYTES, chunk_positions, kept_positions


def token_divergence(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """[c, V] float32 logits (already over the temperature) -> (the divergence [c], the student's entropy [c])."""
    log_ps = student_logits.log_softmax(-1)
    entropy = -(log_ps.exp() * log_ps).sum(-1)
    return divergence_of(log_ps, teacher_logits.log_softmax(-1), beta), entropy.detach()


def divergence_of(log_ps: torch.Tensor, log_pt: torch.Tensor, beta: float, valid: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """The divergence ``beta`` picks between two distributions given as log-probabilities [c, K] over the same K
    outcomes -> [c]. ``valid`` [c, K] bool: the outcomes that exist (others count nothing; both log-probs must be
    finite where valid)."""
    if valid is not None:  # zeros where invalid keep every term and gradient finite; the terms are masked after
        log_ps, log_pt = log_ps.masked_fill(~valid, 0.0), log_pt.masked_fill(~valid, 0.0)
    ps, pt = log_ps.exp(), log_pt.exp()
    if beta == 0.0:  # forward KL(teacher || student)
        terms = pt * (log_pt - log_ps)
    elif beta == 1.0:  # reverse KL(student || teacher)
        terms = ps * (log_ps - log_pt)
    else:
        log_m = torch.logaddexp(log_ps + math.log(1 - beta), log_pt + math.log(beta))  # log of the mixture
        terms = beta * pt * (log_pt - log_m) + (1 - beta) * ps * (log_ps - log_m)
    if valid is not None:
        terms = terms * valid
    return terms.sum(-1)


def _logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float
            ) -> torch.Tensor:
    """[c, H] -> [c, V] float32 logits over the temperature: the product in the weight's dtype, then float32 (as
    the model's own head followed by an upcast, and as trainers/model/output_head.py scores the policy)."""
    logits = hidden.to(weight.dtype) @ weight.t()
    if bias is not None:
        logits = logits + bias
    return logits.float() / temperature


def _empty(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """[0] divergence and entropy for no positions, in the graph of the student's weights (a process without loss
    tokens still takes part in the backward's gradient synchronization)."""
    empty = _logits(hidden, weight, bias, 1.0).sum(-1)  # [0]
    return empty, empty.detach()


def divergence_gradient(log_ps: torch.Tensor, log_pt: torch.Tensor, divergence: torch.Tensor, beta: float,
                        ps: torch.Tensor | None = None) -> torch.Tensor:
    """d divergence / d student logits (over the temperature), [c, V], from both log-probabilities [c, V] and the
    divergence [c]: forward KL p_s - p_t; otherwise p_s (g - E_ps[g]) with g the derivative in p_s, log(p_s / p_t)
    for the reverse KL and (1 - beta) log(p_s / m) for the generalized JSD. ``ps``: exp(log_ps) if at hand (it is
    overwritten)."""
    ps = log_ps.exp() if ps is None else ps
    if beta == 0.0:
        return ps.sub_(log_pt.exp())
    if beta == 1.0:  # E_ps[log ps - log pt] is the divergence itself
        return (log_ps - log_pt).sub_(divergence.unsqueeze(1)).mul_(ps)
    log_m = torch.logaddexp(log_ps + math.log(1 - beta), log_pt + math.log(beta))
    g = (log_ps - log_m).mul_(1 - beta)
    return g.sub_((ps * g).sum(-1, keepdim=True)).mul_(ps)


class DivergenceHead(torch.autograd.Function):
    """(student hidden [N, H_s], weight [V, H_s], bias, teacher hidden [N, H_t], weight [V, H_t], bias) ->
    (divergence [N], the student's entropy [N]) float32, ``chunk`` positions at a time, the products in ``dtype``.

    The gradient is written out (``divergence_gradient``) instead of traced: autograd would keep every chunk's
    intermediate [c, V] tensors, or, under checkpoint, run the chunk's forward again and then its backward op by op.
    Each chunk's d divergence / d logits is kept for backward while the kept ones fit in ``saved_bytes`` (output_head's
    budget), and made again from both models' hidden states otherwise. Only the student gets a gradient."""

    @staticmethod
    def forward(ctx, student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias,
                beta: float, temperature: float, chunk: int, dtype: torch.dtype, saved_bytes: int):
        N, V = student_hidden.shape[0], student_weight.shape[0]
        divergence = torch.empty(N, device=student_hidden.device, dtype=torch.float32)
        entropy = torch.empty_like(divergence)
        kept_rows = kept_positions(N, V, chunk, saved_bytes) if any(ctx.needs_input_grad[:3]) else 0
        kept = torch.empty((kept_rows, V), device=student_hidden.device, dtype=torch.float32)
        weight = student_weight.to(dtype)  # the product's dtype, cast once per pass (not per chunk)
        for start in range(0, N, chunk):
            rows = slice(start, start + chunk)
            log_ps, log_pt = _chunk_log_probs(student_hidden[rows], weight, student_bias, teacher_hidden[rows],
                                              teacher_weight, teacher_bias, temperature)
            ps = log_ps.exp()
            entropy[rows] = -(ps * log_ps).sum(-1)
            if beta == 1.0:  # KL(ps || pt) = -H(ps) - E_ps[log pt]
                divergence[rows] = -entropy[rows] - (ps * log_pt).sum(-1)
            else:
                divergence[rows] = divergence_of(log_ps, log_pt, beta)
            if start < kept_rows:
                kept[rows] = divergence_gradient(log_ps, log_pt, divergence[rows], beta, ps)
        ctx.kept = kept
        ctx.save_for_backward(student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight,
                              teacher_bias, divergence)
        ctx.beta, ctx.temperature, ctx.chunk, ctx.dtype = beta, temperature, chunk, dtype
        ctx.mark_non_differentiable(entropy)
        return divergence, entropy

    @staticmethod
    def backward(ctx, grad_divergence, grad_entropy):
        student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias, divergence = \
            ctx.saved_tensors
        need = ctx.needs_input_grad
        # float32 sums whatever the weights' dtype (as output_head's ChunkedHead)
        grads = [torch.zeros(x.shape, device=x.device, dtype=torch.float32) if x is not None and need[i] else None
                 for i, x in enumerate((student_hidden, student_weight, student_bias))]
        grad_hidden, grad_weight, grad_bias = grads
        kept, ctx.kept = ctx.kept, None
        weight = student_weight.to(ctx.dtype)
        N = student_hidden.shape[0] if grad_divergence is not None else 0
        for start in range(0, N, ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            if start < kept.shape[0]:
                grad = kept[rows]
            else:
                log_ps, log_pt = _chunk_log_probs(student_hidden[rows], weight, student_bias, teacher_hidden[rows],
                                                  teacher_weight, teacher_bias, ctx.temperature)
                grad = divergence_gradient(log_ps, log_pt, divergence[rows], ctx.beta)
            grad = grad.mul_(grad_divergence[rows].unsqueeze(1) / ctx.temperature)  # [c, V]: d loss / d logits
            if grad_hidden is not None:
                grad_hidden[rows] = (grad.to(ctx.dtype) @ weight).float()
            if grad_weight is not None:
                grad_weight.addmm_(grad.t(), student_hidden[rows].float())
            if grad_bias is not None:
                grad_bias.add_(grad.sum(0))
        return (*(None if g is None else g.to(x.dtype)
                  for g, x in zip(grads, (student_hidden, student_weight, student_bias))), *([None] * 8))


def _chunk_log_probs(student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias,
                     temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Both models' log-probabilities [c, V] float32 at one chunk of positions (no gradient); each product in its
    head's dtype (the student's already cast to the product's)."""
    with torch.no_grad():
        log_ps = _logits(student_hidden, student_weight, student_bias, temperature)
        log_pt = _logits(teacher_hidden, teacher_weight, teacher_bias, temperature)
        return log_ps.log_softmax(-1), log_pt.log_softmax(-1)


def chunked_divergence(student_hidden: torch.Tensor, student_weight: torch.Tensor, teacher_hidden: torch.Tensor,
                       teacher_weight: torch.Tensor, beta: float, temperature: float = 1.0,
                       student_bias: torch.Tensor | None = None, teacher_bias: torch.Tensor | None = None,
                       chunk: int | None = None, saved_bytes: int = SAVED_BYTES) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position divergence [N] (float32, with the student's gradient) and the student's entropy [N] (none)
    from the student's hidden states [N, H_s] and head [V, H_s] and the teacher's [N, H_t], [V, H_t] (the widths may
    differ; the vocabulary must not). ``chunk`` positions at a time (default: about output_head's CHUNK_BYTES of
    float32 logits per model); backward keeps each chunk's [c, V] gradient of the logits up to ``saved_bytes`` in
    all and makes the others again, so no more than that outlives the forward (``DivergenceHead``). The products
    run in the autocast dtype when autocast is on, else in the student's weight dtype."""
    if student_weight.shape[0] != teacher_weight.shape[0]:
        raise ValueError(f"the student's head has {student_weight.shape[0]} outputs and the teacher's "
                         f"{teacher_weight.shape[0]}: distillation needs one vocabulary.")
    if student_hidden.shape[0] == 0:  # no loss positions here: an empty result that still reaches every weight
        return _empty(student_hidden, student_weight, student_bias)
    chunk = chunk or chunk_positions(student_weight.shape[0])
    device = student_hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else student_weight.dtype
    with torch.autocast(device, enabled=False):
        return DivergenceHead.apply(student_hidden, student_weight, student_bias, teacher_hidden.detach(),
                                    teacher_weight.detach(), None if teacher_bias is None else teacher_bias.detach(),
                                    beta, temperature, chunk, dtype, saved_bytes)


# The least tail mass a served teacher's distribution gets outside its top-k (where its top-k sums to 1 in float32
# although the rest of the vocabulary has some probability): as TRL's experimental server distillation.
MIN_TAIL = 1e-7


def support_divergence(log_ps: torch.Tensor, ids: torch.Tensor, teacher_logps: torch.Tensor, valid: torch.Tensor,
                       beta: float, add_tail: bool = True) -> torch.Tensor:
    """The divergence over a teacher's support (``chunked_support_divergence``) from the student's full
    log-probabilities ``log_ps`` [c, V] -> [c]."""
    ids = torch.where(valid, ids, ids[:, :1])  # an invalid column repeats the first (the teacher's top token)
    student = log_ps.gather(-1, ids)  # [c, S]
    teacher = teacher_logps
    if add_tail:  # one more outcome: the rest of the vocabulary, for both
        covers = valid.sum(-1) >= log_ps.shape[-1]  # [c]: the support is the whole vocabulary (no rest)
        rest = log_ps.scatter(-1, ids, float("-inf"))
        rest[:, 0] = torch.where(covers, 0.0, rest[:, 0])  # a finite stand-in: log-sum-exp of nothing has no gradient
        student_tail = torch.logsumexp(rest, -1, keepdim=True)  # [c, 1]: log of the student's mass outside
        # in float64: 1 - a sum close to 1 keeps its digits (the tail is what float32 would round away)
        mass = teacher.double().masked_fill(~valid, float("-inf")).exp().sum(-1, keepdim=True)
        teacher_tail = torch.log((1.0 - mass).clamp(min=MIN_TAIL)).to(teacher.dtype)
        student, teacher = torch.cat([student, student_tail], -1), torch.cat([teacher, teacher_tail], -1)
        valid = torch.cat([valid, ~covers.unsqueeze(-1)], -1)
    else:  # both renormalized over the support
        student = student.masked_fill(~valid, float("-inf")).log_softmax(-1)
        teacher = teacher.masked_fill(~valid, float("-inf")).log_softmax(-1)
    return divergence_of(student, teacher, beta, valid)


def _support_chunk(student_hidden, student_weight, student_bias, ids, teacher_logps, valid, beta, temperature,
                   add_tail):
    """One chunk of ``chunked_support_divergence``: the student's logits [c, V] are made here (again in backward
    under checkpoint)."""
    log_ps = _logits(student_hidden, student_weight, student_bias, temperature).log_softmax(-1)  # [c, V]
    entropy = -(log_ps.exp() * log_ps).sum(-1)
    return support_divergence(log_ps, ids, teacher_logps, valid, beta, add_tail), entropy.detach()


def chunked_support_divergence(student_hidden: torch.Tensor, student_weight: torch.Tensor, ids: torch.Tensor,
                               teacher_logps: torch.Tensor, valid: torch.Tensor, beta: float,
                               temperature: float = 1.0, student_bias: torch.Tensor | None = None,
                               add_tail: bool = True, chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The divergence over a support given by the teacher (a served one): per position [N], the tokens ``ids``
    [N, S] with the teacher's log-probabilities ``teacher_logps`` [N, S] (over its full vocabulary, at the
    temperature), ``valid`` [N, S] saying which columns count (the first always does; a token listed twice counts
    once). ``add_tail``: both distributions get one more outcome, the rest of the vocabulary (the student's from its
    full softmax, the teacher's 1 - its listed mass); else both are renormalized over the support. Returns the
    divergence [N] (with the student's gradient) and the student's entropy over the full vocabulary [N]; chunked and
    recomputed in backward as ``chunked_divergence``."""
    if student_hidden.shape[0] == 0:
        return _empty(student_hidden, student_weight, student_bias)
    chunk = chunk or chunk_positions(student_weight.shape[0])
    tracked = torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                              for t in (student_hidden, student_weight, student_bias))
    teacher_logps = teacher_logps.float().masked_fill(~valid, 0.0)
    divergences, entropies = [], []
    for start in range(0, student_hidden.shape[0], chunk):
        rows = slice(start, start + chunk)
        inputs = (student_hidden[rows], student_weight, student_bias, ids[rows], teacher_logps[rows], valid[rows],
                  beta, temperature, add_tail)
        run = checkpoint(_support_chunk, *inputs, use_reentrant=False) if tracked else _support_chunk(*inputs)
        divergences.append(run[0])
        entropies.append(run[1])
    return torch.cat(divergences), torch.cat(entropies)
