"""Where user code meets GRPO's rewards, as in TRL 1.16: reward models given by Hub id (from the local Hugging Face
cache, offline), the trainer's public reward attributes (and the rest of what TRL's GRPOTrainer exposes), and the
warning for a completion that no reward function scores."""

import logging
import os

import pytest
import torch

from tests.conftest import Rounds
from trainers import GRPOConfig, GRPOTrainer
from trainers.errors import ConfigError, RewardFunctionError
from trainers.sampling.trl_attributes import TRL_CONFIG_ATTRIBUTES

PROMPTS = [{"prompt": p} for p in ["abc", "hello", "xyz", "12"] * 2]


def grpo_args(tmp_path, **overrides):
    return GRPOConfig(**{"output_dir": str(tmp_path / "out"), "per_device_train_batch_size": 8, "num_generations": 4,
                         "max_completion_length": 6, "max_steps": 1, "logging_steps": 1, "disable_tqdm": True,
                         "save_strategy": "no", "report_to": "none", "seed": 0, **overrides})


def length(completions, **kwargs):
    return [float(len(c)) for c in completions]


def reward_model(tokenizer):
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=64, num_labels=1, pad_token_id=tokenizer.pad_token_id)
    return Qwen2ForSequenceClassification(config).eval()


@pytest.fixture
def hub_cache(tmp_path, monkeypatch, tokenizer):
    """A Hugging Face cache holding a tiny reward model as the Hub id "org/tiny-rm" (with its tokenizer) and
    "org/rm-no-tokenizer" (without), laid out as huggingface_hub downloads them; the process reads only it."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    model = reward_model(tokenizer)
    for repo, with_tokenizer in (("org/tiny-rm", True), ("org/rm-no-tokenizer", False)):
        revision = "0123456789abcdef0123456789abcdef01234567"
        root = cache / f"models--{repo.replace('/', '--')}"
        snapshot = root / "snapshots" / revision
        model.save_pretrained(snapshot)
        if with_tokenizer:
            tokenizer.save_pretrained(snapshot)
        (root / "refs").mkdir()
        (root / "refs" / "main").write_text(revision)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))  # transformers reads it at each load
    assert constants.HF_HUB_OFFLINE  # the Hub is never asked (tests/conftest.py)
    return model


def recorder(seen: list):
    """A reward function that records the completions it sees (prompt + completion, as the reward model reads
    them) and scores none of them."""
    def record(prompts, completions, **kwargs):
        seen.extend(p + c for p, c in zip(prompts, completions))
        return [None] * len(completions)
    return record


def test_a_reward_model_by_hub_id_loads_from_the_local_cache_offline(tiny_model_dir, tmp_path, hub_cache, tokenizer):
    """TRL: a string that is not a built-in is AutoModelForSequenceClassification.from_pretrained(num_labels=1)."""
    assert not os.path.exists("org/tiny-rm")  # a Hub id, not a folder
    seen = []
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=["org/tiny-rm", recorder(seen)], train_dataset=PROMPTS,
                          args=grpo_args(tmp_path))
    from transformers import Qwen2ForSequenceClassification

    assert isinstance(trainer.reward_funcs[0], Qwen2ForSequenceClassification)
    assert trainer.reward_func_names == ["tiny-rm", "record"]  # "org/name" -> "name", as TRL
    assert trainer.reward_processing_classes[0].get_vocab() == tokenizer.get_vocab()  # the cached tokenizer
    assert trainer.reward_processing_classes[1] is None
    trainer.train()
    record = trainer.state.log_history[0]
    assert len(seen) == 8
    eos = tokenizer.eos_token
    with torch.no_grad():  # the cached model's scores: logit 0 of prompt + completion + EOS, one text at a time
        expected = torch.tensor([hub_cache(**tokenizer([text + eos], return_tensors="pt", add_special_tokens=False))
                                 .logits[0, 0].item() for text in seen])
    assert record["rewards/tiny-rm/mean"] == pytest.approx(expected.mean().item(), rel=1e-4)
    assert record["rewards/tiny-rm/std"] == pytest.approx(expected.std().item(), rel=1e-3)
    assert record["reward"] == pytest.approx(expected.mean().item(), rel=1e-4)  # the recorder scored none


def test_reward_processing_classes_serve_a_hub_reward_model(tiny_model_dir, tmp_path, hub_cache, tokenizer):
    with pytest.raises(RewardFunctionError, match="'org/rm-no-tokenizer' loaded, but its tokenizer did not.*"
                                                  "reward_processing_classes"):
        GRPOTrainer(model=tiny_model_dir, reward_funcs="org/rm-no-tokenizer", train_dataset=PROMPTS,
                    args=grpo_args(tmp_path))
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=[length, "org/rm-no-tokenizer"], train_dataset=PROMPTS,
                          reward_processing_classes=[None, tokenizer], args=grpo_args(tmp_path))
    assert trainer.reward_processing_classes == [None, tokenizer]
    assert trainer.reward_processing_classes[1] is tokenizer  # the one given, not a copy
    assert trainer.reward_funcs[0] is length
    scores = trainer.rewards[1].func(prompts=["ab"], completions=["cd"])
    with torch.no_grad():
        expected = hub_cache(**tokenizer(["abcd" + tokenizer.eos_token], return_tensors="pt")).logits[0, 0].item()
    assert scores == [pytest.approx(expected, rel=1e-5)]
    with pytest.raises(ConfigError, match=r"number of reward processing classes \(1\) must match the number of "
                                          r"reward functions \(2\)"):
        GRPOTrainer(model=tiny_model_dir, reward_funcs=[length, "org/rm-no-tokenizer"], train_dataset=PROMPTS,
                    reward_processing_classes=[tokenizer], args=grpo_args(tmp_path))


def test_a_string_that_is_no_reward_says_what_was_tried(tiny_model_dir, tmp_path, hub_cache):
    for spec, cause in (("org/not-cached", "find them in the cached files"), ("./no/such/folder", "does not exist"),
                        (str(tmp_path), "no config.json")):
        with pytest.raises(RewardFunctionError) as caught:
            GRPOTrainer(model=tiny_model_dir, reward_funcs=spec, train_dataset=PROMPTS, args=grpo_args(tmp_path))
        message = str(caught.value)
        for tried in ("built-in (['accuracy', 'code_execution', 'format', 'overlong'])", "'module:function'",
                      "AutoModelForSequenceClassification", "local folder",
                      "Hub id in the local Hugging Face cache (HF_HUB_OFFLINE=1"):
            assert tried in message, (spec, message)
        assert cause in message, (spec, message)  # and why it did not load
    with pytest.raises(ConfigError, match="No reward source provided"):
        GRPOTrainer(model=tiny_model_dir, train_dataset=PROMPTS, args=grpo_args(tmp_path))


def test_a_reward_model_folder_still_loads_and_the_folder_wins_over_module_syntax(tiny_model_dir, tmp_path,
                                                                                  tokenizer):
    folder = tmp_path / "rm:v1"  # a ':' in a folder name is not 'module:function'
    reward_model(tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=str(folder), train_dataset=PROMPTS,
                          args=grpo_args(tmp_path))
    assert trainer.reward_func_names == ["rm:v1"]
    assert trainer.reward_funcs[0].config.pad_token_id == tokenizer.pad_token_id


def test_the_trainer_exposes_what_trls_grpo_trainer_does(tiny_model_dir, tmp_path, tokenizer):
    """TRL's GRPOTrainer sets these in __init__, and user code and callbacks read them."""
    args = grpo_args(tmp_path, temperature=0.7, top_k=5, beta=0.04, epsilon=0.3, num_iterations=2,
                     loss_type="grpo", scale_rewards="batch", entropy_coef=0.01, mask_truncated_completions=True,
                     reward_weights=[2.0, 0.5], chat_template_kwargs={"enable_thinking": False})
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=[length, "format"], train_dataset=PROMPTS, args=args)
    present = [name for name in TRL_CONFIG_ATTRIBUTES if hasattr(args, name)]
    assert len(present) >= len(TRL_CONFIG_ATTRIBUTES) - 1  # pad_to_multiple_of: once GRPOConfig has it
    for name in present:
        assert getattr(trainer, name) == getattr(args, name), name
    assert (trainer.temperature, trainer.top_k, trainer.beta, trainer.num_iterations) == (0.7, 5, 0.04, 2)
    assert (trainer.loss_type, trainer.scale_rewards, trainer.mask_truncated_completions) == ("grpo", "batch", True)
    assert trainer.use_vllm is False and trainer.use_transformers_continuous_batching is False
    assert (trainer.epsilon_low, trainer.epsilon_high) == (0.3, 0.3)  # epsilon_high=None: TRL's epsilon
    assert trainer.num_generations_eval == 4  # num_generations_eval=None: num_generations
    assert trainer.chat_template_kwargs == {"enable_thinking": False}
    assert trainer.entropy_coef == 0.01 and trainer.aux_loss_enabled is False
    assert trainer.eos_token_ids[0] == trainer.processing_class.eos_token_id
    assert trainer.reward_weights.tolist() == [2.0, 0.5]
    from trainers.sampling.reward_functions import format_reward

    assert trainer.reward_funcs == [length, format_reward]
    assert trainer.reward_func_names == ["length", "format"]
    assert trainer.reward_processing_classes == [None, None]
    assert trainer.ref_model is not None and trainer.rollout_func is None  # beta > 0: a reference model
    with pytest.raises(AttributeError, match=r"set GRPOConfig\(temperature=...\) before building the trainer"):
        trainer.temperature = 1.0


def test_adaptive_entropy_coef_is_read_as_it_moves(tiny_model_dir, tmp_path):
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=length, train_dataset=PROMPTS,
                          args=grpo_args(tmp_path, use_adaptive_entropy=True, entropy_coef=0.1, entropy_target=10.0))
    trainer.train()  # the step's entropy is below the target: the coefficient grows by entropy_coef_delta
    assert trainer.entropy_coef == pytest.approx(0.1 + trainer.args.entropy_coef_delta)
    assert trainer.entropy_coef == pytest.approx(trainer.state.log_history[0]["entropy_coef"])


def test_a_completion_no_function_scores_is_warned_about_as_trl_does(tiny_model_dir, tmp_path, caplog):
    """TRL warns (naming the sample's kwargs) when every reward function returns None for a completion; its
    reward stays NaN: out of the group's mean and of the logged reward, advantage 0."""
    rows = [{"prompt": "ab", "kind": "score"}, {"prompt": "cd", "kind": "skip"}]
    scored = []

    def only_scored(completions, kind, **kwargs):
        values = [float(len(c)) if k == "score" else None for c, k in zip(completions, kind)]
        scored.extend(values)
        return values

    def never(completions, **kwargs):
        return [None] * len(completions)

    rounds = Rounds()
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=[only_scored, never], train_dataset=rows,
                          args=grpo_args(tmp_path, shuffle_dataset=False, scale_rewards="none"), callbacks=[rounds])
    with caplog.at_level(logging.WARNING, logger="trainers"):
        trainer.train()
    warnings = [r.getMessage() for r in caplog.records if "All reward functions returned None" in r.getMessage()]
    assert len(warnings) == 1  # one round, one warning (naming its first unscored completion)
    assert warnings[0].startswith("All reward functions returned None for the following kwargs:\n"
                                  "{'kind': 'skip', 'prompt': 'cd', 'completion': ")
    assert warnings[0].endswith("\nPlease ensure that at least one reward function returns a valid reward.")
    values = torch.tensor([v if v is not None else float("nan") for v in scored])  # [8]: "ab" x 4, "cd" x 4
    assert values[:4].isfinite().all() and values[4:].isnan().all()
    record = trainer.state.log_history[0]
    assert record["reward"] == pytest.approx(values[:4].mean().item())  # the unscored ones left out, not 0
    advantages = rounds.rollouts[0].advantages  # scale_rewards="none": r - mean(group)
    assert advantages[:4].tolist() == pytest.approx((values[:4] - values[:4].mean()).tolist(), abs=1e-5)
    assert advantages[4:].tolist() == [0.0] * 4


def test_no_warning_when_some_function_scores_every_completion(tiny_model_dir, tmp_path, caplog):
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=[length, lambda completions, **kw: [None] * 8],
                          train_dataset=PROMPTS, args=grpo_args(tmp_path))
    with caplog.at_level(logging.WARNING, logger="trainers"):
        trainer.train()
    assert "All reward functions returned None" not in caplog.text
