"""Every GRPO ``loss_type`` on one fixed micro-batch, against (a) the loss computed by hand in plain Python from
the papers' formulas and the aggregations' definitions, and (b) TRL 1.16's ``GRPOTrainer._compute_loss`` on the
same tensors, stored below as numbers (``TRL_1_16_LOSS``; how they were obtained is written there).

The batch: 3 completions of 4 tokens, lengths 4, 3 and 2 (padding holds log-probs far from the old ones, so a
mask that leaked would show), advantages +1.5, -0.8 and 0. The log-ratios log π − log π_old put tokens on both
sides of [1 − ε_low, 1 + ε_high] = [0.8, 1.3] for both signs of the advantage, one token between 1 + ε_low and
1 + ε_high (so swapping ε_low and ε_high shows), and, averaged per completion (GSPO), completion 0 above 1.3
(A > 0: clipped) and completion 1 below 0.8 (A < 0: clipped).

The loss the trainer takes for a micro-batch is composed here as ``GRPOTrainer.compute_loss`` composes it:
``OBJECTIVES[loss_type]`` (sampler weights applied inside), plus ``beta · w · k3`` (``w`` only with
``use_bias_correction_kl``), then ``AGGREGATIONS[loss_type]`` with this one micro-batch's counts.
"""

from __future__ import annotations

import math

import pytest
import torch

from trainers import GRPOConfig
from trainers.grpo.objectives import AGGREGATIONS, OBJECTIVES, GRPOCounts, PolicyInputs, importance_log_weights, k3_kl

# ---------------------------------------------------------------------------------------------------------------
# The fixed micro-batch (plain lists: the hand computation reads these, the code under test their tensors)
# ---------------------------------------------------------------------------------------------------------------

PAD = -0.5  # log π at padding; the old and reference log-probs there are far away (log-ratio 3.5, KL large)
LOGPS = [
    [-0.90, -1.70, -0.35, -2.20],
    [-1.20, -0.60, -2.50, PAD],
    [-0.30, -1.10, PAD, PAD],
]
# log π − log π_old: row 0 [0.75, -0.3, 0.1, 0.6] (ratios 2.117, 0.741, 1.105, 1.822; GSPO mean 0.2875 -> 1.333),
# row 1 [-0.7, 0.35, -0.4, pad] (0.497, 1.419, 0.670; GSPO mean -0.25 -> 0.779), row 2 [0.2, -0.15, pad, pad]
OLD_LOGPS = [
    [-1.65, -1.40, -0.45, -2.80],
    [-0.50, -0.95, -2.10, -4.00],
    [-0.50, -0.95, -4.00, -4.00],
]
REF_LOGPS = [
    [-1.00, -1.50, -0.50, -2.00],
    [-1.00, -0.90, -2.20, -6.00],
    [-0.40, -1.00, -6.00, -6.00],
]
MASK = [
    [1.0, 1.0, 1.0, 1.0],
    [1.0, 1.0, 1.0, 0.0],
    [1.0, 1.0, 0.0, 0.0],
]
ADVANTAGES = [1.5, -0.8, 0.0]
# π_old / π_sampler per token (a rollout function's log-probs, vllm_importance_sampling_mode="token_truncate");
# padding's weight is 1, as sampler_importance_weights gives it
SAMPLER_WEIGHTS = [
    [1.10, 0.90, 1.00, 1.00],
    [0.70, 1.30, 1.05, 1.00],
    [1.20, 0.95, 1.00, 1.00],
]
MAX_COMPLETION_LENGTH = 6  # > the batch's 4 columns, so Dr. GRPO's constant differs from the padded width
B, T = 3, 4
# one micro-batch on one process is the whole optimizer step
COUNTS = GRPOCounts(tokens=sum(map(sum, MASK)), sequences=B, micro_batches=1,
                     max_completion_length=MAX_COMPLETION_LENGTH)

EPSILON, EPSILON_HIGH = 0.2, 0.3  # clip range [0.8, 1.3]: asymmetric, so a swapped bound changes the loss
BETA = 0.05

# name -> (loss_type, GRPOConfig fields, with sampler weights)
CASES = {
    "grpo": ("grpo", {}, False),
    "bnpo": ("bnpo", {}, False),
    "dr_grpo": ("dr_grpo", {}, False),
    "dapo": ("dapo", {}, False),
    "cispo": ("cispo", {"epsilon_high": 2.0}, False),  # ε_max = 2: caps 2.117, not 1.822
    "sapo": ("sapo", {}, False),  # τ_pos 1.0, τ_neg 1.05 (defaults)
    "luspo": ("luspo", {}, False),  # the config's default importance_sampling_level="token"
    "luspo_sequence": ("luspo", {"importance_sampling_level": "sequence"}, False),
    "vespo": ("vespo", {}, False),  # (k, λ) = (2, 3) for A >= 0, (3, 2) for A < 0 (defaults)
    "gspo": ("grpo", {"importance_sampling_level": "sequence"}, False),
    "grpo_delta": ("grpo", {"delta": 1.25}, False),  # two-sided: caps row 1's 1.419 (A < 0) at 1.25
    "grpo_kl": ("grpo", {"beta": BETA}, False),  # use_bias_correction_kl=True (default): + beta · w · k3
    "grpo_kl_unweighted": ("grpo", {"beta": BETA, "use_bias_correction_kl": False}, False),
    "gspo_kl": ("grpo", {"importance_sampling_level": "sequence", "beta": BETA}, False),
    "dapo_sampler": ("dapo", {}, True),
    "vespo_sampler": ("vespo", {}, True),  # folded into VESPO's sequence weight instead of multiplying
}

# TRL 1.16.0's loss on exactly these tensors, for every case above (float64).
#
# How they were obtained: a throwaway script (not in the repository) imported this module's lists and CASES
# and, for each case, called TRL's own method unbound, ``trl.GRPOTrainer._compute_loss(fake, None, inputs)``,
# on a stand-in ``fake = types.SimpleNamespace(...)`` holding what the method reads:
#   loss_type, importance_sampling_level, beta, epsilon_low = EPSILON, epsilon_high (the case's, default
#   EPSILON_HIGH), max_completion_length = 6, top_entropy_quantile = 1.0, off_policy_mask_threshold = None,
#   aux_loss_enabled = False, _entropy_bonus_enabled = False, use_vllm = vllm_importance_sampling_correction =
#   (the case has sampler weights), current_gradient_accumulation_steps = 1, model.training = True,
#   _metrics = {"train": defaultdict(list), "eval": defaultdict(list)}, accelerator = (num_processes=1, gather / reduce /
#   gather_for_metrics returning their input), args = (delta, use_bias_correction_kl, sapo_temperature_pos=1.0,
#   sapo_temperature_neg=1.05, vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0,
#   steps_per_generation=1), TRL's static get_gamma_weights and get_off_policy_mask, and
#   ``_get_per_token_logps_and_entropies`` replaced by a function returning
#   (torch.tensor(LOGPS, float64), zeros, None), which bypasses the model forward;
# inputs = {prompt_ids, prompt_mask: [3, 1] ones, completion_ids: [3, 4] zeros, completion_mask: MASK,
#   advantages: ADVANTAGES, old_per_token_logps: OLD_LOGPS, ref_per_token_logps: REF_LOGPS,
#   num_items_in_batch: tensor(9.0) (the loss tokens of the round, which is this micro-batch),
#   importance_sampling_ratio: SAMPLER_WEIGHTS (only for the "*_sampler" cases)}.
# With one process, one accumulation step and steps_per_generation = 1, TRL's normalizers are those of
# AGGREGATIONS with COUNTS: grpo/sapo the mean of sequence means over the 3 rows, bnpo the token mean,
# dr_grpo Σ / (3 · 6), dapo/cispo/vespo Σ / num_items_in_batch, luspo the mean over rows of sequence sums.
# Printed with repr(loss.item()) and rounded to 12 significant digits. (The script also backpropagated TRL's
# loss: its gradient w.r.t. the log-probs equalled ours bit for bit in every case, and its loss equalled ours
# to the last bit except luspo, 1 ulp apart.)
TRL_1_16_LOSS = {
    "grpo": -0.28738708247,
    "bnpo": -0.472636629918,
    "dr_grpo": -0.236318314959,
    "dapo": -0.472636629918,
    "cispo": 0.964864314331,
    "sapo": -0.733128306975,
    "luspo": -1.41790988975,
    "luspo_sequence": -1.96,
    "vespo": -0.102528461703,
    "gspo": -0.436666666667,
    "grpo_delta": -0.285470864567,
    "grpo_kl": -0.2864137005,
    "grpo_kl_unweighted": -0.286437885394,
    "gspo_kl": -0.435772107441,
    "dapo_sampler": -0.461892302722,
    "vespo_sampler": -0.0910673027489,
}


def config(name: str) -> GRPOConfig:
    loss_type, fields, _ = CASES[name]
    fields = {"epsilon": EPSILON, "epsilon_high": EPSILON_HIGH, "max_completion_length": MAX_COMPLETION_LENGTH,
              **fields}
    return GRPOConfig(output_dir="unused", loss_type=loss_type, **fields)


def tensor(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def our_loss(name: str, logps: torch.Tensor | None = None):
    """The micro-batch loss as GRPOTrainer.compute_loss composes it. Returns (loss, PolicyLoss, logps)."""
    loss_type, _, with_sampler_weights = CASES[name]
    args = config(name)
    logps = tensor(LOGPS).requires_grad_(True) if logps is None else logps
    mask = tensor(MASK)
    inputs = PolicyInputs(logps=logps, old_logps=tensor(OLD_LOGPS), advantages=tensor(ADVANTAGES), mask=mask,
                          sampler_weights=tensor(SAMPLER_WEIGHTS) if with_sampler_weights else None)
    out = OBJECTIVES[loss_type](inputs, args)
    per_token = out.per_token
    if args.beta > 0:
        kl = k3_kl(logps, tensor(REF_LOGPS))
        if args.use_bias_correction_kl:
            kl = kl * torch.exp(importance_log_weights(logps, inputs.old_logps, mask, args.importance_sampling_level))
        per_token = per_token + args.beta * kl
    return AGGREGATIONS[loss_type](per_token, mask, COUNTS), out, logps


# ---------------------------------------------------------------------------------------------------------------
# The hand computation: plain floats, one token at a time
# ---------------------------------------------------------------------------------------------------------------


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def lengths() -> list[int]:
    return [int(sum(row)) for row in MASK]


def log_ratio(i: int, t: int, level: str) -> float:
    """log w: the token's log π − log π_old, or (GSPO) the completion's mean of them over its loss tokens."""
    if level == "token":
        return LOGPS[i][t] - OLD_LOGPS[i][t]
    n = lengths()[i]
    return sum(LOGPS[i][s] - OLD_LOGPS[i][s] for s in range(n)) / n


def vespo_phi(i: int, with_sampler_weights: bool, k_pos=2.0, lam_pos=3.0, k_neg=3.0, lam_neg=2.0) -> float:
    """VESPO's φ(w) = e^λ · w^k · e^(−λw) for completion i's sequence ratio w = Π_t π/π_old (× Π_t π_old/π_sampler
    over every column, padding's weight being 1), in log space with TRL's clamps."""
    log_w = sum(max(-20.0, min(20.0, LOGPS[i][t] - OLD_LOGPS[i][t])) for t in range(lengths()[i]))
    if with_sampler_weights:
        log_w += sum(max(math.log(1e-8), min(20.0, math.log(SAMPLER_WEIGHTS[i][t]))) for t in range(T))
    log_w = max(math.log(1e-8), min(20.0, log_w))
    k, lam = (k_pos, lam_pos) if ADVANTAGES[i] >= 0 else (k_neg, lam_neg)
    return math.exp(lam + k * log_w - lam * math.exp(log_w))


def hand_token_loss(name: str, i: int, t: int) -> float:
    """One loss token's loss, from the papers' formulas."""
    loss_type, fields, with_sampler_weights = CASES[name]
    level = fields.get("importance_sampling_level", "token")
    eps_low, eps_high = EPSILON, fields.get("epsilon_high", EPSILON_HIGH)
    a, logp = ADVANTAGES[i], LOGPS[i][t]
    w = math.exp(log_ratio(i, t, level))
    if loss_type == "cispo":  # −sg(min(w, ε_max)) · A · log π
        loss = -min(w, eps_high) * a * logp
    elif loss_type == "sapo":  # −σ(τ(w − 1)) · 4/τ · A
        tau = 1.0 if a > 0 else 1.05
        loss = -sigmoid(tau * (w - 1.0)) * 4.0 / tau * a
    elif loss_type == "vespo":  # −sg(φ(w_seq)) · A · log π; sampler weights live inside φ
        loss = -vespo_phi(i, with_sampler_weights) * a * logp
    else:  # PPO's clipped surrogate: −min(w·A, clip(w, 1 − ε_low, 1 + ε_high)·A), w capped at delta if given
        unclipped = min(w, fields["delta"]) if "delta" in fields else w
        clipped = min(max(w, 1.0 - eps_low), 1.0 + eps_high)
        loss = -min(unclipped * a, clipped * a)
    if with_sampler_weights and loss_type != "vespo":
        loss *= SAMPLER_WEIGHTS[i][t]
    beta = fields.get("beta", 0.0)
    if beta > 0:  # k3 = e^(ref − logp) − (ref − logp) − 1, importance-weighted by w unless told not to
        d = REF_LOGPS[i][t] - logp
        k3 = math.exp(d) - d - 1.0
        loss += beta * (k3 * w if fields.get("use_bias_correction_kl", True) else k3)
    return loss


def hand_loss(name: str) -> float:
    """Aggregated by each loss_type's definition (docs/grpo.md), over this one micro-batch = the whole step."""
    loss_type = CASES[name][0]
    per_row = [[hand_token_loss(name, i, t) for t in range(n)] for i, n in enumerate(lengths())]  # loss tokens
    n_tokens = sum(lengths())
    total = sum(sum(row) for row in per_row)
    if loss_type in ("grpo", "sapo"):  # mean over completions of each completion's token mean
        return sum(sum(row) / len(row) for row in per_row) / B
    if loss_type == "bnpo":  # this micro-batch's token mean (one micro-batch)
        return total / n_tokens
    if loss_type == "dr_grpo":  # Σ over completions and tokens / (completions · max_completion_length)
        return total / (B * MAX_COMPLETION_LENGTH)
    if loss_type in ("dapo", "cispo", "vespo"):  # token mean over the step's loss tokens
        return total / n_tokens
    if loss_type == "luspo":  # mean over completions of each completion's token sum
        return sum(sum(row) for row in per_row) / B
    raise AssertionError(loss_type)


# ---------------------------------------------------------------------------------------------------------------
# The tests
# ---------------------------------------------------------------------------------------------------------------


def test_the_batch_covers_both_clip_bounds_for_both_signs():
    """The fixed batch is only a reference if it exercises the clip: check what it was built to contain."""
    ratios = {(i, t): math.exp(log_ratio(i, t, "token")) for i, n in enumerate(lengths()) for t in range(n)}
    lo, hi = 1 - EPSILON, 1 + EPSILON_HIGH
    assert any(r > hi and ADVANTAGES[i] > 0 for (i, _), r in ratios.items())  # clipped high
    assert any(r < lo and ADVANTAGES[i] > 0 for (i, _), r in ratios.items())  # below the range, A > 0: kept
    assert any(r < lo and ADVANTAGES[i] < 0 for (i, _), r in ratios.items())  # clipped low
    assert any(r > hi and ADVANTAGES[i] < 0 for (i, _), r in ratios.items())  # above the range, A < 0: kept
    assert any(lo <= r <= hi and ADVANTAGES[i] != 0 for (i, _), r in ratios.items())  # inside
    # swapping ε_low and ε_high (a range [0.7, 1.2]) would move the clipped values of row 0 and row 1
    sequence = [math.exp(log_ratio(i, 0, "sequence")) for i in range(B)]
    assert sequence[0] > hi and ADVANTAGES[0] > 0 and sequence[1] < lo and ADVANTAGES[1] < 0
    assert sorted(ADVANTAGES) == [-0.8, 0.0, 1.5]


# SAPO's temperatures become a tensor through torch.where(A > 0, τ_pos, τ_neg) with Python floats, which is
# float32 whatever the inputs' dtype, in TRL as here: τ_neg = 1.05 is used as 1.0499999523, which moves this
# float64 loss by 3e-8 relative from the hand value (exactly 1.05). Ours and TRL agree to the last bit; the
# tolerance admits both that and a τ kept in float64.
REL = {"sapo": 1e-7}


@pytest.mark.parametrize("name", list(CASES))
def test_loss_matches_the_hand_computation(name):
    loss, _, _ = our_loss(name)
    assert loss.item() == pytest.approx(hand_loss(name), rel=REL.get(name, 1e-12), abs=1e-15)


@pytest.mark.parametrize("name", list(CASES))
def test_loss_matches_trl_1_16(name):
    """Ours against TRL 1.16's number for the same tensors (none of these cases differs by design: one process,
    one micro-batch that is the whole round and step, every completion with loss tokens; the documented
    differences, docs/migrating-from-trl.md "Loss normalization", need several micro-batches or masked-out
    completions)."""
    loss, _, _ = our_loss(name)
    assert loss.item() == pytest.approx(TRL_1_16_LOSS[name], rel=REL.get(name, 1e-10))


def test_padding_does_not_reach_the_loss():
    """Changing the log-probs at padding changes nothing, for every case (VESPO included: its sampler weights
    sum over every column, but the log-ratio only over loss tokens)."""
    for name in CASES:
        moved = tensor(LOGPS)
        moved[1, 3] = moved[2, 2] = moved[2, 3] = -3.0
        assert our_loss(name, moved)[0].item() == pytest.approx(our_loss(name)[0].item(), rel=1e-14), name


def test_clipped_tokens_have_no_gradient():
    """grpo: d loss / d log π is −w·A/(|o_i|·B) on a token the clip leaves alone (dw/dlogπ = w), exactly 0 on a
    clipped one (ratio above 1 + ε_high with A > 0, below 1 − ε_low with A < 0), on padding and where A = 0."""
    loss, out, logps = our_loss("grpo")
    loss.backward()
    grad = logps.grad.tolist()
    lo, hi = 1 - EPSILON, 1 + EPSILON_HIGH
    clipped_tokens = 0
    for i in range(B):
        for t in range(T):
            a, n = ADVANTAGES[i], lengths()[i]
            if not MASK[i][t]:
                assert grad[i][t] == 0.0
                continue
            w = math.exp(log_ratio(i, t, "token"))
            clipped = (w > hi and a > 0) or (w < lo and a < 0)
            assert bool(out.high_clipped[i, t] or out.low_clipped[i, t]) == clipped
            if clipped:
                clipped_tokens += 1
                assert grad[i][t] == 0.0, (i, t)
            else:
                assert grad[i][t] == pytest.approx(-w * a / (n * B), rel=1e-12, abs=0.0), (i, t)
                assert (grad[i][t] != 0.0) == (a != 0.0)
    assert clipped_tokens == 4  # row 0: 2.117, 1.822 (A > 0); row 1: 0.497, 0.670 (A < 0)
    assert out.high_clipped.sum().item() == 2 and out.low_clipped.sum().item() == 2


def test_gspo_clips_whole_completions():
    """gspo: both completions with A ≠ 0 are outside the range on their clipped side, so no gradient at all."""
    loss, out, logps = our_loss("gspo")
    loss.backward()
    assert out.per_token.shape == (B, 1)
    assert out.high_clipped[:, 0].tolist() == [True, False, False]
    assert out.low_clipped[:, 0].tolist() == [False, True, False]
    assert torch.count_nonzero(logps.grad).item() == 0


def test_cispo_keeps_every_tokens_gradient():
    """cispo: d loss / d log π = −min(w, ε_max)·A / tokens on every loss token, also on the tokens the clipped
    objective would clip, and nonzero wherever A ≠ 0."""
    loss, out, logps = our_loss("cispo")
    loss.backward()
    grad = logps.grad.tolist()
    eps_max = CASES["cispo"][1]["epsilon_high"]
    n_tokens = sum(lengths())
    for i in range(B):
        for t in range(T):
            if not MASK[i][t]:
                assert grad[i][t] == 0.0
                continue
            w = math.exp(log_ratio(i, t, "token"))
            assert grad[i][t] == pytest.approx(-min(w, eps_max) * ADVANTAGES[i] / n_tokens, rel=1e-12, abs=0.0)
            assert (grad[i][t] != 0.0) == (ADVANTAGES[i] != 0.0)
    assert out.cispo_clipped.tolist()[0] == [True, False, False, False]  # only 2.117 > ε_max = 2, A > 0


def test_vespo_gradient_is_the_detached_gamma_weight():
    """vespo: φ is detached, so d loss / d log π = −φ_i·A_i / tokens on every loss token of completion i."""
    loss, out, logps = our_loss("vespo")
    loss.backward()
    n_tokens = sum(lengths())
    for i in range(B):
        phi = vespo_phi(i, with_sampler_weights=False)
        assert out.phi[i, 0].item() == pytest.approx(phi, rel=1e-12)
        for t in range(T):
            expected = -phi * ADVANTAGES[i] / n_tokens if MASK[i][t] else 0.0
            assert logps.grad[i, t].item() == pytest.approx(expected, rel=1e-12, abs=0.0)


def test_on_policy_losses_agree_where_documented():
    """At w = 1 (old = current log-probs) cispo and vespo equal dapo's gradient and sapo grpo's (docs/grpo.md)."""
    grads = {}
    for name in ("dapo", "cispo", "vespo", "grpo", "sapo"):
        logps = tensor(LOGPS).requires_grad_(True)
        inputs = PolicyInputs(logps=logps, old_logps=logps.detach(), advantages=tensor(ADVANTAGES), mask=tensor(MASK))
        loss_type = CASES[name][0]
        AGGREGATIONS[loss_type](OBJECTIVES[loss_type](inputs, config(name)).per_token, tensor(MASK), COUNTS).backward()
        grads[name] = logps.grad
    torch.testing.assert_close(grads["cispo"], grads["dapo"], rtol=1e-12, atol=0.0)
    torch.testing.assert_close(grads["vespo"], grads["dapo"], rtol=1e-12, atol=0.0)
    torch.testing.assert_close(grads["sapo"], grads["grpo"], rtol=1e-12, atol=0.0)
