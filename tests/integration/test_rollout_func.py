"""GRPO with a rollout_func (TRL's contract) on a tiny model, one CPU process."""

import dataclasses

import pytest
import torch

from trainers import GRPOConfig, GRPOTrainer, SFTTrainer
from trainers.errors import ConfigError, RolloutError
from tests.conftest import config_factory

PROMPTS = [{"prompt": p} for p in ["abc", "hello", "xyz", "12", "the", "cat", "sat", "on"] * 2]
ENV = [ord(c) for c in "obs"]  # the environment's answer, appended after the model's tokens


config = config_factory(GRPOConfig, per_device_train_batch_size=8, num_generations=4, max_completion_length=8,
                        learning_rate=1e-2, max_steps=2)


def digits(completions, **kwargs):
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) + len(c) / 100 for c in completions]


def from_score(completions, score, **kwargs):
    """The rollout's own 'score' field, passed by name."""
    return score


def losses(trainer):
    return [v for r in trainer.state.log_history if "loss" in r for v in (r["loss"], r["grad_norm"])]


def test_a_rollout_func_sampling_the_policy_trains_exactly_as_the_trainer(tiny_model_dir, tmp_path):
    seen = []

    def rollout(prompts, trainer):
        seen.append(list(prompts))
        prompt_ids = [trainer.processing_class(p)["input_ids"] for p in prompts]
        return {"prompt_ids": prompt_ids, "completion_ids": trainer.generate(prompt_ids), "logprobs": None}

    builtin = GRPOTrainer(model=tiny_model_dir, reward_funcs=digits, args=config(tmp_path / "a"),
                          train_dataset=PROMPTS)
    builtin.train()
    custom = GRPOTrainer(model=tiny_model_dir, reward_funcs=digits, args=config(tmp_path / "b"),
                         train_dataset=PROMPTS, rollout_func=rollout)
    custom.train()
    # TRL's contract: this process's prompts of a round, each repeated num_generations times, as given
    assert len(seen) == 2 and all(len(p) == 8 and len(set(p)) == 2 for p in seen)
    assert seen[0][:4] == [seen[0][0]] * 4
    assert losses(custom) == losses(builtin) and losses(builtin)[1] > 0
    for a, b in zip(builtin.model.parameters(), custom.model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert "sampling/sampling_logp_difference/mean" not in custom.state.log_history[0]  # no logprobs given


def test_environment_tokens_are_context_not_loss(tiny_model_dir, tmp_path):
    """Environment tokens appended after the model's (env_mask 0) change neither the loss nor the gradients,
    nor the logged lengths: a run with them trains as a run without them. The reward comes from a rollout
    field, passed by name."""
    def make(with_env: bool):
        def rollout(prompts, trainer):
            prompt_ids = [trainer.processing_class(p)["input_ids"] for p in prompts]
            short = dataclasses.replace(trainer.sampling, max_new_tokens=5)
            generated = trainer.generate(prompt_ids, short)
            score = [sum(chr(t).isdigit() for t in c) + len(c) / 10 for c in generated]
            if not with_env:
                return {"prompt_ids": prompt_ids, "completion_ids": generated, "logprobs": None, "score": score}
            return {"prompt_ids": prompt_ids, "completion_ids": [c + ENV for c in generated], "logprobs": None,
                    "env_mask": [[1] * len(c) + [0] * len(ENV) for c in generated], "score": score}
        return rollout

    runs = []
    for with_env in (False, True):
        trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=from_score, args=config(tmp_path / str(with_env)),
                              train_dataset=PROMPTS, rollout_func=make(with_env))
        trainer.train()
        runs.append(trainer)
    plain, with_env = (t.state.log_history for t in runs)
    assert losses(runs[1]) == pytest.approx(losses(runs[0]), rel=1e-5) and losses(runs[0])[1] > 0
    for key in ("reward", "completions/mean_length", "completions/max_length"):
        assert with_env[0][key] == plain[0][key], key
    assert plain[0]["completions/max_length"] <= 5


def sampler_rollout(shift=lambda row: 0.0, made_up: bool = False):
    """A rollout rendering its own prompts ("Q: ..."), with the policy's exact log-probs of its completions
    minus shift(row) per token (a sampler that rates them lower), or made-up zeros."""
    def rollout(prompts, trainer):
        prompt_ids = [trainer.processing_class("Q: " + p)["input_ids"] for p in prompts]
        completions = trainer.generate(prompt_ids)
        logprobs = []
        for row, (p, c) in enumerate(zip(prompt_ids, completions)):
            with torch.no_grad():
                logits = trainer.unwrapped_model(torch.tensor([p + c])).logits[0, len(p) - 1:-1]
            picked = torch.log_softmax(logits.float(), -1)[torch.arange(len(c)), torch.tensor(c)] - shift(row)
            logprobs.append([0.0] * len(c) if made_up else picked.tolist())
        return {"prompt_ids": prompt_ids, "completion_ids": completions, "logprobs": logprobs}
    return rollout


def test_sampler_logprobs_are_compared_with_the_trainers(tiny_model_dir, tmp_path):
    """The rollout renders its own prompts, so the trainer must train on its prompt_ids: log-probs computed
    from them agree with the trainer's to float noise; made-up ones show the gap."""
    gaps = []
    for made_up in (False, True):
        trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=digits, args=config(tmp_path / str(made_up)),
                              train_dataset=PROMPTS, rollout_func=sampler_rollout(made_up=made_up))
        trainer.train()
        record = trainer.state.log_history[0]
        gaps.append((record["sampling/sampling_logp_difference/mean"],
                     record["sampling/sampling_logp_difference/max"]))
    (_, exact_max), (zero_mean, _) = gaps
    assert exact_max < 1e-4
    assert zero_mean > 1.0  # |log p| of a near-uniform 259-token policy: ~5


def first_step(tiny_model_dir, tmp_path, rollout, **overrides):
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=digits, train_dataset=PROMPTS, rollout_func=rollout,
                          args=config(tmp_path, max_steps=1, **overrides))
    trainer.train()
    return trainer.state.log_history[0]


def test_token_weights_correct_a_sampler_that_rates_every_token_lower(tiny_model_dir, tmp_path):
    """A sampler 0.1 nat below the policy on every token: token_truncate weights every token e^0.1, so the
    first step's loss and gradient are e^0.1 times those without the correction."""
    lower = sampler_rollout(shift=lambda row: 0.1)
    on = first_step(tiny_model_dir, tmp_path / "on", lower, vllm_importance_sampling_mode="token_truncate")
    off = first_step(tiny_model_dir, tmp_path / "off", lower, vllm_importance_sampling_correction=False)
    e = torch.tensor(0.1).exp().item()
    for key in ("min", "mean", "max"):
        assert on[f"sampling/importance_sampling_ratio/{key}"] == pytest.approx(e, rel=1e-4), key
    assert "sampling/importance_sampling_ratio/mean" not in off and off["sampling/sampling_logp_difference/mean"] \
        == pytest.approx(0.1, rel=1e-3)
    assert on["grad_norm"] == pytest.approx(e * off["grad_norm"], rel=1e-4) and off["grad_norm"] > 0
    assert on["loss"] == pytest.approx(e * off["loss"], rel=1e-4, abs=1e-7)


def test_sequence_mask_drops_completions_the_sampler_rated_far_lower(tiny_model_dir, tmp_path):
    """TRL's default, sequence_mask with C_max 3: rows whose sampler is 2 nats lower per token (ratio >= e^2)
    leave the loss; the exact rows keep weight ~1."""
    half = sampler_rollout(shift=lambda row: 2.0 if row % 2 else 0.0)
    on = first_step(tiny_model_dir, tmp_path / "on", half)
    off = first_step(tiny_model_dir, tmp_path / "off", half, vllm_importance_sampling_correction=False)
    assert on["sampling/importance_sampling_ratio/min"] == 0.0
    assert on["sampling/importance_sampling_ratio/max"] == pytest.approx(1.0, abs=1e-4)
    assert on["sampling/importance_sampling_ratio/mean"] == pytest.approx(0.5, abs=1e-4)
    assert on["grad_norm"] != pytest.approx(off["grad_norm"], rel=1e-2)
    exact = first_step(tiny_model_dir, tmp_path / "exact", sampler_rollout())  # weights ~1: no change
    assert exact["grad_norm"] == pytest.approx(off["grad_norm"], rel=1e-4)


def test_vespo_needs_a_token_level_correction(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="loss_type='vespo' with a rollout_func needs vllm_importance_sampling_mode"):
        GRPOTrainer(model=tiny_model_dir, reward_funcs=digits, train_dataset=PROMPTS, rollout_func=sampler_rollout(),
                    args=config(tmp_path, loss_type="vespo"))
    GRPOTrainer(model=tiny_model_dir, reward_funcs=digits, train_dataset=PROMPTS, rollout_func=sampler_rollout(),
                args=config(tmp_path, loss_type="vespo", vllm_importance_sampling_mode="token_mask"))


def test_evaluation_scores_the_rollouts(tiny_model_dir, tmp_path):
    def rollout(prompts, trainer):
        n = len(prompts)
        return {"prompt_ids": [[ord("q")]] * n, "completion_ids": [[ord("7")]] * n, "logprobs": None,
                "score": [float(len(p)) for p in prompts]}

    eval_rows = [{"prompt": "ab"}, {"prompt": "abcd"}]
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=from_score, args=config(tmp_path),
                          train_dataset=PROMPTS, eval_dataset=eval_rows, rollout_func=rollout)
    assert trainer.evaluate()["eval_reward"] == pytest.approx(3.0)  # (2 + 4) / 2, over 4 completions each


def test_a_failing_rollout_func_names_itself(tiny_model_dir, tmp_path):
    def broken(prompts, trainer):
        return {"prompt_ids": [[1]] * len(prompts), "completion_ids": [[2] * 9] * len(prompts), "logprobs": None}

    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=digits, args=config(tmp_path), train_dataset=PROMPTS,
                          rollout_func=broken)
    with pytest.raises(RolloutError, match="completion of 9 tokens in row 0; max_completion_length=8"):
        trainer.train()
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=digits, args=config(tmp_path), train_dataset=PROMPTS,
                          rollout_func=lambda prompts, trainer: 1 / 0)
    with pytest.raises(RolloutError, match="rollout_func raised ZeroDivisionError: division by zero"):
        trainer.train()


def test_unsupported_trainer_arguments_are_refused_by_name(tiny_model_dir, tmp_path):
    def tool(x: int) -> int:
        """Doubles x."""
        return 2 * x

    with pytest.raises(ConfigError, match="a rollout_func runs its own episodes; pass tools/environment_factory"):
        GRPOTrainer(model=tiny_model_dir, reward_funcs=digits, args=config(tmp_path), train_dataset=PROMPTS,
                    tools=[tool], rollout_func=lambda prompts, trainer: {})
    with pytest.raises(ConfigError, match="rollout_func must be a function .* got str"):
        GRPOTrainer(model=tiny_model_dir, reward_funcs=digits, args=config(tmp_path), train_dataset=PROMPTS,
                    rollout_func="mine")
    with pytest.raises(ConfigError, match="data_collator=...\\) is not supported"):
        SFTTrainer(model=tiny_model_dir, train_dataset=[{"text": "hi"}], data_collator=lambda rows: rows)


def test_the_documented_two_turn_episode_trains(tiny_model_dir, tmp_path):
    """docs/grpo.md's calculator episode: two turns around an observation; the field it adds reaches the
    reward function, and the environment's tokens are left out of the logged lengths."""
    def eval_sum(text):
        return len(text)

    model_tokens = []  # per completion: the tokens the model wrote in its two turns

    def calculator_episode(prompts, trainer):
        tok = trainer.processing_class
        prompt_ids = [tok(p)["input_ids"] for p in prompts]
        turn = dataclasses.replace(trainer.sampling, max_new_tokens=16)
        first = trainer.generate(prompt_ids, turn)
        observations = [tok(f" = {eval_sum(tok.decode(c))}\n", add_special_tokens=False)["input_ids"] for c in first]
        second = trainer.generate([p + c + o for p, c, o in zip(prompt_ids, first, observations)], turn)
        model_tokens.extend(len(c) + len(s) for c, s in zip(first, second))
        return {"prompt_ids": prompt_ids,
                "completion_ids": [c + o + s for c, o, s in zip(first, observations, second)],
                "env_mask": [[1] * len(c) + [0] * len(o) + [1] * len(s) for c, o, s in zip(first, observations, second)],
                "logprobs": None,
                "tool_calls": [1] * len(prompts)}

    def used_the_tool(completions, tool_calls, **kwargs):
        return [float(n) + len(c) / 100 for n, c in zip(tool_calls, completions)]

    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=used_the_tool,
                          args=config(tmp_path, max_completion_length=40, max_steps=1), train_dataset=PROMPTS,
                          rollout_func=calculator_episode)
    trainer.train()
    record = trainer.state.log_history[0]
    assert record["reward"] > 1.0 and record["grad_norm"] > 0
    assert len(model_tokens) == 8  # one round: 2 prompts x 4 generations
    # the logged lengths count the model's tokens of both turns; the observation's are not counted
    assert record["completions/max_length"] == max(model_tokens) <= 32
    assert record["completions/mean_length"] == pytest.approx(sum(model_tokens) / 8)
