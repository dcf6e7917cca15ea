"""Contracts a TRL script relies on, each found by running TRL 1.16 and this project side by side."""

import json

import numpy as np
import pytest

from trainers import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer


def sft_args(tmp_path, **overrides):
    return SFTConfig(**{"output_dir": str(tmp_path), "per_device_train_batch_size": 2, "max_steps": 4,
                        "learning_rate": 1e-3, "disable_tqdm": True, "save_strategy": "no", "report_to": "none",
                        **overrides})


def grpo_args(tmp_path, **overrides):
    return GRPOConfig(**{"output_dir": str(tmp_path), "per_device_train_batch_size": 4, "num_generations": 4,
                         "max_completion_length": 6, "max_steps": 1, "disable_tqdm": True, "save_strategy": "no",
                         "report_to": "none", **overrides})


ROWS = [{"text": f"row {i} " + "abc " * (i + 1)} for i in range(8)]


def test_sft_eos_token_reaches_the_saved_model_configs(tiny_model_dir, tmp_path):
    trainer = SFTTrainer(model=tiny_model_dir, train_dataset=ROWS, args=sft_args(tmp_path, max_steps=1,
                                                                                   eos_token="<|endoftext|>"))
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    new = trainer.processing_class.convert_tokens_to_ids("<|endoftext|>")
    config = json.loads((tmp_path / "final" / "config.json").read_text())
    generation = json.loads((tmp_path / "final" / "generation_config.json").read_text())
    assert config["eos_token_id"] == new
    assert generation["eos_token_id"][0] == new and len(generation["eos_token_id"]) == 2  # the old one kept


@pytest.mark.parametrize("logging_steps", [1, 3])
def test_training_loss_is_the_mean_of_every_step_whatever_logging_steps(tiny_model_dir, tmp_path, logging_steps):
    trainer = SFTTrainer(model=tiny_model_dir, train_dataset=ROWS,
                         args=sft_args(tmp_path, logging_steps=logging_steps, shuffle_dataset=False))
    step_losses = []
    original = trainer._optimizer_step
    trainer._optimizer_step = lambda *a, **k: (lambda m: (step_losses.append(m["loss"]), m)[1])(original(*a, **k))
    output = trainer.train()
    assert len(step_losses) == 4
    assert output.training_loss == pytest.approx(sum(step_losses) / 4, rel=1e-6)


def test_grpo_stops_on_the_generation_configs_end_ids(tiny_model_dir, tmp_path):
    """Qwen3's generation config ends on <|endoftext|> as well as the tokenizer's <|im_end|>; TRL stops on both."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    extra = 100  # a byte token, made an end id by the generation config
    model.generation_config.eos_token_id = [model.config.eos_token_id, extra]

    def always_extra(module, inputs, logits):  # [B, T, V] -> the model always emits token 100
        logits = logits.clone()
        logits[..., extra] += 1e4
        return logits

    model.lm_head.register_forward_hook(always_extra)
    trainer = GRPOTrainer(model=model, processing_class=AutoTokenizer.from_pretrained(tiny_model_dir),
                          reward_funcs=lambda completions, **kw: [0.0] * 4,
                          train_dataset=[{"prompt": "hi"}] * 4, args=grpo_args(tmp_path))
    trainer.train()
    record = trainer.state.log_history[0]
    assert record["completions/mean_length"] == 1.0 and record["completions/clipped_ratio"] == 0.0


def test_reward_functions_may_return_numpy_numbers_and_never_see_completion_columns(tiny_model_dir, tmp_path):
    seen = {}

    def reward(completions, completion_ids, **kwargs):
        seen.update(kwargs)
        return [np.float32(1.0)] * len(completions)

    rows = [{"prompt": "hi", "completion": "text", "completion_ids": [1, 2], "answer": "x"}] * 4
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=reward, train_dataset=rows, args=grpo_args(tmp_path))
    trainer.train()
    assert trainer.state.log_history[0]["reward"] == 1.0
    assert "answer" in seen and "completion" not in seen  # completion_ids arrived as the generated ids


def test_a_moe_model_is_told_that_the_router_loss_is_not_added():
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from trainers.modeling import missing_router_loss

    shape = dict(vocab_size=300, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                 intermediate_size=32)
    moe = Qwen3MoeForCausalLM(Qwen3MoeConfig(**shape, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                                             head_dim=16))
    assert "router_aux_loss_coef=0.001" in missing_router_loss(moe)
    assert missing_router_loss(Qwen2ForCausalLM(Qwen2Config(**shape))) is None


def test_grpo_metrics_cover_every_round_of_a_step(tiny_model_dir, tmp_path):
    """Two generation rounds per optimizer step; round k scores every completion k: the step logs 0.5 (TRL too)."""
    calls = []

    def round_index(completions, **kwargs):
        calls.append(1)
        return [float(len(calls) - 1)] * len(completions)

    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=round_index, train_dataset=[{"prompt": "ab"}] * 8,
                          args=grpo_args(tmp_path, gradient_accumulation_steps=2, generation_batch_size=4))
    trainer.train()
    assert len(calls) == 2
    assert trainer.state.log_history[0]["reward"] == 0.5
    assert trainer.state.log_history[0]["rewards/round_index/mean"] == 0.5


def test_reward_functions_of_one_name_log_their_mean(tiny_model_dir, tmp_path):
    import functools

    def constant(completions, value, **kwargs):
        return [value] * len(completions)

    trainer = GRPOTrainer(model=tiny_model_dir, train_dataset=[{"prompt": "ab"}] * 4, args=grpo_args(tmp_path),
                          eval_dataset=[{"prompt": "cd"}] * 2,
                          reward_funcs=[functools.partial(constant, value=1.0), functools.partial(constant, value=3.0)])
    assert trainer.evaluate()["eval_rewards/constant/mean"] == 2.0
    trainer.train()
    assert trainer.state.log_history[0]["rewards/constant/mean"] == 2.0  # TRL: the mean of both functions' means
    assert trainer.state.log_history[0]["reward"] == 4.0  # the weighted sum is unchanged


def test_num_tokens_counts_a_rollout_once_whatever_num_iterations(tiny_model_dir, tmp_path):
    totals = {}
    for iterations in (1, 2):
        trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                              train_dataset=[{"prompt": "ab"}] * 8,
                              args=grpo_args(tmp_path / str(iterations), max_steps=2, num_iterations=iterations,
                                             generation_kwargs={"min_new_tokens": 6}))
        trainer.train()
        totals[iterations] = trainer.state.num_tokens
    # two steps: two rounds with one iteration; one round trained twice with two (TRL counts it once)
    assert totals[2] * 2 == totals[1] > 0
