"""Each loss variant, advantage mode and helper against values computed by hand on tiny tensors."""

import math

import pytest
import torch

from trainers.grpo.objectives import (
    AGGREGATIONS,
    GRPOCounts,
    cispo_policy_loss,
    clipped_policy_loss,
    entropy_bonus,
    high_entropy_mask,
    importance_log_weights,
    k3_kl,
    off_policy_sequence_mask,
    sapo_policy_loss,
    vespo_policy_loss,
)
from trainers.model.losses import aggregate_token_mean, entropy_from_logits, logps_and_entropy, selective_log_softmax
from trainers.sampling.advantages import combine_rewards, decoupled_advantages, group_advantages, nanstd
from trainers.sampling.scoring import sampler_importance_weights

# Two sequences: lengths 3 and 1 (mask), per-token losses chosen so every aggregation differs.
PER_TOKEN = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, 100.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
# As if this micro-batch were one of 2 micro-batches whose step holds 8 tokens and 4 sequences.
COUNTS = GRPOCounts(tokens=8, sequences=4, micro_batches=2, max_completion_length=5)


def test_dapo_divides_by_tokens_of_the_whole_step():
    # (1 + 2 + 3 + 4) / 8
    assert AGGREGATIONS["dapo"](PER_TOKEN, MASK, COUNTS).item() == pytest.approx(10 / 8)


def test_grpo_averages_sequence_means_over_the_step():
    # sequence means 2 and 4, summed, over the step's 4 sequences
    assert AGGREGATIONS["grpo"](PER_TOKEN, MASK, COUNTS).item() == pytest.approx((2 + 4) / 4)


def test_bnpo_is_a_micro_batch_token_mean_averaged_over_micro_batches():
    # (10 / 4 tokens here) / 2 micro-batches
    assert AGGREGATIONS["bnpo"](PER_TOKEN, MASK, COUNTS).item() == pytest.approx(10 / 4 / 2)


def test_dr_grpo_divides_by_sequences_times_max_length():
    assert AGGREGATIONS["dr_grpo"](PER_TOKEN, MASK, COUNTS).item() == pytest.approx(10 / (4 * 5))


def test_luspo_averages_sequence_sums_over_the_step():
    # sequence sums 6 and 4, over the step's 4 sequences; cispo and sapo reuse dapo's and grpo's
    assert AGGREGATIONS["luspo"](PER_TOKEN, MASK, COUNTS).item() == pytest.approx((6 + 4) / 4)
    assert AGGREGATIONS["cispo"] is AGGREGATIONS["dapo"] and AGGREGATIONS["sapo"] is AGGREGATIONS["grpo"]


def test_nll_is_the_token_mean():
    assert aggregate_token_mean(PER_TOKEN, MASK, COUNTS).item() == pytest.approx(10 / 8)


def test_split_invariance_of_global_aggregations():
    """Summing micro-batch losses normalized by global counts equals the loss of the whole batch at once."""
    per_token = torch.rand(6, 4)
    mask = (torch.rand(6, 4) > 0.3).float()
    mask[:, 0] = 1
    whole = GRPOCounts(tokens=float(mask.sum()), sequences=6, micro_batches=1, max_completion_length=4)
    split = GRPOCounts(tokens=float(mask.sum()), sequences=6, micro_batches=3, max_completion_length=4)
    for name in ("dapo", "grpo", "dr_grpo", "luspo"):  # and SFT's nll, aggregate_token_mean (dapo's)
        together = AGGREGATIONS[name](per_token, mask, whole)
        parts = sum(AGGREGATIONS[name](per_token[i:i + 2], mask[i:i + 2], split) for i in (0, 2, 4))
        assert parts.item() == pytest.approx(together.item(), rel=1e-6), name


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 2.0, 2.0, 2.0, 2.0])  # two groups of 4
    adv, zero_std = group_advantages(rewards, 4, "group")
    std = torch.tensor([1.0, 0.0, 1.0, 0.0]).std().item()  # unbiased: sqrt(1/3)
    expected = [0.5 / (std + 1e-4), -0.5 / (std + 1e-4)] * 2 + [0.0] * 4
    assert adv.tolist() == pytest.approx(expected, rel=1e-6)
    assert zero_std.tolist() == [False, True]


def test_batch_and_no_scaling():
    rewards = torch.tensor([1.0, 0.0, 3.0, 1.0])
    adv_none, _ = group_advantages(rewards, 2, "none")
    assert adv_none.tolist() == pytest.approx([0.5, -0.5, 1.0, -1.0])
    adv_batch, _ = group_advantages(rewards, 2, "batch")
    batch_std = rewards.std().item()
    assert adv_batch.tolist() == pytest.approx([v / (batch_std + 1e-4) for v in (0.5, -0.5, 1.0, -1.0)], rel=1e-6)
    with pytest.raises(ValueError, match="scale_rewards"):
        group_advantages(rewards, 2, "nope")


def test_unscorable_completions_get_zero_advantage_and_do_not_bias_the_group():
    rewards = torch.tensor([1.0, 0.0, float("nan"), 1.0])
    adv, zero_std = group_advantages(rewards, 4, "none")
    mean = 2 / 3
    assert adv.tolist() == pytest.approx([1 - mean, -mean, 0.0, 1 - mean])
    assert zero_std.tolist() == [False]


def test_combine_rewards_skips_none_and_weights():
    nan = float("nan")
    per_func = torch.tensor([[1.0, 2.0], [nan, 3.0], [nan, nan]])
    total = combine_rewards(per_func, torch.tensor([0.5, 2.0]))
    assert total[:2].tolist() == pytest.approx([0.5 + 4.0, 6.0])
    assert math.isnan(total[2].item())  # no function applied: unscorable, not 0


def test_nanstd_matches_torch_std_without_nans():
    x = torch.tensor([[1.0, 2.0, 4.0], [3.0, 3.0, 9.0]])
    assert nanstd(x, dim=1).tolist() == pytest.approx(x.std(dim=1).tolist())
    assert nanstd(torch.tensor([1.0, float("nan"), 3.0])).item() == pytest.approx(math.sqrt(2))


def test_clipped_policy_loss_by_hand():
    # ratios 1.5 (A>0: clipped at 1.2), 0.5 (A<0: clipped at 0.8), 1.1 (inside)
    log_w = torch.log(torch.tensor([[1.5, 0.5, 1.1]]))
    adv = torch.tensor([2.0])
    loss, low, high = clipped_policy_loss(log_w, adv, 0.2, 0.2)
    # A > 0: -min(r A, clip(r) A): r=1.5 -> -1.2*2; r=0.5 -> -0.5*2 (min picks unclipped); r=1.1 -> -2.2
    assert loss[0].tolist() == pytest.approx([-2.4, -1.0, -2.2])
    assert high.tolist() == [[True, False, False]] and low.tolist() == [[False, False, False]]
    loss_neg, low_neg, _ = clipped_policy_loss(log_w, torch.tensor([-1.0]), 0.2, 0.2)
    # A < 0: r=1.5 -> -min(-1.5, -1.2) = 1.5; r=0.5 -> -min(-0.5, -0.8) = 0.8; r=1.1 -> 1.1
    assert loss_neg[0].tolist() == pytest.approx([1.5, 0.8, 1.1])
    assert low_neg.tolist() == [[False, True, False]]


def test_clip_higher_and_two_sided_delta():
    log_w = torch.log(torch.tensor([[1.25, 3.0]]))
    loss, _, high = clipped_policy_loss(log_w, torch.tensor([1.0]), 0.2, 0.28)  # DAPO: 1 + 0.28
    assert loss[0].tolist() == pytest.approx([-1.25, -1.28])
    assert high.tolist() == [[False, True]]
    # delta caps the unclipped ratio for A < 0: r = 3 -> min(3, 2) = 2 -> loss -min(-2, -1.28) = 2
    loss_delta, _, _ = clipped_policy_loss(log_w, torch.tensor([-1.0]), 0.2, 0.28, delta=2.0)
    assert loss_delta[0].tolist() == pytest.approx([1.25, 2.0])


def test_gradient_of_the_unclipped_objective_is_advantage_times_score():
    logps = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss, _, _ = clipped_policy_loss(importance_log_weights(logps, logps.detach(), torch.ones(1, 2), "token"),
                                     torch.tensor([3.0]), 0.2, 0.2)
    loss.sum().backward()
    assert logps.grad.tolist() == [[-3.0, -3.0]]  # d(-r A)/dlogp = -A at r = 1


def test_cispo_clips_and_detaches_the_weight_so_every_token_keeps_a_gradient():
    logps = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    log_weights = torch.log(torch.tensor([[0.5, 1.0, 10.0]])).requires_grad_()
    loss, clipped = cispo_policy_loss(logps, log_weights, torch.tensor([2.0]), max_weight=5.0)
    assert loss[0].tolist() == pytest.approx([-0.5 * 2 * -1.0, -1.0 * 2 * -2.0, -5.0 * 2 * -0.5])
    assert clipped.tolist() == [[False, False, True]]
    loss.sum().backward()
    assert logps.grad[0].tolist() == pytest.approx([-1.0, -2.0, -10.0])  # -min(w, 5) x A: the clipped token too
    assert log_weights.grad is None  # the weight is a constant
    _, clipped = cispo_policy_loss(logps, log_weights, torch.tensor([-2.0]), max_weight=5.0)
    assert not clipped.any()  # only positive advantages count as clipped (TRL)


def test_sapo_gate_is_the_policy_gradient_on_policy_and_fades_off_policy():
    for advantage, tau in ((1.5, 1.0), (-1.5, 1.05)):
        log_weights = torch.zeros(1, 1, requires_grad=True)
        loss = sapo_policy_loss(log_weights, torch.tensor([advantage]), temperature_pos=1.0, temperature_neg=1.05)
        assert loss.item() == pytest.approx(-2 / tau * advantage)  # σ(0) · 4/τ · A
        loss.sum().backward()
        assert log_weights.grad.item() == pytest.approx(-advantage)  # as -w·A at w = 1
    far = torch.full((1, 1), math.log(10.0), requires_grad=True)  # w = 10
    sapo_policy_loss(far, torch.tensor([1.0]), 1.0, 1.05).sum().backward()
    assert 0 < -far.grad.item() < 0.05  # off policy the gate lets little through (no hard cut)


def test_gspo_sequence_ratio_is_the_length_normalized_mean():
    logps = torch.tensor([[-1.0, -2.0, -3.0]])
    old = torch.tensor([[-1.5, -2.0, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    w = importance_log_weights(logps, old, mask, "sequence")
    assert w.shape == (1, 1)
    assert w.item() == pytest.approx((0.5 + 0.0) / 2)
    assert importance_log_weights(logps, old, mask, "token").tolist() == [[0.5, 0.0, 6.0]]
    with pytest.raises(ValueError, match="importance_sampling_level"):
        importance_log_weights(logps, old, mask, "nope")


def test_k3_kl_by_hand():
    logp = torch.tensor([-1.0, -1.0])
    ref = torch.tensor([-1.0, -2.0])
    kl = k3_kl(logp, ref)
    assert kl.tolist() == pytest.approx([0.0, math.exp(-1) + 1 - 1])
    assert (k3_kl(torch.randn(100), torch.randn(100)) >= 0).all()


def test_selective_log_softmax_and_entropy_match_the_dense_computation():
    torch.manual_seed(0)
    logits = torch.randn(5, 7, 11)
    index = torch.randint(0, 11, (5, 7))
    dense = logits.log_softmax(-1).gather(-1, index.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(selective_log_softmax(logits, index, chunk_rows=2), dense)
    probs = logits.softmax(-1)
    torch.testing.assert_close(entropy_from_logits(logits, chunk_rows=3), -(probs * probs.log()).sum(-1))
    # bf16 logits are upcast before the softmax
    low = selective_log_softmax(logits.bfloat16(), index)
    assert low.dtype == torch.float32


def test_the_fused_pass_equals_the_separate_ones_in_value_and_gradient():
    torch.manual_seed(0)
    logits = torch.randn(5, 7, 11, requires_grad=True)
    index = torch.randint(0, 11, (5, 7))
    logps, entropy = logps_and_entropy(logits, index, chunk_rows=2)
    torch.testing.assert_close(logps, selective_log_softmax(logits, index))
    torch.testing.assert_close(entropy, entropy_from_logits(logits.detach()))
    assert not entropy.requires_grad
    (grad_fused,) = torch.autograd.grad(logps.sum(), logits)
    (grad_plain,) = torch.autograd.grad(selective_log_softmax(logits, index).sum(), logits)
    torch.testing.assert_close(grad_fused, grad_plain)


# ------------------------------------------------------------------------------------------------------------
# high_entropy_mask (top_entropy_quantile) and off_policy_sequence_mask (off_policy_mask_threshold)
# ------------------------------------------------------------------------------------------------------------


def test_high_entropy_mask_keeps_loss_tokens_at_or_above_the_threshold():
    entropy = torch.tensor([[0.1, 0.9, 0.5, 2.0], [0.5, 0.4, 3.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    kept = high_entropy_mask(entropy, mask, 0.5)
    assert kept.tolist() == [[False, True, True, False], [True, False, True, False]]  # 2.0 is padding


def test_off_policy_sequence_mask_drops_negative_far_off_policy_completions():
    logps = torch.zeros(4, 3, requires_grad=True)
    # mean log pi_old - log pi per completion (over its 2 loss tokens): 0.6, 0.6, 0.2, 0.6
    old = torch.tensor([[0.6, 0.6, 9.0], [0.6, 0.6, 9.0], [0.2, 0.2, 9.0], [1.2, 0.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]] * 4)
    advantages = torch.tensor([1.0, -1.0, -1.0, -0.5])
    kept = off_policy_sequence_mask(logps, old, advantages, mask, threshold=0.5)
    assert kept.shape == (4, 1)
    assert kept.squeeze(1).tolist() == [1.0, 0.0, 1.0, 0.0]  # kept: A >= 0, or KL <= 0.5
    assert not kept.requires_grad  # a mask, not a path for gradients
    assert off_policy_sequence_mask(logps, logps.detach(), advantages, mask, 0.0).eq(1).all()  # on policy: all kept


def test_off_policy_sequence_mask_reads_an_unscored_sampler_token_as_no_evidence():
    """NaN (a token the sampler could not score) counts as KL 0, as TRL: one such token does not drop a row."""
    logps = torch.zeros(2, 2)
    sampler = torch.tensor([[math.nan, 0.0], [math.nan, 2.0]])
    kept = off_policy_sequence_mask(logps, sampler, torch.tensor([-1.0, -1.0]), torch.ones(2, 2), 0.5)
    assert kept.squeeze(1).tolist() == [1.0, 0.0]  # row 1: mean KL (0 + 2) / 2 = 1 > 0.5


# ------------------------------------------------------------------------------------------------------------
# sampler_importance_weights (vllm_importance_sampling_*: a rollout function's log-probs)
# ------------------------------------------------------------------------------------------------------------

# the trainer's log-probs minus the sampler's: row 0 [0.5, 1.5, pad], row 1 [-1.0, unscored (NaN), pad]
TRAINER = torch.tensor([[-1.0, -0.5, -3.0], [-2.0, -1.0, -3.0]])
SAMPLER = torch.tensor([[-1.5, -2.0, math.nan], [-1.0, math.nan, math.nan]])
LOSS_TOKENS = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])


@pytest.mark.parametrize("mode, clip_min, clip_max, expected", [
    # per token: exp(diff), 1 on padding and on the unscored token (no correction), then clipped or masked
    ("token_truncate", None, 3.0, [[math.exp(0.5), 3.0, 1.0], [math.exp(-1.0), 1.0, 1.0]]),
    ("token_truncate", 0.5, None, [[math.exp(0.5), math.exp(1.5), 1.0], [0.5, 1.0, 1.0]]),
    ("token_mask", None, 3.0, [[math.exp(0.5), 0.0, 1.0], [math.exp(-1.0), 1.0, 1.0]]),
    ("token_mask", 0.5, 3.0, [[math.exp(0.5), 0.0, 1.0], [0.0, 1.0, 1.0]]),
    ("token_truncate", None, None, [[math.exp(0.5), math.exp(1.5), 1.0], [math.exp(-1.0), 1.0, 1.0]]),
    # per completion: exp(sum of its diffs) = e^2 and e^-1
    ("sequence_truncate", None, 3.0, [[3.0], [math.exp(-1.0)]]),
    ("sequence_truncate", 0.5, 8.0, [[math.exp(2.0)], [0.5]]),
    ("sequence_mask", None, 3.0, [[0.0], [math.exp(-1.0)]]),
    ("sequence_mask", None, 8.0, [[math.exp(2.0)], [math.exp(-1.0)]]),
    ("sequence_mask", 0.5, 8.0, [[math.exp(2.0)], [0.0]]),
])
def test_sampler_importance_weights_per_mode(mode, clip_min, clip_max, expected):
    weights = sampler_importance_weights(TRAINER, SAMPLER, LOSS_TOKENS, mode, clip_min, clip_max)
    assert weights.shape == (2, 3 if mode.startswith("token") else 1)
    torch.testing.assert_close(weights, torch.tensor(expected))


def test_vespo_folds_per_token_sampler_weights_into_its_sequence_weight():
    """log w gains sum_t log(sampler weight): the same phi as if the token log-ratios were shifted by them (TRL)."""
    logps = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    advantages = torch.tensor([0.5, -2.0])
    log_ratio = torch.tensor([[0.1, 0.2, 0.0], [-0.2, -0.3, 5.0]])
    shift = torch.tensor([[0.3, -0.1, 0.2], [0.4, 0.1, 0.0]]) * mask  # padding's sampler weight is 1
    _, phi = vespo_policy_loss(logps, log_ratio, advantages, mask, 2.0, 3.0, 3.0, 2.0, torch.exp(shift))
    _, shifted = vespo_policy_loss(logps, log_ratio + shift, advantages, mask, 2.0, 3.0, 3.0, 2.0)
    torch.testing.assert_close(phi, shifted)
    assert not torch.allclose(phi, vespo_policy_loss(logps, log_ratio, advantages, mask, 2.0, 3.0, 3.0, 2.0)[1])


# ------------------------------------------------------------------------------------------------------------
# vespo_policy_loss
# ------------------------------------------------------------------------------------------------------------


def test_vespo_weight_is_one_on_policy_and_the_gamma_shape_off_policy():
    logps = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, -9.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    advantages = torch.tensor([0.5, -2.0])
    loss, phi = vespo_policy_loss(logps, torch.zeros_like(logps), advantages, mask, 2.0, 3.0, 3.0, 2.0)
    assert phi.shape == (2, 1) and phi.squeeze(1).tolist() == pytest.approx([1.0, 1.0])
    assert torch.allclose(loss, -advantages.unsqueeze(1) * logps)  # the plain policy gradient
    # off policy: log w is the sum of the token log-ratios over loss tokens; phi = e^lam * w^k * e^(-lam w)
    log_ratio = torch.tensor([[0.1, 0.2, 0.0], [-0.2, -0.3, 5.0]])  # padding's 5.0 is ignored
    _, phi = vespo_policy_loss(logps, log_ratio, advantages, mask, 2.0, 3.0, 3.0, 2.0)
    w_pos, w_neg = math.exp(0.3), math.exp(-0.5)
    assert phi[0, 0].item() == pytest.approx(math.exp(3.0) * w_pos ** 2 * math.exp(-3.0 * w_pos), rel=1e-5)
    assert phi[1, 0].item() == pytest.approx(math.exp(2.0) * w_neg ** 3 * math.exp(-2.0 * w_neg), rel=1e-5)


def test_vespo_weight_is_detached():
    logps = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    old = torch.tensor([[-1.2, -1.9]])
    loss, phi = vespo_policy_loss(logps, logps - old, torch.tensor([1.0]), torch.ones(1, 2), 2.0, 3.0, 3.0, 2.0)
    loss.sum().backward()
    assert not phi.requires_grad
    assert torch.allclose(logps.grad, -phi.expand(1, 2))  # d(-phi * A * logp)/dlogp with A = 1


# ------------------------------------------------------------------------------------------------------------
# decoupled_advantages (multi_objective_aggregation="normalize_then_sum", GDPO)
# ------------------------------------------------------------------------------------------------------------


def test_decoupled_advantages_normalize_each_function_per_group_then_the_sum_over_the_batch():
    rewards = torch.tensor([[1.0, 10.0], [0.0, 30.0], [1.0, 5.0], [1.0, 5.0]])  # 2 groups of 2, 2 functions
    advantages, summed, zero_std = decoupled_advantages(rewards, torch.tensor([1.0, 2.0]), num_generations=2)
    # group 0: f0 (1, 0) -> (+0.707, -0.707), f1 (10, 30) -> (-0.707, +0.707); weighted: (-0.707, +0.707)
    # group 1: both functions constant -> 0, 0. The batch (-0.707, 0.707, 0, 0): mean 0, std sqrt(1/3)
    assert summed.tolist() == pytest.approx([-0.7072, 0.7072, 0.0, 0.0], abs=1e-3)
    assert advantages.tolist() == pytest.approx([-1.2249, 1.2249, 0.0, 0.0], abs=1e-3)
    assert zero_std.tolist() == [False, True]
    # the scales do not matter, only the weights: f1 x 1000 changes nothing
    scaled, _, _ = decoupled_advantages(rewards * torch.tensor([1.0, 1000.0]), torch.tensor([1.0, 2.0]), 2)
    assert scaled.tolist() == pytest.approx(advantages.tolist(), abs=1e-3)


def test_decoupled_advantages_skip_functions_that_do_not_apply():
    nan = float("nan")
    rewards = torch.tensor([[1.0, nan], [0.0, nan], [nan, nan], [2.0, 4.0]])
    advantages, summed, zero_std = decoupled_advantages(rewards, torch.ones(2), num_generations=2)
    assert math.isnan(summed[2]) and advantages[2] == 0.0  # unscorable: no advantage
    assert torch.isfinite(advantages).all()
    assert advantages[0] > 0 > advantages[1]


def test_entropy_with_gradient_matches_autograd_of_the_plain_entropy():
    torch.manual_seed(0)
    logits = torch.randn(5, 3, 11, requires_grad=True)
    index = torch.randint(0, 11, (5, 3))
    _, detached = logps_and_entropy(logits, index, chunk_rows=2)
    assert not detached.requires_grad  # the default: entropy for logging costs no backward memory
    _, entropy = logps_and_entropy(logits, index, chunk_rows=2, entropy_grad=True)
    weights = torch.randn(5, 3)
    (grad,) = torch.autograd.grad((entropy * weights).sum(), logits)
    expected_logits = logits.detach().clone().requires_grad_(True)
    (expected,) = torch.autograd.grad((entropy_from_logits(expected_logits) * weights).sum(), expected_logits)
    torch.testing.assert_close(entropy, entropy_from_logits(logits.detach()), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-6)


def test_entropy_bonus_is_the_micro_batch_mean_over_the_step_micro_batches():
    entropy = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, 100.0]])
    # (1 + 2 + 3 + 4) / 4 tokens, then / 2 micro-batches: whatever the step's token count
    assert entropy_bonus(entropy, MASK, COUNTS).item() == pytest.approx(10 / 4 / 2)
    assert entropy_bonus(entropy, torch.zeros_like(MASK), COUNTS).item() == 0.0  # no tokens: no bonus, no NaN


def test_adaptive_entropy_control_by_hand():
    from trainers.grpo.entropy_control import EntropyControl

    fixed = EntropyControl(0.3)
    fixed.update(5.0)
    assert (fixed.coef, fixed.applied) == (0.3, 0.3)
    control = EntropyControl(0.1, adaptive=True, target=0.5, delta=0.1, low=0.0, high=0.25)
    assert control.applied == 0.0  # no entropy measured yet
    control.update(0.4)  # at or below the target: more bonus, applied next step
    assert control.coef == pytest.approx(0.2) and control.applied == pytest.approx(0.2)
    control.update(0.5)
    assert control.coef == 0.25  # capped at high
    control.update(0.9)  # above: less, and none applied while entropy stays above the target
    assert control.coef == pytest.approx(0.15) and control.applied == 0.0
    for _ in range(3):
        control.update(0.9)
    assert control.coef == 0.0  # floored at low
    control.update(float("nan"))  # a step without loss tokens reads as entropy 0, as in TRL
    assert control.coef == pytest.approx(0.1) and control.last_entropy == 0.0
