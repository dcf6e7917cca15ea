"""skip_zero_gradient_rows: completions whose loss gradient is zero by construction (advantage 0 with beta=0, or
no loss tokens) stay out of the backward, with the same loss, statistics and gradients as training every row."""

import dataclasses

import pytest
import torch

from trainers import GRPOConfig, GRPOTrainer
from trainers.sampling.scoring import LogProbScorer
from trainers.loop.stats import Extreme

ROWS = [{"prompt": "abc"}, {"prompt": "hello"}]


def constant_for_abc(prompts, completions, **kwargs):
    """Every completion of "abc" scores 0.5 (a zero-std group, advantage 0); the others by length."""
    return [0.5 if p == "abc" else float(len(c)) for p, c in zip(prompts, completions)]


class RecordingScorer(LogProbScorer):
    """The log-prob scorer, recording each forward's rows and whether it had a gradient."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.forwards: list[tuple[int, bool]] = []

    def policy_logprobs(self, model, batch, **options):
        self.forwards.append((batch.completion_ids.shape[0], torch.is_grad_enabled()))
        return super().policy_logprobs(model, batch, **options)


class RecordingGRPO(GRPOTrainer):
    scorer_class = RecordingScorer


def trainer_for(tiny_model_dir, tmp_path, **overrides):
    args = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=16, num_generations=8,
                max_completion_length=8, learning_rate=1e-2, max_steps=2, logging_steps=1, save_strategy="no",
                disable_tqdm=True, seed=0, shuffle_dataset=False, report_to="none")
    return RecordingGRPO(model=tiny_model_dir, reward_funcs=constant_for_abc, train_dataset=ROWS,
                         args=GRPOConfig(**{**args, **overrides}))


def first_micro_batch(tiny_model_dir, tmp_path, skip: bool, **options):
    """A trainer with skip_zero_gradient_rows=``skip``, its first micro-batch, and its weights moved away from
    the sampling policy (the same way for every trainer), so that ratios differ from 1 and clipping happens."""
    trainer = trainer_for(tiny_model_dir, tmp_path / str(skip), skip_zero_gradient_rows=skip, **options)
    trainer.prepare_step(0)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.02)
    return trainer, trainer.micro_batch(0, 0)


def loss_stats_grads(trainer, batch):
    """compute_loss and backward on one micro-batch; also the rows of each forward, with or without gradient."""
    scorer = trainer.scorer
    scorer.forwards.clear()
    trainer.model.zero_grad(set_to_none=True)
    counts = trainer.batch_counts([batch])
    loss, stats = trainer.compute_loss(trainer.model, batch, counts)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    values = {name: float(value.value) if isinstance(value, Extreme) else tuple(float(v) for v in value)
              for name, value in stats.items()}
    return float(loss.detach()), values, grads, list(scorer.forwards)


# The forwards with skipping, (rows, with gradient), when the "abc" group (the first 8 rows) has advantage 0:
SPLIT = [(8, True), (8, False)]  # advantage 0 is idle: forwarded without gradient for the logged entropy
ALL = [(16, True)]  # beta or an entropy bonus: advantage 0 still has a gradient, and no row is silent
TRAINED_ONLY = [(8, True)]  # dynamic_sampling: the "abc" group has no loss tokens, so is not forwarded at all

CASES = {
    "dapo": ({}, SPLIT),
    "grpo": ({"loss_type": "grpo"}, SPLIT),
    "bnpo": ({"loss_type": "bnpo"}, SPLIT),
    "dr_grpo": ({"loss_type": "dr_grpo"}, SPLIT),
    "cispo": ({"loss_type": "cispo"}, SPLIT),
    "sapo": ({"loss_type": "sapo"}, SPLIT),
    "vespo": ({"loss_type": "vespo"}, SPLIT),
    "sequence-level": ({"importance_sampling_level": "sequence"}, SPLIT),
    "two-iterations": ({"num_iterations": 2}, SPLIT),
    "top-entropy": ({"top_entropy_quantile": 0.5}, SPLIT),
    "off-policy-mask": ({"off_policy_mask_threshold": 0.01, "num_iterations": 2}, SPLIT),
    "dynamic-sampling": ({"dynamic_sampling": True}, TRAINED_ONLY),
    "beta": ({"beta": 0.1}, ALL),
    "beta-dynamic-sampling": ({"beta": 0.1, "dynamic_sampling": True}, TRAINED_ONLY),  # silent rows still idle
    "entropy-bonus": ({"entropy_coef": 0.01}, ALL),
    "gradient-checkpointing": ({"gradient_checkpointing": True}, SPLIT),
}


@pytest.mark.parametrize("case", list(CASES))
def test_same_loss_statistics_and_gradients(tiny_model_dir, tmp_path, case):
    options, expected = CASES[case]
    every, batch_all = first_micro_batch(tiny_model_dir, tmp_path, skip=False, **options)
    skipping, batch = first_micro_batch(tiny_model_dir, tmp_path, skip=True, **options)
    assert torch.equal(batch.completion_ids, batch_all.completion_ids)  # the same round, sampled twice
    loss_all, stats_all, grads_all, forwards_all = loss_stats_grads(every, batch_all)
    loss, stats, grads, forwards = loss_stats_grads(skipping, batch)

    # the "abc" group (the first 8 rows) has advantage 0; with dynamic_sampling also no loss tokens
    assert torch.all(batch.advantages[:8] == 0) and torch.all(batch.advantages[8:] != 0)
    assert forwards_all == [(16, True)]
    assert forwards == expected

    assert loss == pytest.approx(loss_all, rel=1e-5, abs=1e-7)
    assert stats.keys() == stats_all.keys()
    for name in stats:
        assert stats[name] == pytest.approx(stats_all[name], rel=1e-4, abs=1e-6), name
    assert grads.keys() == grads_all.keys() and grads
    for name in grads:
        scale = grads_all[name].norm() + 1e-8
        assert (grads[name] - grads_all[name]).norm() <= 1e-4 * scale, name


def test_a_micro_batch_of_idle_rows_keeps_one_row_in_the_backward(tiny_model_dir, tmp_path):
    every, batch_all = first_micro_batch(tiny_model_dir, tmp_path, skip=False)
    skipping, batch = first_micro_batch(tiny_model_dir, tmp_path, skip=True)
    # every advantage 0: a copy reads the rows' roles again (Rollout.roles is not an init field)
    batch_all = dataclasses.replace(batch_all, advantages=torch.zeros_like(batch_all.advantages))
    batch = dataclasses.replace(batch, advantages=torch.zeros_like(batch.advantages))
    loss_all, stats_all, grads_all, _ = loss_stats_grads(every, batch_all)
    loss, stats, grads, forwards = loss_stats_grads(skipping, batch)
    assert forwards == [(1, True), (15, False)]
    assert loss == loss_all == 0.0
    assert stats["entropy"] == pytest.approx(stats_all["entropy"], rel=1e-5)
    assert grads.keys() == grads_all.keys() and grads and all(float(g.abs().max()) == 0.0 for g in grads.values())


def test_training_is_the_same_with_and_without_skipping(tiny_model_dir, tmp_path):
    """Two optimizer steps: the same weights and logged metrics, and the skipping run did skip."""
    runs = {}
    for skip in (True, False):
        trainer = trainer_for(tiny_model_dir, tmp_path / str(skip), skip_zero_gradient_rows=skip)
        trainer.train()
        weights = {n: p.detach().clone() for n, p in trainer.unwrapped_model.named_parameters()}
        runs[skip] = (weights, [r for r in trainer.state.log_history if "loss" in r])
    (weights, logs), (weights_all, logs_all) = runs[True], runs[False]
    initial = load_causal_lm_weights(tiny_model_dir)
    for name in weights:  # per tensor, against how far training moved it (Adam scales up float noise in a
        moved = (weights_all[name] - initial[name]).norm()  # near-zero gradient element, so no elementwise test)
        assert moved > 1e-3, name
        assert (weights[name] - weights_all[name]).norm() <= 1e-3 * moved, name
    assert len(logs) == len(logs_all) == 2
    for record, record_all in zip(logs, logs_all):
        for key in ("loss", "entropy", "reward", "clip_ratio/region_mean"):
            assert record[key] == pytest.approx(record_all[key], rel=1e-4, abs=1e-7), key


def load_causal_lm_weights(folder):
    from transformers import AutoModelForCausalLM

    return {n: p.detach() for n, p in AutoModelForCausalLM.from_pretrained(folder).named_parameters()}


def test_the_option_is_checked():
    with pytest.raises(Exception, match="skip_zero_gradient_rows"):
        GRPOConfig(skip_zero_gradient_rows="yes")
