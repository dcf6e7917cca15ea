"""RLOOTrainer end to end on a tiny model, one CPU process: it learns, logs TRL's metric names, its rounds'
advantages are the leave-one-out ones of the KL-penalized rewards, TRL's contract (options, arguments, the
trl/scripts/rloo.py body), and errors for GRPO's options."""

import inspect

import pytest
import torch
from transformers import TrainerCallback

from tests.conftest import config_factory, digits, step_records
from trainers import RLOOConfig, RLOOTrainer
from trainers.errors import ConfigError
from trainers.rloo.objective import leave_one_out_advantages, sequence_kl

try:
    import trl

    HAVE_TRL = True
except ImportError:  # not installed (CI)
    HAVE_TRL = False

PROMPTS = [{"prompt": p} for p in ["abc", "hello", "xyz", "12", "the", "cat", "sat", "on"] * 4]


config = config_factory(RLOOConfig, per_device_train_batch_size=16, num_generations=4, max_completion_length=8,
                        learning_rate=1e-2, max_steps=2)


def test_rloo_learns_and_logs_trls_metrics(tiny_model_dir, tmp_path):
    """beta=0 (no reference; with beta 0.05 the KL penalty of 8-token completions outweighs this reward's 0.2)."""
    trainer = RLOOTrainer(model=tiny_model_dir, reward_funcs=digits, train_dataset=PROMPTS,
                          args=config(tmp_path, max_steps=16, logging_steps=4, beta=0.0, learning_rate=3e-2))
    trainer.train()
    records = step_records(trainer)
    assert records[0]["reward"] < 0.1  # digits are 10 of 259 byte tokens
    assert records[-1]["reward"] > 0.5, [r["reward"] for r in records]
    for key in ("loss", "reward", "reward_std", "rewards/digits/mean", "rewards/digits/std", "entropy",
                "clip_ratio/low_mean", "clip_ratio/low_min", "clip_ratio/high_mean", "clip_ratio/high_max",
                "clip_ratio/region_mean", "frac_reward_zero_std", "completions/mean_length",
                "completions/clipped_ratio", "num_tokens", "learning_rate", "grad_norm"):
        assert key in records[-1], key
    assert trainer.ref_model is None and "kl" not in records[-1]  # beta=0: no reference model


class Rounds(TrainerCallback):
    """Each round's rollout and metrics, from the rollout_end event."""

    def __init__(self):
        self.rounds = []

    def on_rollout_end(self, args, state, control, rollout=None, metrics=None, **kwargs):
        self.rounds.append((rollout, metrics))


@pytest.mark.parametrize("normalize", [False, True])
def test_a_rounds_advantages_are_the_leave_one_out_of_the_penalized_rewards(tiny_model_dir, tmp_path, normalize):
    """Recomputed from the round itself (its old and reference log-probs) and the rewards the function gave:
    clipped to reward_clip_range, less beta x the sequence KL, minus the mean of the group's others."""
    given = []

    def recorded(completions, **kwargs):
        values = [float(len(c) % 5) for c in completions]
        given.extend(values)
        return values

    rounds = Rounds()
    trainer = RLOOTrainer(model=tiny_model_dir, reward_funcs=recorded, train_dataset=PROMPTS, callbacks=[rounds],
                          args=config(tmp_path, beta=0.3, reward_clip_range=(0.5, 3.0), max_steps=2,
                                      normalize_advantages=normalize))
    trainer.train()
    rollout, metrics = rounds.rounds[-1]
    kl = sequence_kl(rollout.old_logps, rollout.ref_logps, rollout.loss_mask)  # [16]
    rewards = torch.tensor(given[-16:]).clamp(0.5, 3.0) - 0.3 * kl
    expected = leave_one_out_advantages(rewards, 4, normalize=normalize)
    torch.testing.assert_close(rollout.advantages, expected, rtol=1e-5, atol=1e-6)
    assert metrics["kl"] == pytest.approx(float(kl.sum() / rollout.loss_mask.sum()), rel=1e-5)
    assert metrics["reward"] == pytest.approx(sum(given[-16:]) / 16, rel=1e-6)  # logged without the penalty
    assert bool((rollout.old_logps != 0).any()) and kl.abs().sum() > 0  # the policy moved after step 1


def test_options_and_defaults_are_trls():
    args = RLOOConfig(output_dir="unused")
    assert (args.num_generations, args.beta, args.normalize_advantages, args.reward_clip_range) == (2, 0.05, False,
                                                                                                    None)
    for option, value in (("loss_type", "grpo"), ("scale_rewards", "none"), ("entropy_coef", 0.1),
                          ("vllm_importance_sampling_correction", True)):
        with pytest.raises(ConfigError, match=f"RLOOConfig has no option `{option}`"):
            RLOOConfig(output_dir="unused", **{option: value})
    with pytest.raises(ConfigError, match="reward_clip_range"):
        RLOOConfig(output_dir="unused", reward_clip_range=(2.0, 1.0))
    with pytest.raises(ConfigError, match="num_generations"):
        RLOOConfig(output_dir="unused", num_generations=1)
    # every field against TRL 1.16's RLOOConfig: tests/unit/test_trl_config_fields.py


def test_rloo_takes_trls_arguments_in_trls_order():
    order = ["model", "reward_funcs", "args", "train_dataset", "eval_dataset", "processing_class",
             "reward_processing_classes", "callbacks", "optimizers", "quantization_config", "peft_config"]
    ours = list(inspect.signature(RLOOTrainer.__init__).parameters)[1:]
    assert ours[:len(order)] == order and ours[len(order):] == ["tools", "rollout_func", "environment_factory"]
    if HAVE_TRL:
        assert list(inspect.signature(trl.RLOOTrainer.__init__).parameters)[1:] == order


def test_trl_rloo_script_trains_and_saves(tiny_model_dir, tmp_path):
    """trl/scripts/rloo.py main(), TRL 1.16, from the trainer on (its reward functions resolved by the script)."""
    training_args = RLOOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=2,
                               max_completion_length=4, max_steps=2, save_strategy="no", disable_tqdm=True,
                               report_to="none", eval_strategy="steps", eval_steps=2)
    dataset = {"train": PROMPTS[:8], "test": PROMPTS[:2]}
    trainer = RLOOTrainer(
        model=tiny_model_dir,
        reward_funcs=[digits],
        args=training_args,
        train_dataset=dataset["train"],
        eval_dataset=dataset["test"] if training_args.eval_strategy != "no" else None,
        quantization_config=None,
        peft_config=None,
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.accelerator.print("✅ Training completed.")
    trainer.save_model(training_args.output_dir)
    assert not training_args.push_to_hub
    assert trainer.state.global_step == 2 and (tmp_path / "out" / "model.safetensors").is_file()
    evaluated = [r for r in trainer.state.log_history if "eval_loss" in r]
    assert len(evaluated) == 1 and "eval_reward" in evaluated[0] and "eval_kl" in evaluated[0]
