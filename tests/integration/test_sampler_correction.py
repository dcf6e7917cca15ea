"""The loss with a rollout function's sampler log-probs (vllm_importance_sampling_*, off_policy_mask_threshold),
on one micro-batch: importance weights scale the per-token loss, masked completions leave the backward, and the
off-policy mask reads the sampler's log-probs. End to end with a rollout_func: tests/integration/test_rollout_func.py.
"""

import dataclasses

import pytest
import torch

from tests.integration.test_zero_gradient_rows import first_micro_batch, loss_stats_grads


def assert_same(first, second, stats=None):
    """Equal loss, gradients and statistics (those named in ``stats``, default all)."""
    loss, stats_a, grads, _ = first
    loss_b, stats_b, grads_b, _ = second
    assert loss == pytest.approx(loss_b, rel=1e-5, abs=1e-7)
    for name in stats or stats_a:
        assert stats_a[name] == pytest.approx(stats_b[name], rel=1e-4, abs=1e-6), name
    assert grads.keys() == grads_b.keys() and grads
    for name in grads:
        assert (grads[name] - grads_b[name]).norm() <= 1e-4 * (grads_b[name].norm() + 1e-8), name


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "cispo", "sapo"])
def test_a_constant_token_weight_scales_loss_and_gradients(tiny_model_dir, tmp_path, loss_type):
    # two iterations keep the old log-probs: the policy moved below makes the ratios differ from 1 (and the
    # loss from its ~0 on policy)
    trainer, batch = first_micro_batch(tiny_model_dir, tmp_path, skip=False, loss_type=loss_type, num_iterations=2)
    plain = loss_stats_grads(trainer, batch)
    weighted = dataclasses.replace(batch, sampler_weights=torch.full_like(batch.loss_mask, 1.5))
    loss, stats, grads, _ = loss_stats_grads(trainer, weighted)
    assert loss == pytest.approx(1.5 * plain[0], rel=1e-4) and abs(plain[0]) > 1e-6
    assert grads.keys() == plain[2].keys() and grads
    for name in grads:
        assert (grads[name] - 1.5 * plain[2][name]).norm() <= 1e-4 * plain[2][name].norm(), name
    assert stats["entropy"] == pytest.approx(plain[1]["entropy"])  # statistics are not weighted


def test_masked_completions_train_as_zero_advantages_and_leave_the_backward(tiny_model_dir, tmp_path):
    """sequence_mask: a completion weighted 0 adds nothing (as its advantage set to 0 would); the others are
    scaled. With skipping, the 0-weight rows are forwarded without gradient, like the advantage-0 group."""
    every, batch = first_micro_batch(tiny_model_dir, tmp_path, skip=False, num_iterations=2)
    skipping, _ = first_micro_batch(tiny_model_dir, tmp_path, skip=True, num_iterations=2)
    weights = torch.full((16, 1), 1.5)
    weights[8:12] = 0.0  # rows 0..7 are the advantage-0 "abc" group; 8..15 score by length
    weighted = dataclasses.replace(batch, sampler_weights=weights)
    zeroed = dataclasses.replace(batch, advantages=torch.cat([batch.advantages[:8], torch.zeros(4), batch.advantages[12:]]))
    expected = loss_stats_grads(every, zeroed)
    expected = (1.5 * expected[0], expected[1], {n: 1.5 * g for n, g in expected[2].items()}, None)
    trained_all = loss_stats_grads(every, weighted)
    skipped = loss_stats_grads(skipping, weighted)
    assert trained_all[3] == [(16, True)] and skipped[3] == [(4, True), (12, False)]
    assert abs(expected[0]) > 1e-4
    assert_same(trained_all, expected, stats=["entropy"])  # clip counts differ: advantage 0 clips nothing
    assert_same(skipped, trained_all)


def test_vespo_rows_with_zero_weights_stay_in_the_backward(tiny_model_dir, tmp_path):
    """VESPO folds the weights into its own (never exactly 0) sequence weight, so nothing is idle but the
    advantage-0 group."""
    every, batch = first_micro_batch(tiny_model_dir, tmp_path, skip=False, loss_type="vespo")
    skipping, _ = first_micro_batch(tiny_model_dir, tmp_path, skip=True, loss_type="vespo")
    weights = torch.ones_like(batch.loss_mask)
    weights[8:12] = 0.0
    weighted = dataclasses.replace(batch, sampler_weights=weights)
    skipped = loss_stats_grads(skipping, weighted)
    assert skipped[3] == [(8, True), (8, False)]
    assert_same(skipped, loss_stats_grads(every, weighted))
    assert skipped[0] != pytest.approx(loss_stats_grads(every, batch)[0], rel=1e-3)


def test_the_off_policy_mask_reads_the_samplers_logprobs(tiny_model_dir, tmp_path):
    """Sampler log-probs 1 nat above the trainer's on every token (mean KL 1 > 0.5): every completion with a
    negative advantage is dropped, as TRL does with vLLM's; 1 nat below, none is."""
    trainer, batch = first_micro_batch(tiny_model_dir, tmp_path, skip=False, off_policy_mask_threshold=0.5)
    with torch.no_grad():
        current = trainer.policy_logprobs(trainer.model, batch)["logps"]
    advantages = batch.advantages
    assert (advantages < 0).sum() > 0 and (advantages > 0).sum() > 0
    far = loss_stats_grads(trainer, dataclasses.replace(batch, sampler_logps=current + 1.0))
    dropped = loss_stats_grads(trainer, dataclasses.replace(batch, advantages=advantages.clamp(min=0)))
    assert_same(far, dropped)
    near = loss_stats_grads(trainer, dataclasses.replace(batch, sampler_logps=current - 1.0))
    assert_same(near, loss_stats_grads(trainer, batch))
    assert far[0] != pytest.approx(near[0], rel=1e-3)
