"""GRPO's entropy bonus (TRL's entropy_coef) and its adaptive coefficient (use_adaptive_entropy)."""

import pytest
import torch

from tests.conftest import step_records
from tests.integration.test_grpo import PROMPTS, config, digits
from trainers import GRPOTrainer


def train(model, tmp_path, **overrides):
    trainer = GRPOTrainer(model=model, reward_funcs=digits, train_dataset=PROMPTS, args=config(tmp_path, **overrides))
    trainer.train()
    return trainer


def weights(trainer):
    return {k: v.detach().clone() for k, v in trainer.unwrapped_model.state_dict().items()}


def test_the_bonus_subtracts_coef_times_the_mean_entropy(tiny_model_dir, tmp_path):
    plain = train(tiny_model_dir, tmp_path / "plain", max_steps=1)
    bonus = train(tiny_model_dir, tmp_path / "bonus", max_steps=1, entropy_coef=0.5)
    (p,), (b,) = step_records(plain), step_records(bonus)
    assert b["reward"] == p["reward"]  # the same completions: the bonus changes only the loss
    assert b["entropy"] == pytest.approx(p["entropy"], rel=1e-6)
    assert b["policy_loss"] == pytest.approx(p["loss"], abs=1e-6)
    assert b["loss"] == pytest.approx(p["loss"] - 0.5 * p["entropy"], rel=1e-5)  # one micro-batch, one process
    assert b["entropy_coef"] == 0.5 and "entropy_coef" not in p
    # and the gradient: the update differs
    same = [torch.equal(x, y) for x, y in zip(weights(plain).values(), weights(bonus).values(), strict=True)]
    assert not all(same)


def test_adaptive_coefficient_follows_the_entropy_target(tiny_model_dir, tmp_path):
    # a random model's entropy (~5.5 nats) is below a target of 100: the coefficient rises every step, and the
    # bonus applies from the second step on (the first has no measured entropy yet)
    up = train(tiny_model_dir, tmp_path / "up", max_steps=3, entropy_coef=0.1, use_adaptive_entropy=True,
               entropy_target=100.0, entropy_coef_delta=0.05)
    assert [r["entropy_coef"] for r in step_records(up)] == pytest.approx([0.15, 0.2, 0.25])
    first = step_records(up)[0]
    assert first["loss"] == pytest.approx(first["policy_loss"], abs=1e-7)  # step 1: nothing applied
    second = step_records(up)[1]
    assert second["loss"] == pytest.approx(second["policy_loss"] - 0.15 * second["entropy"], rel=1e-5)
    # above the target, it falls to entropy_coef_min and never applies
    down = train(tiny_model_dir, tmp_path / "down", max_steps=3, entropy_coef=0.1, use_adaptive_entropy=True,
                 entropy_target=1.0, entropy_coef_delta=0.04, entropy_coef_min=0.0)
    assert [r["entropy_coef"] for r in step_records(down)] == pytest.approx([0.06, 0.02, 0.0])
    for record in step_records(down):
        assert record["loss"] == pytest.approx(record["policy_loss"], abs=1e-7)


def test_the_adaptive_coefficient_is_resumed(tiny_model_dir, tmp_path):
    options = dict(max_steps=4, entropy_coef=0.1, use_adaptive_entropy=True, entropy_target=100.0,
                   entropy_coef_delta=0.05, lr_scheduler_type="constant")  # a schedule that max_steps leaves alone
    straight = train(tiny_model_dir, tmp_path / "straight", **options)
    first = train(tiny_model_dir, tmp_path / "split", **{**options, "max_steps": 2}, save_strategy="steps",
                  save_steps=2)
    assert first.entropy_control.coef == pytest.approx(0.2)
    resumed = GRPOTrainer(model=tiny_model_dir, reward_funcs=digits, train_dataset=PROMPTS,
                          args=config(tmp_path / "split", **options))
    resumed.train(resume_from_checkpoint=True)
    assert [r["entropy_coef"] for r in step_records(resumed)] == \
        [r["entropy_coef"] for r in step_records(straight)]
    assert step_records(resumed)[-1]["loss"] == pytest.approx(step_records(straight)[-1]["loss"], rel=1e-5)
