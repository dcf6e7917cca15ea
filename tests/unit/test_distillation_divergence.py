"""On-policy distillation's divergence (trainers/distillation/divergence.py) against TRL 1.16's
``_chunked_divergence_loss`` on fixed tensors: the loss, the student's entropy and the gradients, for forward KL,
reverse KL and the generalized JSD, with and without a temperature; the same whatever the chunk."""

import pytest
import torch

from trainers.distillation.divergence import (
    chunked_divergence,
    chunked_support_divergence,
    support_divergence,
    token_divergence,
)

try:
    from trl.trainer.distillation_trainer import _chunked_divergence_loss

    HAVE_TRL = True
except ImportError:  # not installed (CI)
    HAVE_TRL = False

# TRL 1.16's _chunked_divergence_loss on batch() (student and teacher biases, mean over the valid positions):
# (beta, temperature) -> [loss, student entropy sum, sum |grad student hidden|, sum |grad student weight|,
# sum |grad student bias|], obtained by running it on 2026-11-27 (test_equal_to_trl_computed_live checks them)
TRL = {
    (0.0, 1.0): [1.850117564201355, 20.40420913696289, 1.549651861190796, 6.638579368591309, 0.7192748785018921],
    (0.0, 0.7): [3.032855272293091, 17.573108673095703, 2.9756600856781006, 11.885581970214844, 1.3846980333328247],
    (0.5, 1.0): [0.3327915668487549, 20.40420913696289, 0.1825331300497055, 0.812179684638977, 0.10927831381559372],
    (0.5, 0.7): [0.4386245906352997, 17.573108673095703, 0.23640434443950653, 0.9964075088500977, 0.15446951985359192],
    (1.0, 1.0): [2.3303158283233643, 20.40420913696289, 1.7426778078079224, 7.992123603820801, 1.0327733755111694],
    (1.0, 0.7): [4.122379779815674, 17.573108673095703, 3.5888545513153076, 15.499777793884277, 2.239021062850952],
    (0.1, 1.0): [0.13519124686717987, 20.40420913696289, 0.08291783928871155, 0.3729150891304016, 0.04676569998264313],
    (0.1, 0.7): [0.1862553060054779, 17.573108673095703, 0.11050059646368027, 0.4575890302658081, 0.06824538111686707],
}


def batch():
    """2 x 5 positions, a student of width 8 and a teacher of width 12 over a vocabulary of 37, 7 positions valid."""
    g = torch.Generator().manual_seed(0)
    student_hidden, teacher_hidden = torch.randn(2, 5, 8, generator=g), torch.randn(2, 5, 12, generator=g)
    student_weight, teacher_weight = torch.randn(37, 8, generator=g) * 0.5, torch.randn(37, 12, generator=g) * 0.5
    student_bias, teacher_bias = torch.randn(37, generator=g) * 0.1, torch.randn(37, generator=g) * 0.1
    mask = torch.ones(2, 5)
    mask[0, 3:], mask[1, 0] = 0, 0
    return student_hidden, teacher_hidden, student_weight, teacher_weight, student_bias, teacher_bias, mask


def ours(beta: float, temperature: float, chunk: int | None = None):
    """The mean divergence over the valid positions, the entropy sum, and the student's three gradients."""
    student_hidden, teacher_hidden, student_weight, teacher_weight, student_bias, teacher_bias, mask = batch()
    for tensor in (student_hidden, student_weight, student_bias):
        tensor.requires_grad_(True)
    valid = mask.bool()
    divergence, entropy = chunked_divergence(student_hidden[valid], student_weight, teacher_hidden[valid],
                                             teacher_weight, beta, temperature, student_bias, teacher_bias, chunk)
    loss = divergence.sum() / valid.sum()
    loss.backward()
    return loss.detach(), entropy.sum(), student_hidden.grad, student_weight.grad, student_bias.grad


@pytest.mark.parametrize("beta,temperature", list(TRL))
def test_equal_to_trls_loss_entropy_and_gradients(beta, temperature):
    loss, entropy, *grads = ours(beta, temperature)
    measured = [float(loss), float(entropy)] + [float(g.abs().sum()) for g in grads]
    assert measured == pytest.approx(TRL[(beta, temperature)], rel=1e-5)


@pytest.mark.skipif(not HAVE_TRL, reason="TRL is not installed")
@pytest.mark.parametrize("beta,temperature", list(TRL))
def test_equal_to_trl_computed_live(beta, temperature):
    student_hidden, teacher_hidden, student_weight, teacher_weight, student_bias, teacher_bias, mask = batch()
    for tensor in (student_hidden, student_weight, student_bias):
        tensor.requires_grad_(True)
    loss, entropy, _ = _chunked_divergence_loss(student_hidden, teacher_hidden, student_weight, teacher_weight, mask,
                                                beta, student_lm_head_bias=student_bias,
                                                teacher_lm_head_bias=teacher_bias, temperature=temperature)
    loss.backward()
    theirs = [loss, entropy, student_hidden.grad, student_weight.grad, student_bias.grad]
    assert [float(loss), float(entropy)] == pytest.approx(TRL[(beta, temperature)][:2], rel=1e-6)  # the stored
    for mine, expected in zip(ours(beta, temperature), theirs):
        torch.testing.assert_close(mine, expected.detach(), rtol=1e-5, atol=1e-6)


def test_the_chunk_changes_nothing_and_the_teacher_gets_no_gradient():
    whole = ours(0.5, 1.0, chunk=100)
    for chunk in (1, 3):
        for mine, expected in zip(ours(0.5, 1.0, chunk=chunk), whole):
            torch.testing.assert_close(mine, expected, rtol=1e-6, atol=1e-7)
    student_hidden, teacher_hidden, student_weight, teacher_weight, *_ = batch()
    teacher_weight.requires_grad_(True)
    divergence, _ = chunked_divergence(student_hidden[0], student_weight.requires_grad_(True), teacher_hidden[0],
                                       teacher_weight, 0.5, chunk=2)
    divergence.sum().backward()
    assert teacher_weight.grad is None and student_weight.grad is not None


def test_the_divergences_by_hand():
    student = torch.tensor([[0.0, 1.0, 2.0]])
    teacher = torch.tensor([[1.0, 0.0, -1.0]])
    ps, pt = student.softmax(-1), teacher.softmax(-1)
    forward = (pt * (pt.log() - ps.log())).sum()
    reverse = (ps * (ps.log() - pt.log())).sum()
    m = 0.7 * ps + 0.3 * pt  # beta 0.3: the mixture (1 - beta) p_s + beta p_t
    jsd = 0.3 * (pt * (pt.log() - m.log())).sum() + 0.7 * (ps * (ps.log() - m.log())).sum()
    assert float(token_divergence(student, teacher, 0.0)[0]) == pytest.approx(float(forward), rel=1e-6)
    assert float(token_divergence(student, teacher, 1.0)[0]) == pytest.approx(float(reverse), rel=1e-6)
    assert float(token_divergence(student, teacher, 0.3)[0]) == pytest.approx(float(jsd), rel=1e-6)
    assert float(token_divergence(student, teacher, 0.3)[1]) == pytest.approx(float(-(ps * ps.log()).sum()), rel=1e-6)
    with pytest.raises(ValueError, match="one vocabulary"):
        chunked_divergence(torch.zeros(1, 2), torch.zeros(3, 2), torch.zeros(1, 2), torch.zeros(4, 2), 0.5)


def test_no_logits_are_kept_for_backward():
    """With no budget for kept gradients, what autograd keeps between forward and backward is the inputs (both
    models' hidden states and heads: 480 + 720 + 296 + 444 = 1,940 values here) and the divergence (60), never the
    chunks' logits (60 positions x a vocabulary of 37: another 2,220 values, in chunks of 4 positions)."""
    g = torch.Generator().manual_seed(0)
    student_hidden = torch.randn(60, 8, generator=g, requires_grad=True)
    student_weight = torch.randn(37, 8, generator=g, requires_grad=True)
    storages = {}

    def keep(tensor):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes() // 4  # float32 values
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        divergence, _ = chunked_divergence(student_hidden, student_weight, torch.randn(60, 12, generator=g),
                                           torch.randn(37, 12, generator=g), 0.5, chunk=4, saved_bytes=0)
    divergence.sum().backward()
    assert student_weight.grad is not None and 0 < sum(storages.values()) <= 2000


# ---------------------------------------------------------------- a served teacher's support (top-k log-probs)


def support_of(teacher_logits: torch.Tensor, k: int, sampled: torch.Tensor) -> tuple:
    """What a served teacher gives: its top-k tokens and log-probs, then the sampled token's (valid unless it is
    among the top k)."""
    log_pt = teacher_logits.log_softmax(-1)
    top_logps, top_ids = log_pt.topk(k, -1)  # [N, k]
    ids = torch.cat([top_ids, sampled.unsqueeze(-1)], -1)
    logps = torch.cat([top_logps, log_pt.gather(-1, sampled.unsqueeze(-1))], -1)
    valid = torch.ones_like(ids, dtype=torch.bool)
    valid[:, k] = ~(top_ids == sampled.unsqueeze(-1)).any(-1)
    return ids, logps, valid


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_a_support_of_the_whole_vocabulary_is_the_full_divergence_and_smaller_ones_a_lower_bound(beta):
    student_hidden, teacher_hidden, student_weight, teacher_weight, student_bias, teacher_bias, mask = batch()
    valid_rows = mask.bool()
    hidden, teacher = student_hidden[valid_rows], teacher_hidden[valid_rows] @ teacher_weight.t() + teacher_bias
    sampled = torch.arange(hidden.shape[0]) * 5 % 37
    full, entropy = chunked_divergence(hidden, student_weight, teacher_hidden[valid_rows], teacher_weight, beta,
                                       student_bias=student_bias, teacher_bias=teacher_bias)
    for add_tail in (True, False):
        exact, exact_entropy = chunked_support_divergence(hidden, student_weight, *support_of(teacher, 37, sampled),
                                                          beta, student_bias=student_bias, add_tail=add_tail)
        torch.testing.assert_close(exact, full, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(exact_entropy, entropy)
    previous = torch.zeros_like(full)
    for k in (1, 4, 16, 36):  # with the tail: merging outcomes never raises the divergence, nor does refining lower it
        coarse, _ = chunked_support_divergence(hidden, student_weight, *support_of(teacher, k, sampled), beta,
                                               student_bias=student_bias)
        slack = 1e-4 * full + 1e-6  # float32 rounding (at k = 36 the partition is the full one)
        assert bool((coarse <= full + slack).all()) and bool((coarse >= previous - slack).all()), k
        previous = coarse
    assert float(previous.sum()) > 0.9 * float(full.sum())


def test_a_support_divergence_by_hand_and_its_gradient_is_finite():
    """Vocabulary 3, the teacher's top-1 token 0 and the sampled token 1: outcomes {0, 1, rest = {2}}; and a
    support of the whole vocabulary gives a finite gradient though the rest is empty."""
    logits = torch.tensor([[1.0, 0.0, -1.0]], requires_grad=True)
    teacher = torch.tensor([[0.7, 0.2, 0.1]]).log()
    ids, valid = torch.tensor([[0, 1]]), torch.tensor([[True, True]])
    log_ps = logits.log_softmax(-1)
    got = support_divergence(log_ps, ids, teacher.gather(-1, ids), valid, 0.0)
    p, q = teacher.exp()[0], log_ps.exp()[0]
    assert float(got) == pytest.approx(float((p * (p.log() - q.log())).sum()), rel=1e-5)  # all 3 outcomes listed
    one = support_divergence(log_ps, ids[:, :1], teacher[:, :1], valid[:, :1], 1.0)  # {0, rest}
    rest_q, rest_p = 1 - q[0], 1 - p[0]
    by_hand = q[0] * (q[0].log() - p[0].log()) + rest_q * (rest_q.log() - rest_p.log())
    assert float(one) == pytest.approx(float(by_hand), rel=1e-5)
    everything = support_divergence(log_ps, torch.tensor([[0, 1, 2]]), teacher, torch.ones(1, 3, dtype=torch.bool),
                                    0.5)
    everything.sum().backward()
    assert torch.isfinite(logits.grad).all() and logits.grad.abs().sum() > 0


def test_no_positions_give_an_empty_divergence_in_the_graph():
    weight = torch.randn(37, 8, requires_grad=True)
    divergence, _ = chunked_divergence(torch.zeros(0, 8), weight, torch.zeros(0, 12), torch.randn(37, 12), 0.5)
    divergence.sum().backward()
    assert divergence.shape == (0,) and weight.grad is not None and float(weight.grad.abs().sum()) == 0


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
def test_gradients_made_again_in_backward_equal_the_kept_ones(beta):
    """Past the budget (saved_bytes=0) backward makes each chunk's gradient again from both models' hidden states:
    the same gradients as when they are kept."""
    results = []
    for saved_bytes in (0, 2**30):
        student_hidden, teacher_hidden, student_weight, teacher_weight, student_bias, teacher_bias, _ = batch()
        for tensor in (student_hidden, student_weight, student_bias):
            tensor.requires_grad_(True)
        divergence, _ = chunked_divergence(student_hidden.flatten(0, 1), student_weight, teacher_hidden.flatten(0, 1),
                                           teacher_weight, beta, 0.7, student_bias, teacher_bias, chunk=3,
                                           saved_bytes=saved_bytes)
        (divergence * torch.arange(10.0)).sum().backward()  # a different weight per position
        results.append([student_hidden.grad, student_weight.grad, student_bias.grad])
    for made_again, kept in zip(*results):
        torch.testing.assert_close(made_again, kept)
