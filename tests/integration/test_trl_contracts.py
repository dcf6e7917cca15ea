"""Contracts a TRL script relies on, each found by running TRL 1.16 and this project side by side."""

import dataclasses
import json
import math

import numpy as np
import pytest
import torch

from tests.conftest import step_records
from trainers import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer
from trainers.errors import ConfigError


def sft_args(tmp_path, **overrides):
    return SFTConfig(**{"output_dir": str(tmp_path), "per_device_train_batch_size": 2, "max_steps": 4,
                        "learning_rate": 1e-3, "disable_tqdm": True, "save_strategy": "no", "report_to": "none",
                        "logging_steps": 1, **overrides})


def grpo_args(tmp_path, **overrides):
    return GRPOConfig(**{"output_dir": str(tmp_path), "per_device_train_batch_size": 4, "num_generations": 4,
                         "max_completion_length": 6, "max_steps": 1, "disable_tqdm": True, "save_strategy": "no",
                         "report_to": "none", "logging_steps": 1, **overrides})


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


def test_training_loss_is_the_mean_of_every_step_whatever_logging_steps(tiny_model_dir, tmp_path):
    """Each step's loss from a run that logs every step; the same run (seed, data order) logging every 3 steps
    (one record, of steps 1-3) reports the mean of all 4 as training_loss, not what it logged."""
    def run(logging_steps):
        trainer = SFTTrainer(model=tiny_model_dir, train_dataset=ROWS,
                             args=sft_args(tmp_path / str(logging_steps), logging_steps=logging_steps,
                                           shuffle_dataset=False))
        return trainer, trainer.train()

    every, output = run(1)
    step_losses = [r["loss"] for r in every.state.log_history if "loss" in r]
    assert len(step_losses) == 4
    assert output.training_loss == pytest.approx(sum(step_losses) / 4, rel=1e-6)
    sparse, output = run(3)
    logged = [r["loss"] for r in sparse.state.log_history if "loss" in r]
    assert logged == [pytest.approx(sum(step_losses[:3]) / 3, rel=1e-5)]
    assert output.training_loss == pytest.approx(sum(step_losses) / 4, rel=1e-5)


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
    for stat in ("mean", "min", "max"):  # every completion ended (with the extra end id) after one token
        assert record[f"completions/{stat}_terminated_length"] == 1.0


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


def tiny_moe(tokenizer, **config):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, intermediate_size=32, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, **config))


def test_router_aux_loss_coef_is_chosen_as_in_trl(tokenizer):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from trainers.errors import ConfigError
    from trainers.model.modeling import router_aux_loss_coef

    moe = tiny_moe(tokenizer)
    assert router_aux_loss_coef(moe, None) == 0.001  # the model config's
    assert router_aux_loss_coef(moe, 0.5) == 0.5 and router_aux_loss_coef(moe, 0.0) == 0.0
    dense = Qwen2ForCausalLM(Qwen2Config(vocab_size=300, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=1, intermediate_size=32))
    assert router_aux_loss_coef(dense, None) == 0.0
    with pytest.raises(ConfigError, match="router_aux_loss_coef=0.5.*not a Mixture-of-Experts"):
        router_aux_loss_coef(dense, 0.5)


@pytest.mark.parametrize("trainer_class", ["sft", "grpo"])
def test_a_moe_models_router_loss_joins_the_training_loss(tokenizer, tmp_path, trainer_class):
    """The first step's loss (before any update) with the router loss minus the one without is coef x aux_loss,
    and the router's weights get a gradient from it."""
    first = {}
    for coef in (0.0, 2.0):
        model = tiny_moe(tokenizer)
        if trainer_class == "sft":
            trainer = SFTTrainer(model=model, processing_class=tokenizer, train_dataset=ROWS,
                                 args=sft_args(tmp_path / str(coef), max_steps=1, router_aux_loss_coef=coef))
        else:  # equal rewards: advantages 0, so the policy loss is 0 and only the router loss is left
            trainer = GRPOTrainer(model=model, processing_class=tokenizer, train_dataset=[{"prompt": "ab"}] * 4,
                                  reward_funcs=lambda completions, **kw: [1.0] * len(completions),
                                  args=grpo_args(tmp_path / str(coef), router_aux_loss_coef=coef))
        gate = next(p for n, p in model.named_parameters() if n.endswith("mlp.gate.weight"))
        before = gate.detach().clone()
        trainer.train()
        first[coef] = trainer.state.log_history[0]
        first[coef]["gate_moved"] = not torch.equal(before, gate.detach())
    assert "aux_loss" not in first[0.0] and first[2.0]["aux_loss"] > 0
    assert first[2.0]["loss"] - first[0.0]["loss"] == pytest.approx(2.0 * first[2.0]["aux_loss"], rel=1e-4)
    if trainer_class == "grpo":
        assert first[0.0]["loss"] == 0.0 and not first[0.0]["gate_moved"] and first[2.0]["gate_moved"]


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
    first_step = trainer.state.log_history[1]  # [0]: the evaluation above
    assert first_step["rewards/constant/mean"] == 2.0  # TRL: the mean of both functions' means
    assert first_step["reward"] == 4.0  # the weighted sum is unchanged


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


def test_reward_functions_log_metrics_and_completion_columns(tiny_model_dir, tmp_path):
    """TRL's log_metric / log_extra hooks: a metric is the mean of every call (train and eval); an extra column
    joins the logged completions, next to each function's reward."""
    def judged(completions, log_metric, log_extra, **kwargs):
        log_metric("judge/calls", 1.0)
        log_metric("judge/calls", 3.0)
        log_extra("verdict", [f"v{i}" for i in range(len(completions))])
        return [0.5] * len(completions)

    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=[judged, lambda completions, **kw: [None] * len(completions)],
                          train_dataset=[{"prompt": "ab"}] * 4, eval_dataset=[{"prompt": "cd"}] * 2,
                          args=grpo_args(tmp_path, log_completions=True))
    assert trainer.evaluate()["eval_judge/calls"] == 2.0
    trainer.train()
    assert trainer.state.log_history[1]["judge/calls"] == 2.0  # [0]: the evaluation above
    samples = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert [s["verdict"] for s in samples] == ["v0", "v1", "v2", "v3"]
    assert all(s["rewards"] == {"judged": 0.5, "<lambda>": None} and s["reward"] == 0.5 for s in samples)


def test_async_and_boolean_reward_functions_train(tiny_model_dir, tmp_path):
    import asyncio

    async def judge(completions, **kwargs):  # e.g. an LLM judge behind an HTTP client
        await asyncio.sleep(0)
        return [2.0] * len(completions)

    trainer = GRPOTrainer(model=tiny_model_dir, train_dataset=[{"prompt": "ab"}] * 4, args=grpo_args(tmp_path),
                          reward_funcs=[judge, lambda completions, **kw: [True] * len(completions)])
    trainer.train()
    assert trainer.state.log_history[0]["rewards/judge/mean"] == 2.0
    assert trainer.state.log_history[0]["reward"] == 3.0  # True counts 1.0, as in TRL


@pytest.mark.parametrize("second_group, scale_rewards, expected", [
    (1.0, "group", 0.5),  # one group of equal rewards out of two
    (1.0, "batch", 0.0),  # TRL: over the std in use, the batch's, which is not zero
    (None, "group", 0.0),  # an unscored group has a NaN std, which TRL does not count as zero
])
def test_frac_reward_zero_std_is_over_the_std_in_use(tiny_model_dir, tmp_path, second_group, scale_rewards, expected):
    def reward(prompts, completions, **kwargs):  # prompt "ab": 0, 1, 2, 3; prompt "cd": second_group
        return [float(i) if p == "ab" else second_group for i, p in enumerate(prompts)]

    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=reward, train_dataset=[{"prompt": "ab"}, {"prompt": "cd"}],
                          args=grpo_args(tmp_path, per_device_train_batch_size=8, scale_rewards=scale_rewards,
                                         shuffle_dataset=False))
    trainer.train()
    assert trainer.state.log_history[0]["frac_reward_zero_std"] == expected


def test_sequence_level_clip_ratio_counts_completions(tiny_model_dir, tmp_path):
    """At importance_sampling_level="sequence" TRL's clip_ratio is the share of clipped completions, every row
    counted, not of tokens."""
    from trainers.model.losses import BatchCounts

    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                          train_dataset=[{"prompt": "ab"}] * 4,
                          args=grpo_args(tmp_path, importance_sampling_level="sequence", num_iterations=2,
                                         generation_kwargs={"min_new_tokens": 6}))
    trainer.prepare_step(0)
    batch = trainer.micro_batch(0, 0)
    logps = trainer.policy_logprobs(trainer.model, batch)["logps"].detach()  # [4, 6]
    loss_mask = batch.loss_mask.clone()
    loss_mask[1] = 0.0  # a masked (e.g. truncated) row still counts as one unclipped completion
    batch = dataclasses.replace(batch, old_logps=logps - torch.tensor([1.0, 0.0, 0.0, 0.0]).unsqueeze(1),  # row 0: e > 1 + ε
                                advantages=torch.tensor([1.0, 1.0, -1.0, 1.0]), loss_mask=loss_mask)
    counts = BatchCounts(tokens=float(batch.loss_mask.sum()), sequences=4.0, micro_batches=1)
    _, stats = trainer.compute_loss(trainer.model, batch, counts)
    high, rows = stats["clip_ratio/high_mean"]
    assert (float(high), float(rows)) == (1.0, 4.0)  # by tokens it would be 6 / 18
    # TRL's per-micro-batch ratios, reduced by min / max over processes
    assert stats["clip_ratio/high_max"].reduce == "max" and float(stats["clip_ratio/high_max"].value) == 0.25
    assert stats["clip_ratio/low_min"].reduce == "min" and float(stats["clip_ratio/low_min"].value) == 0.0


def donor_tokenizer_folder(path) -> str:
    """A tokenizer whose chat template needs three special tokens the tiny model's tokenizer lacks."""
    from trainers.cli.tiny import build_tokenizer

    donor = build_tokenizer(chat_template=False)
    donor.add_special_tokens({"additional_special_tokens": ["<|user|>", "<|bot|>", "<|end|>"]})
    donor.eos_token = "<|end|>"
    donor.chat_template = ("{% for m in messages %}{{ '<|user|>' if m['role'] == 'user' else '<|bot|>' }}"
                           "{{ m['content'] }}<|end|>{% endfor %}{% if add_generation_prompt %}<|bot|>{% endif %}")
    donor.save_pretrained(str(path))
    return str(path)


CHATS = [{"messages": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": "hello"}]}
         for i in range(4)]


def test_chat_template_path_clones_a_tokenizers_template_and_tokens(tiny_model_dir, tmp_path):
    """TRL's clone_chat_template: the donor's missing tokens are added (single ids, not bytes), its EOS becomes
    the EOS of the tokenizer, model config and generation config, and the embeddings are resized to the
    vocabulary rounded up to a multiple of 64."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trainer = SFTTrainer(model=tiny_model_dir, train_dataset=CHATS,
                         args=sft_args(tmp_path, max_steps=2,
                                       chat_template_path=donor_tokenizer_folder(tmp_path / "donor")))
    tokenizer = trainer.processing_class
    user, bot, end = tokenizer.convert_tokens_to_ids(["<|user|>", "<|bot|>", "<|end|>"])
    assert (user, bot, end) == (259, 260, 261) and len(tokenizer.get_vocab()) == 320  # 259 + 3, then 58 dummies
    assert trainer.train_rows[0]["input_ids"][0] == user and trainer.train_rows[0]["input_ids"].count(end) == 2
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "final"))
    saved = AutoTokenizer.from_pretrained(str(tmp_path / "final"))
    assert model.get_input_embeddings().weight.shape[0] == 320 and len(saved.get_vocab()) == 320
    assert model.config.eos_token_id == end and model.generation_config.eos_token_id == end
    assert saved.eos_token == "<|end|>" and saved.chat_template == tokenizer.chat_template


@pytest.mark.parametrize("tied", [True, False])
def test_chat_template_path_tokens_train_under_peft(tmp_path, tied):
    """The added tokens' embedding rows train beside the adapters; an untied output head trains whole."""
    from peft import LoraConfig

    from trainers.cli.tiny import save_tiny_model

    model_dir = save_tiny_model(str(tmp_path / "model"), tie_word_embeddings=tied)
    peft_config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    trainer = SFTTrainer(model=model_dir, train_dataset=CHATS, peft_config=peft_config,
                         args=sft_args(tmp_path, max_steps=3, learning_rate=1e-2,
                                       chat_template_path=donor_tokenizer_folder(tmp_path / "donor")))
    added = list(range(259, 320))  # the donor's 3 tokens and the 58 dummies
    assert peft_config.trainable_token_indices == {"embed_tokens": added}
    assert ("lm_head" in (peft_config.modules_to_save or [])) == (not tied)
    embeddings = lambda: trainer.unwrapped_model.get_input_embeddings()(torch.tensor([[0, 259]]))[0].detach().clone()  # noqa: E731
    before = embeddings()
    trainer.train()
    after = embeddings()
    assert torch.equal(before[0], after[0]) and not torch.equal(before[1], after[1])  # a byte frozen, <|user|> trained
    trainer.save_model(str(tmp_path / "final"))
    assert (tmp_path / "final" / "adapter_model.safetensors").exists()


def test_a_chat_template_path_that_is_neither_file_nor_tokenizer_is_named(tiny_model_dir, tmp_path):
    from trainers.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match=r"chat_template_path '\./missing/template\.jinja' is neither"):
        SFTTrainer(model=tiny_model_dir, train_dataset=CHATS,
                   args=sft_args(tmp_path, chat_template_path="./missing/template.jinja"))


def test_evaluate_takes_a_dataset_and_a_prefix_as_in_transformers(tiny_model_dir, tmp_path):
    """evaluate(eval_dataset=...) evaluates that dataset and keeps the trainer's; metric_key_prefix names them."""
    from trainers.errors import ConfigError, DatasetFormatError

    held_out = [{"text": "zz " * 20}] * 2
    trainer = SFTTrainer(model=tiny_model_dir, train_dataset=ROWS, eval_dataset=ROWS[:2], args=sft_args(tmp_path))
    own = trainer.evaluate()["eval_loss"]
    other = trainer.evaluate(eval_dataset=held_out, metric_key_prefix="test")
    assert set(other) == {"test_loss", "test_mean_token_accuracy", "test_runtime", "test_samples_per_second",
                          "test_steps_per_second"} and other["test_loss"] != own
    assert trainer.evaluate()["eval_loss"] == own  # the trainer's eval_dataset is back
    with pytest.raises(DatasetFormatError, match="eval_dataset"):
        trainer.evaluate(eval_dataset=[{"prompt_only": "x"}])
    assert trainer.evaluate()["eval_loss"] == own

    grpo = GRPOTrainer(model=tiny_model_dir, train_dataset=[{"prompt": "ab"}] * 4, args=grpo_args(tmp_path / "g"),
                       reward_funcs=lambda prompts, **kw: [float(len(p)) for p in prompts])
    with pytest.raises(ConfigError, match="needs an eval_dataset"):
        grpo.evaluate()
    assert grpo.evaluate(eval_dataset=[{"prompt": "abcde"}])["eval_reward"] == 5.0
    assert not grpo.has_eval_data()


@pytest.mark.parametrize("loss_type, same_gradient_as", [("cispo", "dapo"), ("sapo", "grpo"), ("vespo", "dapo")])
def test_cispo_sapo_vespo_train_with_the_policy_gradient_on_policy(tiny_model_dir, tmp_path, loss_type,
                                                                    same_gradient_as):
    """TRL's cispo, sapo and vespo losses. On policy (w = 1) CISPO's and VESPO's gradients are -A·∇log π over
    the step's tokens, as DAPO's, and SAPO's gate has slope 1, as GRPO's mean of sequence means: the first
    step's gradient norms match (completions of different lengths, so the two aggregations differ)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def reward(completions, **kwargs):  # differs within a group, so advantages are not zero
        return [float(sum(map(ord, c)) % 7) for c in completions]

    def likely_eos(module, inputs, logits):  # [B, T, V]: EOS about one sample in three, so lengths vary
        logits = logits.clone()
        logits[..., module.eos_id] += 5.0
        return logits

    first, lengths = {}, set()
    for name in (loss_type, same_gradient_as, "grpo" if same_gradient_as == "dapo" else "dapo"):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        model.lm_head.eos_id = model.config.eos_token_id
        model.lm_head.register_forward_hook(likely_eos)
        trainer = GRPOTrainer(model=model, processing_class=AutoTokenizer.from_pretrained(tiny_model_dir),
                              reward_funcs=reward, train_dataset=[{"prompt": "ab"}] * 8,
                              args=grpo_args(tmp_path / name, loss_type=name, epsilon_high=5.0, max_steps=2, seed=3,
                                             log_completions=True))
        trainer.train()
        first[name] = trainer.state.log_history[0]
        lengths |= {len(s["completion"]) for s in map(json.loads, open(tmp_path / name / "completions.jsonl"))}
    assert len(lengths) > 1
    other = [name for name in first if name not in (loss_type, same_gradient_as)][0]
    assert first[other]["grad_norm"] != pytest.approx(first[same_gradient_as]["grad_norm"], rel=1e-3)
    assert first[loss_type]["grad_norm"] > 0
    assert first[loss_type]["grad_norm"] == pytest.approx(first[same_gradient_as]["grad_norm"], rel=1e-4)
    assert ("cispo_clip_ratio" in first[loss_type]) == (loss_type == "cispo")
    if loss_type == "vespo":  # on policy every completion's Gamma weight is 1
        assert first[loss_type]["vespo/phi_seq_mean"] == pytest.approx(1.0, abs=1e-5)
    assert "clip_ratio/region_mean" not in first[loss_type]  # as TRL: no PPO clip to count


def test_num_generations_eval_sets_the_completions_per_eval_prompt(tiny_model_dir, tmp_path):
    scored = []

    def count(completions, **kwargs):
        scored.extend(completions)
        return [1.0] * len(completions)

    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=count, train_dataset=[{"prompt": "ab"}] * 4,
                          eval_dataset=[{"prompt": "cd"}, {"prompt": "ef"}],
                          args=grpo_args(tmp_path, num_generations_eval=3))
    assert trainer.evaluate()["eval_reward"] == 1.0
    assert len(scored) == 2 * 3  # not 2 x num_generations (4)


def test_luspo_trains_and_warns_without_sequence_level(tiny_model_dir, tmp_path, caplog):
    trainer = GRPOTrainer(model=tiny_model_dir, train_dataset=[{"prompt": "ab"}] * 4,
                          reward_funcs=lambda completions, **kw: [float(sum(map(ord, c)) % 7) for c in completions],
                          args=grpo_args(tmp_path, loss_type="luspo"))
    assert "importance_sampling_level='sequence'" in caplog.text
    trainer.train()
    assert trainer.state.log_history[0]["grad_norm"] > 0 and "clip_ratio/region_mean" in trainer.state.log_history[0]


def test_neftune_noises_training_forwards_only_and_is_removed_after(tiny_model_dir, tmp_path):
    """neftune_noise_alpha (TrainingArguments'): transformers' hook on the input embeddings while train() runs."""
    def run(alpha):
        trainer = SFTTrainer(model=tiny_model_dir, train_dataset=ROWS, eval_dataset=ROWS[:4], args=sft_args(
            tmp_path / str(alpha), max_steps=2, logging_steps=1, shuffle_dataset=False, eval_strategy="steps",
            eval_steps=2, neftune_noise_alpha=alpha))
        trainer.train()
        return trainer

    plain, noisy = run(None), run(50.0)
    # the same first batch from the same weights: only the noise separates the first losses
    assert abs(noisy.state.log_history[0]["loss"] - plain.state.log_history[0]["loss"]) > 1e-3
    # evaluation runs in eval mode, without noise: the eval loss logged at the last step (hook still on) is
    # the one the same weights give once train() has removed the hook
    logged = [r["eval_loss"] for r in noisy.state.log_history if "eval_loss" in r]
    assert logged[-1] == pytest.approx(noisy.evaluate()["eval_loss"], rel=1e-6)
    embeddings = noisy.unwrapped_model.get_input_embeddings()
    assert not embeddings._forward_hooks and not hasattr(embeddings, "neftune_noise_alpha")


def test_neftune_is_sft_only_and_checked():
    with pytest.raises(ConfigError, match="neftune_noise_alpha"):
        SFTConfig(neftune_noise_alpha=0.0)
    with pytest.raises(ConfigError, match="neftune_noise_alpha=5.*only its default None"):
        GRPOConfig(neftune_noise_alpha=5.0)


def _varied_reward(completions, **kwargs):  # differs within a group, so advantages are not zero
    return [float(sum(map(ord, c)) % 7) for c in completions]


@pytest.mark.parametrize("quantile", [0.0, 0.25])
def test_top_entropy_quantile_keeps_that_share_of_tokens(tiny_model_dir, tmp_path, quantile):
    kept = []  # (kept tokens, loss tokens) per micro-batch

    class Recording(GRPOTrainer):
        def high_entropy_tokens(self, entropy, mask):
            result = super().high_entropy_tokens(entropy, mask)
            kept.append((int(result.sum()), int(mask.sum())))
            return result

    norms = {}
    for q in (1.0, quantile):
        trainer = Recording(model=tiny_model_dir, reward_funcs=_varied_reward, train_dataset=[{"prompt": "ab"}] * 8,
                              args=grpo_args(tmp_path / str(q), top_entropy_quantile=q, seed=3,
                                             max_completion_length=12))
        trainer.train()
        norms[q] = trainer.state.log_history[0]["grad_norm"]
    assert kept
    for n, total in kept:  # tokens at or above the (1 - q) quantile (linear interpolation) of distinct values
        assert n == total - math.ceil((1 - quantile) * (total - 1))
        assert n == 1 if quantile == 0.0 else abs(n - total / 4) < 1
    assert norms[quantile] < norms[1.0]  # fewer tokens carry the gradient


def test_off_policy_mask_drops_negative_completions_that_drifted(tiny_model_dir, tmp_path):
    calls = []

    class Recording(GRPOTrainer):
        def off_policy_kept(self, logps, behaviour, advantages, mask):
            result = super().off_policy_kept(logps, behaviour, advantages, mask)
            calls.append((result.squeeze(1).clone(), advantages.clone()))
            return result

    trainer = Recording(model=tiny_model_dir, reward_funcs=_varied_reward, train_dataset=[{"prompt": "ab"}] * 8,
                          args=grpo_args(tmp_path, off_policy_mask_threshold=0.1, num_iterations=2, max_steps=2,
                                         learning_rate=1e-3, seed=3))
    trainer.train()
    assert len(calls) == 2  # one micro-batch per pass over the rollout
    first, second = calls
    assert first[0].eq(1).all()  # on policy: nothing has drifted yet
    dropped = second[0] == 0
    assert dropped.any()  # after one step, the negative completions became less likely: drifted past 0.1
    assert (second[1][dropped] < 0).all()  # and only negative-advantage ones are dropped


def test_normalize_then_sum_weighs_functions_by_weight_not_spread(tiny_model_dir, tmp_path):
    """multi_objective_aggregation="normalize_then_sum" (GDPO): each function is normalized within its group,
    the weighted sum over the batch; the advantage each completion trained on follows from its rewards."""
    def small(completions, **kwargs):
        return [float(len(c) % 2) for c in completions]

    def large(completions, **kwargs):
        return [100.0 * (sum(map(ord, c)) % 5) for c in completions]

    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=[small, large], train_dataset=[{"prompt": "ab"}] * 8,
                          args=grpo_args(tmp_path, per_device_train_batch_size=8, log_completions=True,
                                         multi_objective_aggregation="normalize_then_sum", reward_weights=[1.0, 0.5]))
    trainer.train()
    samples = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert len(samples) == 8  # two groups of 4
    summed = []
    for group in (samples[:4], samples[4:]):
        per_function = torch.tensor([[s["rewards"]["small"], s["rewards"]["large"]] for s in group])  # [4, 2]
        normalized = (per_function - per_function.mean(0)) / (per_function.std(0) + 1e-4)
        summed += (normalized * torch.tensor([1.0, 0.5])).sum(1).tolist()
    summed = torch.tensor(summed)
    expected = (summed - summed.mean()) / (summed.std() + 1e-4)
    assert expected.abs().max() > 0.5  # the rewards differ, so this checks something
    assert [s["advantage"] for s in samples] == pytest.approx(expected.tolist(), abs=1e-4)


def test_normalize_then_sum_is_checked_and_says_scale_rewards_is_unused(tiny_model_dir, tmp_path, caplog):
    with pytest.raises(ConfigError, match="multi_objective_aggregation"):
        GRPOConfig(multi_objective_aggregation="sum")
    with caplog.at_level("WARNING", logger="trainers"):
        GRPOTrainer(model=tiny_model_dir, reward_funcs=_varied_reward, train_dataset=[{"prompt": "ab"}] * 4,
                    args=grpo_args(tmp_path, multi_objective_aggregation="normalize_then_sum", scale_rewards="batch"))
    assert "scale_rewards='batch' is not used" in caplog.text


@pytest.mark.parametrize("first, logged", [(True, [1, 3]), (False, [3])])
def test_logging_first_step(tiny_model_dir, tmp_path, first, logged):
    """logging_first_step (default False, as TRL): step 1 gets a record of its own or not; step 4, after the last
    multiple of logging_steps, gets none (train()'s closing record has its metrics)."""
    trainer = SFTTrainer(model=tiny_model_dir, train_dataset=ROWS,
                         args=sft_args(tmp_path, logging_steps=3, logging_first_step=first))
    trainer.train()
    assert [r["step"] for r in step_records(trainer)] == logged
    assert "mean_token_accuracy" in trainer.state.log_history[-1]  # step 4's, pending since step 3
