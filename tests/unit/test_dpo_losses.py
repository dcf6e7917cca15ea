"""trainers/dpo/losses.py: each loss type's formula on hand-computed values, the f-divergence scores, the sum of
weighted loss types, and LD-DPO's sequence log-probs. (TRL's own losses on one batch: tests/integration/test_dpo.py.)"""

import dataclasses
import math

import pytest
import torch

from trainers.dpo.losses import DPO_LOSSES, LossOptions, PairScores, combined_loss, divergence_scores
from trainers.dpo.trainer import sequence_logps


def sig(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def pairs(chosen=(-2.0, -1.0), rejected=(-3.0, -0.5), ref_chosen=(-2.5, -1.0), ref_rejected=(-2.0, -1.5),
          chosen_tokens=(2.0, 4.0), rejected_tokens=(1.0, 2.0)) -> PairScores:
    t = lambda v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    token_logps = t([[-1.0, -1.0, 0.0], [-0.25, -0.25, -0.5]])  # chosen per-token log-probs, masked below
    mask = t([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    return PairScores(t(chosen), t(rejected), t(ref_chosen), t(ref_rejected), t(chosen_tokens), t(rejected_tokens),
                      token_logps, mask)


# pair 0: chosen log-ratio 0.5, rejected log-ratio -1.0 (margin 1.5); pair 1: 0.0 and 1.0 (margin -1.0)
MARGINS, CHOSEN_LR, REJECTED_LR = (1.5, -1.0), (0.5, 0.0), (-1.0, 1.0)


@pytest.mark.parametrize("loss_type, expected", [
    ("sigmoid", lambda b, m, c, r, nc, nr, e: -math.log(sig(b * m))),
    ("hinge", lambda b, m, c, r, nc, nr, e: max(0.0, 1 - b * m)),
    ("ipo", lambda b, m, c, r, nc, nr, e: (c / nc - r / nr - 1 / (2 * b)) ** 2),
    ("sigmoid_norm", lambda b, m, c, r, nc, nr, e: -math.log(sig(b * (c / nc - r / nr)))),
    ("robust", lambda b, m, c, r, nc, nr, e: (-(1 - e) * math.log(sig(b * m)) + e * math.log(sig(-b * m)))
     / (1 - 2 * e)),
    ("exo_pair", lambda b, m, c, r, nc, nr, e: sig(b * m) * (math.log(sig(b * m)) - math.log(1 - e))
     + sig(-b * m) * (math.log(sig(-b * m)) - math.log(e))),
    ("nca_pair", lambda b, m, c, r, nc, nr, e: -math.log(sig(b * c)) - 0.5 * math.log(sig(-b * c))
     - 0.5 * math.log(sig(-b * r))),
    ("bco_pair", lambda b, m, c, r, nc, nr, e: -math.log(sig(b * c)) - math.log(sig(-b * r))),
    ("sppo_hard", lambda b, m, c, r, nc, nr, e: (c - 0.5 / b) ** 2 + (r + 0.5 / b) ** 2),
    ("apo_zero", lambda b, m, c, r, nc, nr, e: (1 - sig(b * c)) + sig(b * r)),
    ("apo_down", lambda b, m, c, r, nc, nr, e: sig(b * c) + (1 - sig(b * (c - r)))),
    ("discopop", lambda b, m, c, r, nc, nr, e: -math.log(sig(b * m)) * (1 - sig(b * m / 0.05))
     + math.exp(-b * m) * sig(b * m / 0.05)),
])
def test_each_pairwise_loss_is_its_formula(loss_type, expected):
    options = LossOptions(beta=0.5, label_smoothing=0.1)
    got = DPO_LOSSES[loss_type](pairs(), options).tolist()
    want = [expected(0.5, m, c, r, nc, nr, 0.1) for m, c, r, nc, nr in
            zip(MARGINS, CHOSEN_LR, REJECTED_LR, (2.0, 4.0), (1.0, 2.0))]
    assert got == pytest.approx(want, rel=1e-12)


def test_aot_compares_the_micro_batchs_sorted_margins():
    # policy margins chosen - rejected: 1.0, -0.5 -> sorted -0.5, 1.0; reference: -0.5, 0.5 -> sorted -0.5, 0.5
    options = LossOptions(beta=0.5, label_smoothing=0.1)
    want = [-math.log(sig(0.5 * d)) * 0.9 - math.log(sig(-0.5 * d)) * 0.1 for d in (0.0, 0.5)]
    assert DPO_LOSSES["aot"](pairs(), options).tolist() == pytest.approx(want, rel=1e-12)
    # unpaired: sorted chosen log-ratios (0, 0.5) against sorted rejected ones (-1, 1)
    want = [-math.log(sig(0.5 * d)) * 0.9 - math.log(sig(-0.5 * d)) * 0.1 for d in (1.0, -0.5)]
    assert DPO_LOSSES["aot_unpaired"](pairs(), options).tolist() == pytest.approx(want, rel=1e-12)


def test_sft_averages_to_the_chosen_token_mean():
    # chosen tokens: -1, -1 (pair 0) and -0.25, -0.25, -0.5 (pair 1): NLL sums 2 and 1, 2 pairs per 5 tokens;
    # the mean over pairs, 0.6, is the token mean 3 / 5 (TRL's, over the micro-batch)
    assert DPO_LOSSES["sft"](pairs(), LossOptions()).tolist() == pytest.approx([0.8, 0.4])
    # the trainer's scale: the step's pairs per chosen token (here 10 pairs, 40 tokens)
    scaled = dataclasses.replace(pairs(), sft_scale=0.25)
    assert DPO_LOSSES["sft"](scaled, LossOptions()).tolist() == pytest.approx([0.5, 0.25])


def test_f_divergence_scores():
    logratios = torch.tensor([0.5, -1.0], dtype=torch.float64)
    def score(kind, **kw):
        return divergence_scores(logratios, LossOptions(f_divergence_type=kind, **kw)).tolist()

    assert score("reverse_kl") == [0.5, -1.0]
    assert score("forward_kl") == pytest.approx([1 - math.exp(-0.5), 1 - math.exp(1.0)])
    assert score("js_divergence") == pytest.approx([math.log(2) + math.log(sig(0.5)), math.log(2) + math.log(sig(-1))])
    alpha = [(math.exp(-0.7 * x) - 1) / -0.7 for x in (0.5, -1.0)]
    assert score("alpha_divergence", f_alpha_divergence_coef=0.3) == pytest.approx(alpha)
    assert score("alpha_divergence", f_alpha_divergence_coef=1.0) == [0.5, -1.0]  # its limit: the log-ratio


def test_loss_types_are_summed_with_their_weights():
    options, scores = LossOptions(beta=0.5), pairs()
    want = DPO_LOSSES["sigmoid"](scores, options) + 0.2 * DPO_LOSSES["sft"](scores, options)
    assert combined_loss(scores, options, ["sigmoid", "sft"], [1.0, 0.2]).tolist() == pytest.approx(want.tolist())
    weights = torch.tensor([0.5, 2.0], dtype=torch.float64)  # WPO's, on every term
    weighted = combined_loss(scores, options, ["sigmoid", "sft"], [1.0, 0.2], weights)
    assert weighted.tolist() == pytest.approx((want * weights).tolist())


def test_ld_alpha_weights_the_tokens_past_the_shorter_completion():
    # pair: chosen has 3 completion tokens, rejected 1; rows are [chosen, rejected]
    token_logps = torch.tensor([[0.0, -1.0, -2.0, -4.0], [0.0, -1.0, 0.0, 0.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0], [0.0, 1.0, 0.0, 0.0]])
    assert sequence_logps(token_logps, mask, None).tolist() == [-7.0, -1.0]
    # the chosen one's first token counts fully, the next two at 0.5
    assert sequence_logps(token_logps, mask, 0.5).tolist() == [-1.0 - 0.5 * 6.0, -1.0]
