"""GRPO's sync_ref_model (TRL's SyncRefModelCallback): the reference moves toward the policy every
ref_model_sync_steps steps, and a checkpoint keeps the moved reference."""

import pytest
import torch
from peft import LoraConfig

from tests.conftest import step_records
from tests.integration.test_grpo import PROMPTS, config, digits
from trainers import GRPOConfig, GRPOTrainer
from trainers.errors import ConfigError


def params(module):
    return [p.detach().clone() for p in module.parameters()]


def build(model, tmp_path, **overrides):
    return GRPOTrainer(model=model, reward_funcs=digits, train_dataset=PROMPTS,
                       args=config(tmp_path, beta=0.05, lr_scheduler_type="constant", **overrides))


def test_the_reference_mixes_toward_the_policy_every_n_steps(tiny_model_dir, tmp_path):
    trainer = build(tiny_model_dir, tmp_path, max_steps=3, sync_ref_model=True, ref_model_sync_steps=2,
                    ref_model_mixup_alpha=0.25)
    start = params(trainer.ref_model)
    policy_after_2 = []
    trainer.on_log = lambda record: policy_after_2.extend(params(trainer.unwrapped_model)) \
        if record["step"] == 2 else None
    trainer.train()
    # synced once, after step 2: ref = 0.75 x the start + 0.25 x the policy of step 2; step 3 left it alone
    for ref, first, policy in zip(trainer.ref_model.parameters(), start, policy_after_2, strict=True):
        torch.testing.assert_close(ref.detach(), 0.75 * first + 0.25 * policy, rtol=1e-6, atol=1e-7)
    assert not all(torch.equal(a, b) for a, b in zip(start, params(trainer.ref_model)))


def test_a_resumed_run_keeps_the_moved_reference(tiny_model_dir, tmp_path):
    options = dict(max_steps=4, sync_ref_model=True, ref_model_sync_steps=1, ref_model_mixup_alpha=0.5)
    straight = build(tiny_model_dir, tmp_path / "straight", **options)
    straight.train()
    build(tiny_model_dir, tmp_path / "split", **{**options, "max_steps": 2}, save_strategy="steps",
          save_steps=2).train()
    assert (tmp_path / "split" / "out" / "checkpoint-2" / "reference.pt").is_file()
    resumed = build(tiny_model_dir, tmp_path / "split", **options)
    resumed.train(resume_from_checkpoint=True)
    for a, b in zip(params(straight.ref_model), params(resumed.ref_model), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert step_records(resumed)[-1]["kl"] == pytest.approx(step_records(straight)[-1]["kl"], rel=1e-4)


def test_sync_ref_model_needs_a_reference_to_move(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="`sync_ref_model=True` is invalid; with beta=0"):
        GRPOConfig(sync_ref_model=True)
    with pytest.raises(ConfigError, match="does not work with a PEFT model"):
        GRPOTrainer(model=tiny_model_dir, reward_funcs=digits, train_dataset=PROMPTS,
                    args=config(tmp_path, beta=0.05, sync_ref_model=True),
                    peft_config=LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM"))
