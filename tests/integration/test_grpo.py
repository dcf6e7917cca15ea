"""GRPO end to end on a tiny model, one CPU process."""

import dataclasses
import json
import math
import os

import pytest
import torch
from accelerate.state import AcceleratorState
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

from tests.conftest import config_factory, digits, step_records
from trainers import GRPOConfig, GRPOTrainer
from trainers.errors import ConfigError
from trainers.sampling.scoring import LogProbScorer

PROMPTS = [{"prompt": p} for p in ["abc", "hello", "xyz", "12", "the", "cat", "sat", "on"] * 4]


config = config_factory(GRPOConfig, per_device_train_batch_size=16, num_generations=8, max_completion_length=8,
                        learning_rate=1e-2, max_steps=2)


ABC_HELLO = [{"prompt": "abc"}, {"prompt": "hello"}]  # with shuffle_dataset=False: rows 0..7 "abc", 8..15 "hello"


def ending(tokenizer, abc_ends: bool) -> dict:
    """generation_kwargs (HF generate's sequence_bias) under which no completion ends, except, with ``abc_ends``,
    each completion of "abc": its EOS alone, right after the prompt. So a round certainly has the completions it
    needs, whatever the seed: a random policy ends about 1 completion in 259 per token on its own."""
    eos, last = tokenizer.eos_token_id, tokenizer("abc")["input_ids"][-1]
    return {"sequence_bias": {(eos,): -100.0, **({(last, eos): 200.0} if abc_ends else {})}}


def test_mean_reward_rises_clearly(tiny_model_dir, tmp_path):
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=digits,
                          args=config(tmp_path, max_steps=24, logging_steps=4), train_dataset=PROMPTS)
    trainer.train()
    rewards = [r["reward"] for r in step_records(trainer)]
    assert rewards[0] < 0.1  # digits are 10 of 259 byte tokens
    assert rewards[-1] > 0.5, rewards
    last = step_records(trainer)[-1]
    for key in ("loss", "reward", "reward_std", "rewards/digits/mean", "rewards/digits/std", "completions/mean_length",
                "completions/min_length", "completions/max_length", "completions/clipped_ratio",
                "completions/mean_terminated_length", "completions/min_terminated_length",
                "completions/max_terminated_length", "entropy",
                "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/low_min", "clip_ratio/high_max",
                "frac_reward_zero_std", "num_tokens", "step_time",
                "learning_rate", "grad_norm"):
        assert key in last, key
    # the length metrics' values: test_length_metrics_of_a_round
    assert last["entropy"] < step_records(trainer)[0]["entropy"]  # the policy sharpened


@pytest.mark.parametrize("abc_ends, expected", [
    # "abc": 8 completions of 1 token (its EOS, ended); "hello": 8 of max_completion_length=8 (truncated)
    (True, {"mean_length": 4.5, "min_length": 1.0, "max_length": 8.0, "clipped_ratio": 0.5,
            "mean_terminated_length": 1.0, "min_terminated_length": 1.0, "max_terminated_length": 1.0}),
    # no completion ended: TRL's convention logs the terminated lengths as 0
    (False, {"mean_length": 8.0, "min_length": 8.0, "max_length": 8.0, "clipped_ratio": 1.0,
             "mean_terminated_length": 0.0, "min_terminated_length": 0.0, "max_terminated_length": 0.0}),
])
def test_length_metrics_of_a_round(tiny_model_dir, tokenizer, tmp_path, abc_ends, expected):
    """TRL's completion length metrics (the EOS counts in a length; a completion ended if it has one)."""
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=digits, train_dataset=ABC_HELLO,
                          args=config(tmp_path, shuffle_dataset=False, generation_kwargs=ending(tokenizer, abc_ends)))
    trainer.prepare_step(0)
    lengths = trainer.micro_batch(0, 0).completion_attention.sum(1).tolist()
    assert lengths == [1 if abc_ends else 8] * 8 + [8] * 8
    metrics = {}
    trainer.after_optimizer_step(metrics)  # the round's metrics join the step's
    assert {key: metrics[f"completions/{key}"] for key in expected} == expected


def test_peft_grpo_trains_only_adapters_and_beta_uses_the_base_model(tiny_model_dir, tmp_path):
    from peft import LoraConfig

    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=digits, args=config(tmp_path, beta=0.1, max_steps=3),
                          train_dataset=PROMPTS,
                          peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                 task_type="CAUSAL_LM"))
    assert trainer.ref_model is None  # no second copy: the base model with adapters disabled is the reference
    before = {k: v.clone() for k, v in trainer.unwrapped_model.state_dict().items()}
    trainer.train()
    after = trainer.unwrapped_model.state_dict()
    for key in before:
        assert (not torch.equal(before[key], after[key])) == ("lora_" in key), key
    kls = [r["kl"] for r in step_records(trainer)]
    assert kls[0] == pytest.approx(0.0, abs=1e-6)  # adapters start as the identity
    assert kls[-1] > 0


def test_beta_logs_a_growing_kl_to_a_frozen_reference(tiny_model_dir, tmp_path):
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=digits, args=config(tmp_path, beta=0.05, max_steps=4),
                          train_dataset=PROMPTS)
    reference = {k: v.clone() for k, v in trainer.ref_model.state_dict().items()}
    trainer.train()
    kls = [r["kl"] for r in step_records(trainer)]
    assert kls[0] == pytest.approx(0.0, abs=1e-6) and kls[-1] > 1e-4, kls
    for key, value in trainer.ref_model.state_dict().items():
        assert torch.equal(value, reference[key]), f"reference model changed: {key}"


@pytest.mark.parametrize("options", [
    {"importance_sampling_level": "sequence"},  # GSPO
    {"loss_type": "grpo"}, {"loss_type": "bnpo"}, {"loss_type": "dr_grpo"},
    {"scale_rewards": "batch", "epsilon_high": 0.28},
])  # num_iterations=2: test_num_iterations_reuses_each_round_with_its_old_logps
def test_variants_train(tiny_model_dir, tmp_path, options):
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=digits, args=config(tmp_path, max_steps=4, **options),
                          train_dataset=PROMPTS)
    trainer.train()
    history = step_records(trainer)
    assert len(history) == 4 and all(math.isfinite(r["loss"]) for r in history)


def test_num_iterations_reuses_each_round_with_its_old_logps(tiny_model_dir, tmp_path):
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=digits, args=config(tmp_path, max_steps=4, num_iterations=2),
                          train_dataset=PROMPTS)
    assert trainer.needs.old_logps
    trainer.train()
    history = step_records(trainer)
    assert len(history) == 4 and all(math.isfinite(r["loss"]) for r in history)
    # each round serves 2 optimizer steps: steps 2 and 4 reuse it, so only steps 1 and 3 log rewards
    assert ["reward" in r for r in history] == [True, False, True, False]
    # the last round (steps 3 and 4) kept the log-probs it was sampled with; the policy has moved since
    batch = trainer.micro_batch(3, 0)
    assert batch.old_logps is not None
    with torch.no_grad():
        current = trainer.policy_logprobs(trainer.model, batch)["logps"]
    mask = batch.loss_mask.bool()
    assert mask.any() and (current - batch.old_logps)[mask].abs().max() > 1e-3


def test_old_logps_match_the_current_ones_before_any_update(tiny_model_dir, tmp_path):
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=digits, args=config(tmp_path, num_iterations=2),
                          train_dataset=PROMPTS)
    trainer.prepare_step(0)
    batch = trainer.micro_batch(0, 0)
    with torch.no_grad():
        current = trainer.policy_logprobs(trainer.model, batch)["logps"]
    mask = batch.loss_mask.bool()
    torch.testing.assert_close(current[mask], batch.old_logps[mask], rtol=1e-5, atol=1e-5)


def sharing_recorder(shares: bool = True):
    """A GRPOTrainer class whose scorer records whether each shared prompt forward did share (False: it fell back
    to one forward per row), and that list; with ``shares=False`` the scorer never tries (one forward per row)."""
    calls: list[bool] = []

    class Scorer(LogProbScorer):
        def shared_forward(self, *args, **kwargs):
            out = super().shared_forward(*args, **kwargs)
            calls.append(out is not None)
            return out

    if not shares:
        Scorer.shares_prompt_forward = False

    class Recording(GRPOTrainer):
        scorer_class = Scorer

    return Recording, calls


@pytest.fixture
def fresh_accelerator_state():
    """Accelerate keeps one state per process and refuses another mixed precision: reset it around a test."""
    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def test_shared_prompt_forward_keeps_one_bf16_copy_of_each_weight(tiny_model_dir, tmp_path,
                                                                  fresh_accelerator_state):
    """bf16 mixed precision: backward keeps the bf16 weights autocast made. The shared prompt forward runs two
    forwards (prompts, then completions); they must share one cast of each weight, as one forward per row has."""
    matrices = None

    def saved_bf16_weights(shared: bool) -> tuple[int, list[bool]]:
        nonlocal matrices
        trainer_class, calls = sharing_recorder(shares=shared)
        trainer = trainer_class(model=tiny_model_dir, reward_funcs=digits,
                                args=config(tmp_path / str(shared), bf16=True), train_dataset=PROMPTS)
        trainer.prepare_step(0)
        batch = trainer.micro_batch(0, 0)
        counts = trainer.batch_counts([batch])
        matrices = [p for p in trainer.unwrapped_model.parameters() if p.dim() == 2]
        weights = {tuple(p.shape) for p in matrices} | {tuple(p.shape[::-1]) for p in matrices}  # saved transposed
        calls.clear()
        saved = []  # kept alive until counted, so no two casts share an address

        def pack(tensor):
            if tensor.dtype == torch.bfloat16 and tuple(tensor.shape) in weights:
                saved.append(tensor)
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss, _ = trainer.compute_loss(trainer.model, batch, counts)
        assert loss.requires_grad
        return len({t.untyped_storage().data_ptr() for t in saved}), list(calls)

    one_per_row, calls = saved_bf16_weights(False)
    assert not calls
    # every matrix but the embedding (a lookup, not cast); the tied output head, which is the embedding's weight,
    # is not kept cast either: the chunked head (trainers/model/output_head.py) keeps the float32 weight for backward
    assert one_per_row == len(matrices) - 1
    shared, calls = saved_bf16_weights(True)
    assert shared == one_per_row
    assert calls == [True]  # it did share


@pytest.mark.parametrize("checkpoint_kwargs, shared", [
    (None, True),  # non-reentrant (the default): completions of a prompt share its cached forward
    ({"use_reentrant": True}, False),  # reentrant: the cache would get no gradient, so one forward per row
])
def test_gradient_checkpointing_trains_the_same_weights(tiny_model_dir, tmp_path, checkpoint_kwargs, shared):
    trainer_class, calls = sharing_recorder()
    finals = []
    for name, extra in (("plain", {}), ("checkpointed", {"gradient_checkpointing": True,
                                                          "gradient_checkpointing_kwargs": checkpoint_kwargs})):
        calls.clear()
        trainer = trainer_class(model=tiny_model_dir, reward_funcs=digits, args=config(tmp_path / name, **extra),
                                train_dataset=PROMPTS)
        trainer.train()
        assert calls and set(calls) == {True if not extra else shared}
        finals.append({n: p.detach().clone() for n, p in trainer.unwrapped_model.named_parameters()})
    assert all(layer.gradient_checkpointing for layer in trainer.unwrapped_model.model.layers)
    for key in finals[0]:  # Adam turns float-order noise in a near-zero gradient into up to ~lr: not 1e-5
        torch.testing.assert_close(finals[0][key], finals[1][key], rtol=1e-4, atol=5e-4)
    initial = dict(AutoModelForCausalLM.from_pretrained(tiny_model_dir).named_parameters())
    assert any(not torch.allclose(finals[0][key], initial[key], atol=1e-3) for key in finals[0])  # it trained


def test_generation_batch_semantics(tiny_model_dir, tmp_path):
    """per_device counts completions; one round of generation_batch_size serves steps_per_generation micro-steps."""
    built = []  # the index of each round built (the on_rollout_end event)

    class Rounds(TrainerCallback):
        def on_rollout_end(self, args, state, control, round_index=None, **kwargs):
            built.append(round_index)

    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=digits, train_dataset=PROMPTS, callbacks=[Rounds()],
                          args=config(tmp_path, per_device_train_batch_size=4, num_generations=4,
                                      gradient_accumulation_steps=2, steps_per_generation=4))
    assert trainer.generation_batch_size == 16 and trainer.prompts_per_round == 4
    assert trainer.needs.old_logps  # a round spans 2 optimizer steps
    for step in range(2):
        for a in range(2):
            trainer.prepare_step(step)
            batch = trainer.micro_batch(step, a)
            assert batch.completion_ids.shape[0] == 4
            assert batch.prompt_group.tolist() == [0] * 4  # a quarter of the round: one prompt's 4 completions
    assert built == [0]  # one round served the 4 micro-batches of steps 0 and 1
    trainer.prepare_step(2)
    assert built == [0, 1] and trainer.micro_batch(2, 0).completion_ids.shape[0] == 4
    with pytest.raises(RuntimeError, match="prepare_step"):  # round 0 was dropped once no step needed it
        trainer.micro_batch(1, 0)
    with pytest.raises(RuntimeError, match="prepare_step"):  # a micro-batch of a round not built
        trainer.micro_batch(4, 0)


@pytest.mark.parametrize("options, message", [
    ({"per_device_train_batch_size": 6, "num_generations": 4}, r"6 x 1 x 1 = 6 completions per round is not a multiple of num_generations=4"),
    ({"generation_batch_size": 20, "per_device_train_batch_size": 8}, r"generation_batch_size=20 must be a multiple"),
    ({"reward_weights": [1.0, 2.0]}, r"reward_weights has 2 entries but reward_funcs has 1"),
])
def test_invalid_batch_combinations_fail_at_construction(tiny_model_dir, tmp_path, options, message):
    with pytest.raises(ConfigError, match=message):
        GRPOTrainer(model=tiny_model_dir, reward_funcs=digits, args=config(tmp_path, **options), train_dataset=PROMPTS)


def test_num_generations_below_two_fails(tmp_path):
    with pytest.raises(ConfigError, match="num_generations"):
        config(tmp_path, num_generations=1)


def test_conversational_prompts_columns_and_log_completions(tiny_model_dir, tmp_path):
    seen = {}

    def spy(prompts, completions, completion_ids, tag, **kwargs):
        seen.update(prompt=prompts[0], completion=completions[0], tag=tag[0], n=len(completions))
        return [float(len(ids)) for ids in completion_ids]

    rows = [{"prompt": [{"role": "user", "content": f"say {i}"}], "tag": f"t{i}"} for i in range(4)]
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=[spy, "format"], train_dataset=rows,
                          args=config(tmp_path, log_completions=True, num_completions_to_print=2, max_steps=1))
    trainer.train()
    assert isinstance(seen["prompt"], list) and seen["prompt"][0]["role"] == "user"
    assert seen["completion"][0]["role"] == "assistant" and isinstance(seen["completion"][0]["content"], str)
    assert seen["tag"] == "t" + seen["prompt"][0]["content"].removeprefix("say ") and seen["n"] == 16  # its row's
    with open(os.path.join(tmp_path / "out", "completions.jsonl")) as f:
        logged = [json.loads(line) for line in f]
    assert len(logged) == 16 and {"prompt", "completion", "reward", "advantage", "step"} <= logged[0].keys()
    assert "rewards/format/mean" in trainer.state.log_history[0]


def test_dynamic_sampling_drops_zero_variance_groups(tiny_model_dir, tmp_path):
    def constant_for_first_prompt(prompts, completions, **kwargs):
        return [0.5 if p == "abc" else float(len(c)) for p, c in zip(prompts, completions)]

    rows = [{"prompt": "abc"}, {"prompt": "hello"}]
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=constant_for_first_prompt, train_dataset=rows,
                          args=config(tmp_path, dynamic_sampling=True, max_steps=1, shuffle_dataset=False))
    trainer.prepare_step(0)
    batch = trainer.micro_batch(0, 0)
    first_group = batch.loss_mask[:8]
    assert first_group.sum() == 0 and batch.loss_mask[8:].sum() > 0
    metrics = {}
    trainer.after_optimizer_step(metrics)  # the round's metrics join the step's
    assert metrics["dynamic_sampling/dropped_groups"] == 1


def test_mask_truncated_completions(tiny_model_dir, tokenizer, tmp_path):
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=digits, train_dataset=ABC_HELLO,
                          args=config(tmp_path, mask_truncated_completions=True, max_completion_length=3,
                                      shuffle_dataset=False, generation_kwargs=ending(tokenizer, abc_ends=True)))
    trainer.prepare_step(0)
    batch = trainer.micro_batch(0, 0)
    eos = trainer.processing_class.eos_token_id
    ended = [eos in ids[attention.bool()].tolist() for ids, attention in zip(batch.completion_ids,
                                                                            batch.completion_attention)]
    assert ended == [True] * 8 + [False] * 8  # "abc": its EOS alone; "hello": cut at 3 tokens
    assert batch.loss_mask[:8].tolist() == batch.completion_attention[:8].float().tolist()  # ended: trained
    assert batch.loss_mask[8:].sum() == 0 and batch.completion_attention[8:].sum() == 8 * 3  # truncated: masked


def test_evaluation_reports_reward(tiny_model_dir, tmp_path):
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=digits, train_dataset=PROMPTS, eval_dataset=PROMPTS[:3],
                          args=config(tmp_path, eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=8))
    trainer.train()
    evals = [r for r in trainer.state.log_history if "eval_reward" in r]
    assert len(evals) == 1  # at step 2 of 2
    assert evals[0]["eval_reward"] == pytest.approx(evals[0]["eval_rewards/digits/mean"])  # its one function, weight 1


def test_a_reward_model_folder_serves_as_a_reward_function(tiny_model_dir, tokenizer, tmp_path):
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    torch.manual_seed(0)
    rm_config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=64, num_labels=1, pad_token_id=tokenizer.pad_token_id)
    Qwen2ForSequenceClassification(rm_config).save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=[str(tmp_path / "rm"), digits], train_dataset=PROMPTS,
                          args=config(tmp_path, max_steps=1))
    trainer.train()
    record = trainer.state.log_history[0]
    assert record["rewards/rm/std"] > 0  # a real score per completion, not a constant
    assert record["reward"] == pytest.approx(record["rewards/rm/mean"] + record["rewards/digits/mean"], abs=1e-4)


def test_clip_ratio_min_and_max_are_the_micro_batch_ratios(tiny_model_dir, tmp_path):
    """TRL's clip_ratio/low_min and high_max: each micro-batch's ratio, its min / max over processes, averaged
    over micro-batches. With one process and one micro-batch per step they equal the step's means."""
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=digits, train_dataset=PROMPTS,
                          args=config(tmp_path, num_iterations=2, max_steps=4, learning_rate=3e-2))
    trainer.train()
    history = step_records(trainer)
    assert len(history) == 4
    for record in history:
        assert record["clip_ratio/low_min"] == pytest.approx(record["clip_ratio/low_mean"], abs=1e-7)
        assert record["clip_ratio/high_max"] == pytest.approx(record["clip_ratio/high_mean"], abs=1e-7)
    assert history[0]["clip_ratio/region_mean"] == 0  # first pass over a round: ratio 1
    assert max(r["clip_ratio/region_mean"] for r in history[1::2]) > 0  # second passes clip


def test_use_bias_correction_kl_changes_the_gradient_not_the_value(tiny_model_dir, tmp_path):
    """TRL's use_bias_correction_kl: the KL term times the importance ratio. On policy the ratio is 1, so the
    loss is the same, but the ratio's own gradient makes the KL gradient the unbiased reverse-KL one."""
    from trainers.model.losses import BatchCounts

    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=digits, train_dataset=PROMPTS,
                          args=config(tmp_path, beta=0.5, per_device_train_batch_size=8))
    trainer.prepare_step(0)
    batch = trainer.micro_batch(0, 0)
    with torch.no_grad():  # the policy moves away from the reference, so the KL and its gradient are not zero
        for p in trainer.model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    batch = dataclasses.replace(batch, advantages=torch.zeros_like(batch.advantages))  # the KL term alone
    counts = BatchCounts(tokens=float(batch.loss_mask.sum()), sequences=8.0, micro_batches=1)
    results = {}
    for correction in (True, False):
        trainer.args.use_bias_correction_kl = correction
        trainer.model.zero_grad()
        loss, stats = trainer.compute_loss(trainer.model, batch, counts)
        loss.backward()
        results[correction] = (float(loss.detach()), [p.grad.clone() for p in trainer.model.parameters()])
    assert results[True][0] == pytest.approx(results[False][0], rel=1e-6) and results[True][0] > 0
    assert not all(torch.allclose(a, b) for a, b in zip(results[True][1], results[False][1]))
    with pytest.raises(Exception, match="use_bias_correction_kl"):
        GRPOConfig(use_bias_correction_kl="yes")


def test_padding_free_trains_the_same_weights(tiny_model_dir, tmp_path):
    """GRPOConfig.padding_free: every forward (policy, old and reference log-probs) over one packed row gives the
    padded run's weights and metrics; each micro-batch holds two prompts of different lengths."""
    finals, logs = [], []
    for padding_free in (False, True):
        trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=digits, train_dataset=PROMPTS,
                              args=config(tmp_path / str(padding_free), padding_free=padding_free, beta=0.1,
                                          num_iterations=2, per_device_train_batch_size=8, num_generations=4))
        trainer.train()
        finals.append({n: p.detach().clone() for n, p in trainer.unwrapped_model.named_parameters()})
        logs.append(trainer.state.log_history[0])
    for key in finals[0]:  # Adam turns float-order noise in a near-zero gradient into up to ~lr: not 1e-5
        torch.testing.assert_close(finals[0][key], finals[1][key], rtol=1e-4, atol=5e-4)
    initial = dict(AutoModelForCausalLM.from_pretrained(tiny_model_dir).named_parameters())
    assert any(not torch.allclose(finals[0][key], initial[key], atol=1e-3) for key in finals[0])  # it trained
    for key in ("loss", "kl", "entropy"):
        assert logs[1][key] == pytest.approx(logs[0][key], rel=1e-3, abs=1e-5), key


def test_padding_free_refuses_a_head_it_cannot_compute(tiny_model_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.config.final_logit_softcapping = 30.0  # as Gemma 2's: logits soft-capped after the head
    with pytest.raises(ConfigError, match="padding_free=True"):
        GRPOTrainer(model=model, reward_funcs=digits, train_dataset=PROMPTS, args=config(tmp_path, padding_free=True),
                    processing_class=AutoTokenizer.from_pretrained(tiny_model_dir))
