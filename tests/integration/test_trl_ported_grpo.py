"""TRL's own ``TestGRPOTrainer`` cases (huggingface/trl, tests/test_grpo_trainer.py), ported by changing the import.

Each case keeps TRL's config and assertions. What changes:

- the Hub models become tiny models built offline: ``trl-internal-testing/tiny-Qwen2ForCausalLM-2.5`` is the
  ``tiny_model_dir`` fixture, ``tiny-Qwen2ForSequenceClassification-2.5`` a tiny Qwen2 sequence classifier
  (``num_labels=1``, the same tokenizer), and the other tiny Hub models (Qwen3, Gemma2, a Llama reward model with
  its own tokenizer, a Qwen3 reward model) are built the same way;
- ``load_dataset("trl-internal-testing/zen", config)`` becomes ``zen(config)``: rows of the same shape (17 train
  and 2 test rows; the prompts are the Zen of Python's, as on the Hub);
- TRL trains its default 3 epochs (51 steps of 1 prompt here); the training cases add ``max_steps=MAX_STEPS`` to
  stay short (marked ``# port: max_steps``);
- where a case relies on the Hub model's 151k-token vocabulary (EOS never sampled), the tiny model gets that
  vocabulary size; TRL's Qwen2.5 token ids in a mocked ``generate`` become the tiny tokenizer's.

Every case runs against this package and, where ``import trl`` works (TRL 1.16 locally; not in CI), against TRL
too: the ``lib`` fixture. A case that passes with TRL but not here is marked ``xfail(strict=True)`` for
``lib="trainers"`` only, with the reason.

Not ported: cases that need a GPU, vLLM, Liger, bitsandbytes, kernels, vision models, jmespath (the tool-calling
case) or the Hub; ``TestGetHighEntropyMask`` (a mock of private API); the cases already ported in
``test_trl_ported.py`` (``test_training_multiple_reward_funcs_with_weights``, ``test_get_off_policy_mask``,
``test_get_off_policy_mask_padding``, ``test_training_with_eval``); and the cases TRL 1.16 itself fails (newer TRL
only: ``test_get_sapo_token_loss``, ``test_tool_completion_idx_injection``).
"""

import importlib
from types import SimpleNamespace
from unittest.mock import patch

import pytest
import torch
from datasets import Dataset, DatasetDict
from transformers import AutoModelForSequenceClassification, AutoTokenizer

MAX_STEPS = 4  # port: max_steps (TRL's default 3 epochs would be 51 steps)


# ------------------------------------------------------------------------------------------------------ libraries


@pytest.fixture(params=["trainers", "trl"])
def lib(request, monkeypatch):
    """The library under test: ``GRPOConfig`` / ``GRPOTrainer`` from this package, or from TRL when importable.

    TRL's ``bf16`` defaults to True, which transformers refuses without a bf16 GPU unless ``use_cpu=True``; on a
    machine without one, TRL's config gets ``use_cpu=True`` (TRL then trains under bf16 CPU autocast), its own
    default config (``args=None``) included."""
    if request.param == "trainers":
        import trainers

        return SimpleNamespace(name="trainers", GRPOConfig=trainers.GRPOConfig, GRPOTrainer=trainers.GRPOTrainer)
    trl = pytest.importorskip("trl")
    config = trl.GRPOConfig
    from transformers.utils import is_torch_bf16_gpu_available

    if not is_torch_bf16_gpu_available():
        config = _trl_cpu_config(trl)
        monkeypatch.setattr(importlib.import_module("trl.trainer.grpo_trainer"), "GRPOConfig", config)
    return SimpleNamespace(name="trl", GRPOConfig=config, GRPOTrainer=trl.GRPOTrainer)


def _trl_cpu_config(trl):
    """TRL's GRPOConfig with ``use_cpu=True``, defined once at module level (TRL pickles its args)."""
    if "CPUGRPOConfig" not in globals():
        class CPUGRPOConfig(trl.GRPOConfig):
            def __post_init__(self):
                self.use_cpu = True
                super().__post_init__()

        CPUGRPOConfig.__qualname__ = "CPUGRPOConfig"
        globals()["CPUGRPOConfig"] = CPUGRPOConfig
    return globals()["CPUGRPOConfig"]


def fails_here(reason: str, condition: bool = True):
    """Passes with TRL 1.16, fails with this package: strict xfail for lib="trainers" only (where ``condition``)."""
    mark = pytest.mark.xfail(condition, reason=reason, strict=True)
    return pytest.mark.parametrize("lib", [pytest.param("trainers", marks=mark), "trl"], indirect=True)


# ------------------------------------------------------------------------------------- trl-internal-testing/zen

ZEN_TRAIN = [
    "Beautiful is better than", "Explicit is", "Simple is better", "Complex", "Flat is better than",
    "Sparse is better", "Readability", "Special cases aren't special", "Although practicality beats",
    "Errors should never", "Unless explicitly", "In the face of ambiguity, refuse", "There should be one-- and",
    "Although that way may not be", "Now is better than", "Although never is often better than",
    "If the implementation is hard to explain,",
]
ZEN_TEST = ["If the implementation is easy to explain,", "Namespaces are one honking great idea"]


def zen(config: str, split: str | None = None):
    """``load_dataset("trl-internal-testing/zen", config, split=split)``, offline: 17 train rows, 2 test rows."""
    def rows(prompts):
        if config == "standard_prompt_only":
            return Dataset.from_dict({"prompt": prompts})
        if config == "conversational_prompt_only":
            return Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in prompts]})
        raise ValueError(config)

    splits = DatasetDict({"train": rows(ZEN_TRAIN), "test": rows(ZEN_TEST)})
    return splits if split is None else splits[split]


# --------------------------------------------------------------------------------------- tiny models, offline

QWEN3_TEMPLATE = (  # ChatML, and Qwen3's empty think block when enable_thinking=False
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
    "{% endif %}"
)


def _save(model, tokenizer, path) -> str:
    model.config.eos_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.generation_config.bos_token_id = None
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def _small(**extra) -> dict:
    return dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                intermediate_size=64, **extra)


@pytest.fixture(scope="session")
def reward_model_dir(tmp_path_factory):
    """``trl-internal-testing/tiny-Qwen2ForSequenceClassification-2.5``: a tiny Qwen2 classifier, num_labels=1,
    with the policy's tokenizer."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from trainers.cli.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    model = Qwen2ForSequenceClassification(Qwen2Config(vocab_size=len(tokenizer), num_labels=1, **_small()))
    return _save(model, tokenizer, tmp_path_factory.mktemp("reward") / "tiny-Qwen2ForSequenceClassification-2.5")


@pytest.fixture(scope="session")
def qwen3_reward_model_dir(tmp_path_factory):
    """``trl-internal-testing/tiny-Qwen3ForSequenceClassification``."""
    from transformers import Qwen3Config, Qwen3ForSequenceClassification

    from trainers.cli.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    torch.manual_seed(1)
    model = Qwen3ForSequenceClassification(Qwen3Config(vocab_size=len(tokenizer), num_labels=1, head_dim=16,
                                                       **_small()))
    return _save(model, tokenizer, tmp_path_factory.mktemp("reward") / "tiny-Qwen3ForSequenceClassification")


@pytest.fixture(scope="session")
def llama_reward_model_dir(tmp_path_factory):
    """``trl-internal-testing/tiny-LlamaForSequenceClassification-3.2``: a reward model unlike the policy: its own
    tokenizer (a BPE, not byte-level tokens), its own chat template, and a pad token of its own
    (``<|finetune_right_pad_id|>``) that the config does not name."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from trainers.cli.tiny import build_task_tokenizer

    template = ("{{ '<|begin_of_text|>' }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}"
                "<|end_header_id|>\n\n{{ message['content'] }}<|eot_id|>{% endfor %}")
    tokenizer = build_task_tokenizer([p + " better than ugly." for p in ZEN_TRAIN + ZEN_TEST] * 4, vocab_size=400)
    tokenizer.chat_template = template
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|finetune_right_pad_id|>"]})
    torch.manual_seed(2)
    model = LlamaForSequenceClassification(LlamaConfig(vocab_size=len(tokenizer), num_labels=1, **_small()))
    path = tmp_path_factory.mktemp("reward") / "tiny-LlamaForSequenceClassification-3.2"
    model.save_pretrained(path)  # no pad_token_id in its config
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def qwen3_model_dir(tmp_path_factory):
    """``trl-internal-testing/tiny-Qwen3ForCausalLM``: its head not tied to the embeddings; Qwen3's
    ``enable_thinking`` in its chat template."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from trainers.cli.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.chat_template = QWEN3_TEMPLATE
    torch.manual_seed(3)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=len(tokenizer), head_dim=16, tie_word_embeddings=False,
                                         **_small()))
    return _save(model, tokenizer, tmp_path_factory.mktemp("policy") / "tiny-Qwen3ForCausalLM")


@pytest.fixture(scope="session")
def gemma2_model_dir(tmp_path_factory):
    """``trl-internal-testing/tiny-Gemma2ForCausalLM``: its head tied to the embeddings."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from trainers.cli.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    torch.manual_seed(4)
    model = Gemma2ForCausalLM(Gemma2Config(vocab_size=len(tokenizer), head_dim=16, tie_word_embeddings=True,
                                           bos_token_id=None, **_small()))
    return _save(model, tokenizer, tmp_path_factory.mktemp("policy") / "tiny-Gemma2ForCausalLM")


@pytest.fixture
def models(qwen3_model_dir, gemma2_model_dir):
    """The other tiny Hub causal LMs TRL's cases name, by their Hub id."""
    return {"trl-internal-testing/tiny-Qwen3ForCausalLM": qwen3_model_dir,
            "trl-internal-testing/tiny-Gemma2ForCausalLM": gemma2_model_dir}


def assert_all_changed(previous, trainer):
    for n, param in previous.items():
        new_param = trainer.model.get_parameter(n)
        assert not torch.equal(param, new_param), f"Parameter {n} has not changed."


# ------------------------------------------------------------------------------------------- TestGRPOTrainer


def test_init_minimal(lib, tiny_model_dir, reward_model_dir, tmp_path, monkeypatch):
    # Test that GRPOTrainer can be instantiated with only model, reward_model and train_dataset
    monkeypatch.chdir(tmp_path)  # port: the default output_dir ("<model>-GRPO") is relative
    dataset = zen("standard_prompt_only", split="train")
    lib.GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=reward_model_dir,
        train_dataset=dataset,
    )


@pytest.mark.parametrize("config_name", ["standard_prompt_only", "conversational_prompt_only"])
def test_training(lib, tiny_model_dir, reward_model_dir, tmp_path, config_name):
    dataset = zen(config_name, split="train")

    training_args = lib.GRPOConfig(
        output_dir=str(tmp_path),
        learning_rate=0.1,  # use higher lr because gradients are tiny and default lr can stall updates
        per_device_train_batch_size=3,  # reduce the batch size to reduce memory usage
        num_generations=3,  # reduce the number of generations to reduce memory usage
        max_completion_length=8,  # reduce the completion length to reduce memory usage
        report_to="none",
        max_steps=MAX_STEPS,  # port: max_steps
    )
    trainer = lib.GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=reward_model_dir,
        args=training_args,
        train_dataset=dataset,
    )

    previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}

    trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None

    # Check that the params have changed
    assert_all_changed(previous_trainable_params, trainer)


@pytest.mark.parametrize("loss_type", ["bnpo", "dr_grpo", "dapo", "cispo", "sapo"])
def test_training_loss_types(lib, tiny_model_dir, reward_model_dir, tmp_path, loss_type):
    dataset = zen("standard_prompt_only", split="train")

    training_args = lib.GRPOConfig(
        output_dir=str(tmp_path),
        learning_rate=0.1,  # use higher lr because gradients are tiny and default lr can stall updates
        per_device_train_batch_size=3,  # reduce the batch size to reduce memory usage
        num_generations=3,  # reduce the number of generations to reduce memory usage
        max_completion_length=32,  # reduce the completion length to reduce memory usage
        gradient_accumulation_steps=2,  # set to 2 to test than DAPO can operate with accumulated batch
        loss_type=loss_type,
        report_to="none",
        max_steps=MAX_STEPS,  # port: max_steps
    )
    trainer = lib.GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=reward_model_dir,
        args=training_args,
        train_dataset=dataset,
    )

    previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}

    trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None

    # Check that the params have changed
    assert_all_changed(previous_trainable_params, trainer)


def test_training_with_num_generations_eval(lib, tiny_model_dir, reward_model_dir, tmp_path):
    dataset = zen("standard_prompt_only")

    training_args = lib.GRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=3,  # reduce the batch size to reduce memory usage
        per_device_eval_batch_size=3,  # reduce the batch size to reduce memory usage
        num_generations=3,  # reduce the number of generations to reduce memory usage
        max_completion_length=8,  # reduce the completion length to reduce memory usage
        num_generations_eval=1,
        eval_strategy="steps",
        eval_steps=2,
        report_to="none",
        max_steps=MAX_STEPS,  # port: max_steps
    )
    trainer = lib.GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=reward_model_dir,
        args=training_args,
        train_dataset=dataset["train"],
        eval_dataset=dataset["test"],
    )

    trainer.train()


# Regression test for eval_on_start with loss_type="grpo" (one of the loss types that depends on
# current_gradient_accumulation_steps): evaluation runs before the first training step, when that value is still
# unset. Previously this caused the initial eval to crash.
def test_training_eval_on_start(lib, tiny_model_dir, reward_model_dir, tmp_path):
    dataset = zen("standard_prompt_only")
    training_args = lib.GRPOConfig(
        output_dir=str(tmp_path),
        learning_rate=0.1,  # use higher lr because gradients are tiny and default lr can stall updates
        per_device_train_batch_size=3,  # reduce the batch size to reduce memory usage
        per_device_eval_batch_size=3,  # reduce the batch size to reduce memory usage
        num_generations=3,  # reduce the number of generations to reduce memory usage
        max_completion_length=8,  # reduce the completion length to reduce memory usage
        loss_type="grpo",
        eval_strategy="steps",
        eval_steps=2,
        eval_on_start=True,
        report_to="none",
        max_steps=MAX_STEPS,  # port: max_steps
    )
    trainer = lib.GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=reward_model_dir,
        args=training_args,
        train_dataset=dataset["train"],
        eval_dataset=dataset["test"],
    )
    trainer.train()


def test_training_multiple_iterations(lib, tiny_model_dir, reward_model_dir, tmp_path):
    dataset = zen("standard_prompt_only", split="train")

    training_args = lib.GRPOConfig(
        output_dir=str(tmp_path),
        learning_rate=0.1,  # use higher lr because gradients are tiny and default lr can stall updates
        per_device_train_batch_size=3,  # reduce the batch size to reduce memory usage
        num_generations=3,  # reduce the number of generations to reduce memory usage
        max_completion_length=8,  # reduce the completion length to reduce memory usage
        num_iterations=2,
        report_to="none",
        max_steps=MAX_STEPS,  # port: max_steps
    )
    trainer = lib.GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=reward_model_dir,
        args=training_args,
        train_dataset=dataset,
    )

    previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}

    trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None

    # Check that the params have changed
    assert_all_changed(previous_trainable_params, trainer)


# ------------------------------------------------------------------------------------------------------- PEFT


def _peft_args(lib, tmp_path, **extra):
    return lib.GRPOConfig(
        output_dir=str(tmp_path),
        learning_rate=0.1,  # use higher lr because gradients are tiny and default lr can stall updates
        per_device_train_batch_size=3,  # reduce the batch size to reduce memory usage
        num_generations=3,  # reduce the number of generations to reduce memory usage
        max_completion_length=8,  # reduce the completion length to reduce memory usage
        report_to="none",
        max_steps=MAX_STEPS,  # port: max_steps
        **extra,
    )


def test_training_peft_config(lib, tiny_model_dir, reward_model_dir, tmp_path):
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype="float32")
    base_param_names = [f"base_model.model.{n}" for n, _ in model.named_parameters()]
    dataset = zen("standard_prompt_only", split="train")

    training_args = _peft_args(lib, tmp_path)
    trainer = lib.GRPOTrainer(
        model=model,
        reward_funcs=reward_model_dir,
        args=training_args,
        train_dataset=dataset,
        peft_config=LoraConfig(),
    )

    previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}

    trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None

    # Check that the peft params have changed and the base model params have not changed
    for n, param in previous_trainable_params.items():
        new_param = trainer.model.get_parameter(n)
        if n in base_param_names:  # We expect the base model params to be the same
            assert torch.allclose(param, new_param), f"Parameter {n} has changed."
        elif "base_layer" not in n:  # We expect the peft params to be different (except for the base layer)
            assert not torch.allclose(param, new_param), f"Parameter {n} has not changed."


def test_training_peft_model(lib, tiny_model_dir, reward_model_dir, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype="float32")
    base_param_names = [f"base_model.model.{n}" for n, _ in model.named_parameters()]
    lora_config = LoraConfig()
    model = get_peft_model(model, lora_config)
    dataset = zen("standard_prompt_only", split="train")

    training_args = _peft_args(lib, tmp_path)
    trainer = lib.GRPOTrainer(
        model=model,
        reward_funcs=reward_model_dir,
        args=training_args,
        train_dataset=dataset,
    )

    previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}

    trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None

    # Check that the peft params have changed and the base model params have not changed
    for n, param in previous_trainable_params.items():
        new_param = trainer.model.get_parameter(n)
        if n in base_param_names:  # We expect the base model params to be the same
            assert torch.allclose(param, new_param), f"Parameter {n} has changed."
        elif "base_layer" not in n and "ref" not in n:  # and the peft params to be different (except base and ref)
            assert not torch.allclose(param, new_param), f"Parameter {n} has not changed."


# In practice, this test is the same as `test_training_peft_config`, since gradient checkpointing is enabled by
# default in `GRPOTrainer`. We keep it as a regression guard: if the default ever changes, we still explicitly test
# PEFT + gradient checkpointing, which has caused issues in the past.
def test_training_peft_with_gradient_checkpointing(lib, tiny_model_dir, reward_model_dir, tmp_path):
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype="float32")
    base_param_names = [f"base_model.model.{n}" for n, _ in model.named_parameters()]
    dataset = zen("standard_prompt_only", split="train")

    training_args = _peft_args(lib, tmp_path, gradient_checkpointing=True)  # enable gradient checkpointing
    trainer = lib.GRPOTrainer(
        model=model,
        reward_funcs=reward_model_dir,
        args=training_args,
        train_dataset=dataset,
        peft_config=LoraConfig(),
    )

    previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}

    trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None

    # Check that the peft params have changed and the base model params have not changed
    for n, param in previous_trainable_params.items():
        new_param = trainer.model.get_parameter(n)
        if n in base_param_names:  # We expect the base model params to be the same
            assert torch.allclose(param, new_param), f"Parameter {n} has changed."
        elif "base_layer" not in n:  # We expect the peft params to be different (except for the base layer)
            assert not torch.allclose(param, new_param), f"Parameter {n} has not changed."


# ---------------------------------------------------------------------------------------------------- rewards


def test_training_different_reward_model(lib, tiny_model_dir, llama_reward_model_dir, tmp_path):
    # Use a reward model different from the model: different chat template, tokenization, etc.
    dataset = zen("conversational_prompt_only", split="train")
    reward_model_id = llama_reward_model_dir
    reward_model = AutoModelForSequenceClassification.from_pretrained(reward_model_id)
    reward_tokenizer = AutoTokenizer.from_pretrained(reward_model_id)
    # By default, the trainer uses the eos token as the padding token. However, for Llama models, the eos token
    # appears in the chat template. Using it as a pad token disrupts the reward calculation, as the calculation
    # considers the score of the last token before the first pad token. To ensure correct reward calculations,
    # we use a separate pad token instead.
    reward_tokenizer.pad_token = "<|finetune_right_pad_id|>"

    training_args = lib.GRPOConfig(
        output_dir=str(tmp_path),
        learning_rate=0.1,  # use higher lr because gradients are tiny and default lr can stall updates
        per_device_train_batch_size=3,  # reduce the batch size to reduce memory usage
        num_generations=3,  # reduce the number of generations to reduce memory usage
        max_completion_length=8,  # reduce the completion length to reduce memory usage
        report_to="none",
        max_steps=MAX_STEPS,  # port: max_steps
    )
    trainer = lib.GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=reward_model,
        args=training_args,
        train_dataset=dataset,
        reward_processing_classes=reward_tokenizer,
    )

    previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}

    trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None

    # Check that the params have changed
    assert_all_changed(previous_trainable_params, trainer)


def _args(lib, tmp_path, **extra):
    """The config most cases share (TRL's, with the port's max_steps); ``extra`` is each case's own options."""
    return lib.GRPOConfig(**{
        "output_dir": str(tmp_path),
        "learning_rate": 0.1,  # use higher lr because gradients are tiny and default lr can stall updates
        "per_device_train_batch_size": 3,  # reduce the batch size to reduce memory usage
        "num_generations": 3,  # reduce the number of generations to reduce memory usage
        "max_completion_length": 8,  # reduce the completion length to reduce memory usage
        "report_to": "none",
        "max_steps": MAX_STEPS,  # port: max_steps
        **extra,
    })


def _train_and_check(lib, model, reward_funcs, args, dataset, **trainer_kwargs):
    """TRL's body: train, check train_loss in the closing record, check every parameter moved."""
    trainer = lib.GRPOTrainer(model=model, reward_funcs=reward_funcs, args=args, train_dataset=dataset,
                              **trainer_kwargs)

    previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}

    trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None

    # Check that the params have changed
    assert_all_changed(previous_trainable_params, trainer)
    return trainer


def test_training_reward_func_standard(lib, tiny_model_dir, tmp_path):
    # Test if trainer can handle reward function with standard format
    dataset = zen("standard_prompt_only", split="train")

    def reward_func(completions, **kwargs):
        """Reward function that rewards longer completions."""
        return [float(len(completion)) for completion in completions]

    _train_and_check(lib, tiny_model_dir, reward_func, _args(lib, tmp_path), dataset)


def test_training_reward_func_conversational(lib, tiny_model_dir, tmp_path):
    # Test if trainer can handle reward function with conversational format
    dataset = zen("conversational_prompt_only", split="train")

    def reward_func(completions, **kwargs):
        """Reward function that gives higher scores to longer completion content."""
        completion_contents = [completion[0]["content"] for completion in completions]
        return [float(len(content)) for content in completion_contents]

    _train_and_check(lib, tiny_model_dir, reward_func, _args(lib, tmp_path), dataset)


def test_training_multiple_reward_funcs(lib, tiny_model_dir, tmp_path):
    # Test that GRPOTrainer can be instantiated with multiple reward functions
    dataset = zen("standard_prompt_only", split="train")

    def reward_func1(completions, **kwargs):
        """Reward function that rewards longer completions."""
        return [float(len(completion)) for completion in completions]

    def reward_func2(completions, **kwargs):
        """Reward function that rewards completions with more unique letters."""
        return [float(len(set(completion))) for completion in completions]

    _train_and_check(lib, tiny_model_dir, [reward_func1, reward_func2], _args(lib, tmp_path), dataset)


def test_training_sync_and_async_reward_funcs(lib, tiny_model_dir, tmp_path):
    # Test that GRPOTrainer can be instantiated with multiple reward functions one of which is async
    dataset = zen("standard_prompt_only", split="train")

    def sync_reward_func1(completions, **kwargs):
        """Reward function that rewards longer completions."""
        return [float(len(completion)) for completion in completions]

    def sync_reward_func2(completions, **kwargs):
        return [1 for _ in completions]

    async def async_reward_func(completions, **kwargs):
        """Async Reward function that rewards completions with more unique letters."""
        return [float(len(set(completion))) for completion in completions]

    _train_and_check(lib, tiny_model_dir, [sync_reward_func1, sync_reward_func2, async_reward_func],
                     _args(lib, tmp_path), dataset)


def test_training_multiple_reward_funcs_with_None_output(lib, tiny_model_dir, tmp_path):
    """Test that a valid math reward function is processed correctly while the code reward function returns None."""
    dataset = zen("standard_prompt_only", split="train")

    def applicable_reward_func(completions, **kwargs):
        """A reward function that rewards longer completions."""
        return [float(len(completion)) for completion in completions]

    def non_applicable_reward_func(completions, **kwargs):
        """A reward function that returns None for all inputs, as it is not applicable to this sample."""
        return [None] * len(completions)

    training_args = _args(lib, tmp_path)

    trainer = lib.GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=[
            applicable_reward_func,
            non_applicable_reward_func,
        ],  # One applicable, one non applicable
        args=training_args,
        train_dataset=dataset,
    )

    previous_trainable_params = {
        n: param.clone() for n, param in trainer.model.named_parameters() if param.requires_grad
    }

    trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None

    # Check that the params have changed
    assert_all_changed(previous_trainable_params, trainer)


def test_training_multiple_mixed_reward_funcs(lib, tiny_model_dir, reward_model_dir, tmp_path):
    # Test if the trainer can handle a mix of reward functions and reward models
    dataset = zen("standard_prompt_only", split="train")

    def reward_func(completions, **kwargs):
        """Reward function that rewards longer completions."""
        return [float(len(completion)) for completion in completions]

    _train_and_check(lib, tiny_model_dir, [reward_func, reward_model_dir], _args(lib, tmp_path), dataset)


def test_training_reward_func_additional_column(lib, tiny_model_dir, tmp_path):
    # Test if trainer can handle reward function that rely on additional columns in the dataset
    dataset = zen("standard_prompt_only", split="train")

    # Add a column to the dataset (dummy example, the column could be anything)
    some_values = list(range(len(dataset)))
    dataset = dataset.add_column("some_values", some_values)

    def reward_func(completions, some_values, **kwargs):
        """Reward function that rewards completions with lengths closer to the values in some_values."""
        return [
            float(abs(len(completion) - value)) for completion, value in zip(completions, some_values, strict=True)
        ]

    _train_and_check(lib, tiny_model_dir, reward_func, _args(lib, tmp_path), dataset)


def test_training_normalize_then_sum_aggregation(lib, tiny_model_dir, tmp_path):
    dataset = zen("standard_prompt_only", split="train")

    def reward_func1(completions, **kwargs):
        """Reward function that rewards longer completions."""
        return [float(len(completion)) for completion in completions]

    def reward_func2(completions, **kwargs):
        """Reward function that rewards completions with more unique letters."""
        return [float(len(set(completion))) for completion in completions]

    _train_and_check(lib, tiny_model_dir, [reward_func1, reward_func2],
                     _args(lib, tmp_path, multi_objective_aggregation="normalize_then_sum"), dataset)


@pytest.mark.parametrize("scale_rewards", [False, "group", "batch", True, "none"])
def test_training_scale_rewards(lib, tiny_model_dir, reward_model_dir, tmp_path, scale_rewards):
    dataset = zen("standard_prompt_only", split="train")
    _train_and_check(lib, tiny_model_dir, reward_model_dir, _args(lib, tmp_path, scale_rewards=scale_rewards),
                     dataset)


def test_warning_raised_all_rewards_none(lib, tiny_model_dir, tmp_path, caplog, request):
    """Test that a proper warning is raised when all rewards are None."""
    if lib.name == "trainers" and tuple(int(p) for p in pytest.__version__.split(".")[:2]) < (9, 2):
        request.applymarker(pytest.mark.xfail(
            strict=True, reason="trainers/logs.py's 'trainers' logger does not propagate (propagate=False), and "
                                "caplog reaches non-propagating loggers only from pytest 9.2"))
    dataset = zen("standard_prompt_only", split="train")

    def always_none_reward_func(completions, **kwargs):
        """Reward function that always returns None."""
        return [None] * len(completions)

    trainer = lib.GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=always_none_reward_func,
        args=_args(lib, tmp_path),
        train_dataset=dataset,
    )

    # TRL's logger name, kept: pytest >= 9.2 attaches caplog's handler to non-propagating loggers too, such as
    # this package's "trainers" logger, which logs TRL's warning
    with caplog.at_level("WARNING", logger="trl.trainer.grpo_trainer"):
        trainer.train()

    expected_warning = "All reward functions returned None for the following kwargs:"
    assert expected_warning in caplog.text


def test_training_with_reward_func_accessing_trainer_state(lib, tiny_model_dir, tmp_path):
    dataset = zen("standard_prompt_only", split="train")

    def reward_func(completions, **kwargs):
        trainer_state = kwargs.get("trainer_state")
        assert trainer_state is not None
        # transformers.TrainerState instance should have a `global_step` property.
        assert hasattr(trainer_state, "global_step")
        return [float(len(set(completion))) for completion in completions]

    training_args = lib.GRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=8,
        report_to="none",
        max_steps=MAX_STEPS,  # port: max_steps
    )
    trainer = lib.GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=reward_func,
        args=training_args,
        train_dataset=dataset,
    )
    trainer.train()


# ------------------------------------------------------------------------------------ reward processing classes


def test_mismatched_reward_processing_classes_length(lib, tiny_model_dir, reward_model_dir, qwen3_reward_model_dir,
                                                     tmp_path):
    """Test that mismatched length between reward_funcs and reward_processing_classes raises error."""
    dataset = zen("standard_prompt_only", split="train")

    # Use two reward models
    reward_models = [reward_model_dir, qwen3_reward_model_dir]

    # Create a single processing class (tokenizer)
    single_processing_class = AutoTokenizer.from_pretrained(reward_model_dir)

    training_args = lib.GRPOConfig(output_dir=str(tmp_path), report_to="none")

    with pytest.raises(ValueError, match="must match"):
        lib.GRPOTrainer(
            model=tiny_model_dir,
            reward_funcs=reward_models,
            reward_processing_classes=single_processing_class,  # only one, but need two
            args=training_args,
            train_dataset=dataset,
        )


def test_correct_reward_processing_classes_list(lib, tiny_model_dir, reward_model_dir, qwen3_reward_model_dir,
                                                tmp_path):
    """Test that correct list of reward_processing_classes works properly."""
    dataset = zen("standard_prompt_only", split="train")

    # Use two reward models
    reward_models = [reward_model_dir, qwen3_reward_model_dir]

    # Create processing classes
    processing_class1 = AutoTokenizer.from_pretrained(reward_model_dir)
    processing_class2 = AutoTokenizer.from_pretrained(qwen3_reward_model_dir)

    training_args = lib.GRPOConfig(output_dir=str(tmp_path), report_to="none")

    # Correct list length should work
    correct_processing_classes = [processing_class1, processing_class2]

    trainer = lib.GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=reward_models,
        reward_processing_classes=correct_processing_classes,
        args=training_args,
        train_dataset=dataset,
    )

    assert len(trainer.reward_processing_classes) == len(reward_models)


def test_single_reward_model_with_single_processing_class(lib, tiny_model_dir, reward_model_dir, tmp_path):
    """Test that single reward model with single processing class works."""
    dataset = zen("standard_prompt_only", split="train")

    # Use single reward model
    reward_model = reward_model_dir

    # Create a single processing class (tokenizer)
    single_processing_class = AutoTokenizer.from_pretrained(reward_model_dir)

    training_args = lib.GRPOConfig(output_dir=str(tmp_path), report_to="none")

    trainer = lib.GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=reward_model,
        reward_processing_classes=single_processing_class,  # single object for single reward model
        args=training_args,
        train_dataset=dataset,
    )

    assert len(trainer.reward_processing_classes) == 1
    assert trainer.reward_processing_classes[0] == single_processing_class


# -------------------------------------------------------------------------------------- reference and the loss


def test_training_with_sync_ref_model(lib, tiny_model_dir, reward_model_dir, tmp_path):
    dataset = zen("standard_prompt_only", split="train")

    training_args = lib.GRPOConfig(
        output_dir=str(tmp_path),
        beta=0.1,  # ensure ref model is created so sync can update it
        learning_rate=0.1,  # use higher lr because gradients are tiny and default lr can stall updates
        per_device_train_batch_size=3,  # reduce the batch size to reduce memory usage
        num_generations=3,  # reduce the number of generations to reduce memory usage
        max_completion_length=8,  # reduce the completion length to reduce memory usage
        sync_ref_model=True,
        ref_model_sync_steps=2,  # reduce sync steps to ensure a sync happens
        report_to="none",
        max_steps=MAX_STEPS,  # port: max_steps
    )
    trainer = lib.GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=reward_model_dir,
        args=training_args,
        train_dataset=dataset,
    )

    previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}
    assert trainer.ref_model is not None
    previous_ref_params = {n: param.clone() for n, param in trainer.ref_model.named_parameters()}

    trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None

    # Check that the params have changed
    for n, param in previous_trainable_params.items():
        new_param = trainer.model.get_parameter(n)
        assert not torch.equal(param, new_param), f"Parameter {n} has not changed."
        new_ref_param = trainer.ref_model.get_parameter(n)
        assert not torch.equal(previous_ref_params[n], new_ref_param), f"Ref Parameter {n} has not changed."


def test_training_beta_non_zero(lib, tiny_model_dir, reward_model_dir, tmp_path):
    dataset = zen("standard_prompt_only", split="train")
    # beta: set beta to non-zero value to test the case where the reference model is used
    _train_and_check(lib, tiny_model_dir, reward_model_dir, _args(lib, tmp_path, beta=0.1), dataset)


def test_training_with_off_policy_mask(lib, tiny_model_dir, reward_model_dir, tmp_path):
    dataset = zen("standard_prompt_only", split="train")

    training_args = _args(lib, tmp_path, off_policy_mask_threshold=0.5)

    trainer = lib.GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=reward_model_dir,
        args=training_args,
        train_dataset=dataset,
    )

    previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}

    trainer.train()

    # Check that the params have changed
    assert_all_changed(previous_trainable_params, trainer)


def test_training_with_bias_correction_kl(lib, tiny_model_dir, reward_model_dir, tmp_path):
    dataset = zen("standard_prompt_only", split="train")
    # beta: set beta to non-zero value to test the case where the reference model is used
    _train_and_check(lib, tiny_model_dir, reward_model_dir,
                     _args(lib, tmp_path, beta=0.1, use_bias_correction_kl=True), dataset)


@pytest.mark.parametrize(
    "model_name",
    ["trl-internal-testing/tiny-Qwen3ForCausalLM", "trl-internal-testing/tiny-Gemma2ForCausalLM"],
    # Gemma2 has the input word embeddings and lm_head tied, Qwen3 does not
)
def test_training_with_cast_lm_head_to_fp32(lib, models, reward_model_dir, tmp_path, model_name):
    dataset = zen("standard_prompt_only", split="train")
    training_args = lib.GRPOConfig(
        output_dir=str(tmp_path),
        learning_rate=0.1,  # use higher lr because gradients are tiny and default lr can stall updates
        per_device_train_batch_size=3,
        num_generations=3,
        max_completion_length=8,
        report_to="none",
        cast_lm_head_to_fp32=True,
        max_steps=MAX_STEPS,  # port: max_steps
    )
    trainer = lib.GRPOTrainer(
        model=models[model_name],
        reward_funcs=reward_model_dir,
        args=training_args,
        train_dataset=dataset,
    )
    previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}

    trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None
    assert trainer.model.lm_head.weight.dtype == torch.float32

    # Check that the params have changed
    assert_all_changed(previous_trainable_params, trainer)


def test_training_with_entropy_filter(lib, tiny_model_dir, reward_model_dir, tmp_path):
    dataset = zen("standard_prompt_only", split="train")
    _train_and_check(lib, tiny_model_dir, reward_model_dir, _args(lib, tmp_path, top_entropy_quantile=0.2), dataset)


def test_training_sequence_importance_sampling(lib, tiny_model_dir, reward_model_dir, tmp_path):
    dataset = zen("standard_prompt_only", split="train")
    training_args = _args(
        lib, tmp_path,
        num_iterations=2,  # the importance sampling weights won't be 0 in this case
        importance_sampling_level="sequence",
    )
    _train_and_check(lib, tiny_model_dir, reward_model_dir, training_args, dataset)


def test_training_num_generations_larger_than_batch_size(lib, tiny_model_dir, reward_model_dir, tmp_path):
    dataset = zen("standard_prompt_only", split="train")

    training_args = lib.GRPOConfig(
        output_dir=str(tmp_path),
        learning_rate=0.1,  # use higher lr because gradients are tiny and default lr can stall updates
        per_device_train_batch_size=3,  # reduce the batch size to reduce memory usage
        max_completion_length=8,  # reduce the completion length to reduce memory usage
        num_generations=6,  # the number of generations is larger than the batch size, but
        gradient_accumulation_steps=2,  # gradient accumulation should allow that
        report_to="none",
        max_steps=MAX_STEPS,  # port: max_steps
    )
    _train_and_check(lib, tiny_model_dir, reward_model_dir, training_args, dataset)


def test_training_delta_clipping(lib, tiny_model_dir, reward_model_dir, tmp_path):
    dataset = zen("standard_prompt_only", split="train")
    # delta: set delta to a non-None value
    _train_and_check(lib, tiny_model_dir, reward_model_dir, _args(lib, tmp_path, delta=2.0), dataset)


def test_training_multiple_dataloader_workers(lib, tiny_model_dir, reward_model_dir, tmp_path):
    dataset = zen("standard_prompt_only", split="train")
    # dataloader_num_workers: use multiple dataloader workers
    _train_and_check(lib, tiny_model_dir, reward_model_dir, _args(lib, tmp_path, dataloader_num_workers=2), dataset)


# ------------------------------------------------------------------------------------------------- generation


def test_training_with_additional_generation_kwargs(lib, tiny_model_dir, reward_model_dir, tmp_path):
    """Test that training works with additional generation kwargs."""
    dataset = zen("standard_prompt_only", split="train")
    training_args = _args(lib, tmp_path, top_p=0.9, top_k=10, min_p=0.01, repetition_penalty=1.1)
    _train_and_check(lib, tiny_model_dir, reward_model_dir, training_args, dataset)


def test_training_with_generation_kwargs(lib, tiny_model_dir, reward_model_dir, tmp_path):
    dataset = zen("standard_prompt_only", split="train")
    training_args = _args(
        lib, tmp_path,
        # Pass gen kwargs
        generation_kwargs={"do_sample": True, "top_k": 50, "num_beams": 2, "length_penalty": -0.1},
    )
    _train_and_check(lib, tiny_model_dir, reward_model_dir, training_args, dataset)


def test_training_with_chat_template_kwargs(lib, models, reward_model_dir, tmp_path):
    dataset = zen("conversational_prompt_only", split="train")
    training_args = lib.GRPOConfig(
        output_dir=str(tmp_path),
        learning_rate=0.1,  # use higher lr because gradients are tiny and default lr can stall updates
        per_device_train_batch_size=3,
        num_generations=3,
        max_completion_length=8,
        report_to="none",
        chat_template_kwargs={"enable_thinking": False},
        max_steps=MAX_STEPS,  # port: max_steps
    )
    _train_and_check(lib, models["trl-internal-testing/tiny-Qwen3ForCausalLM"], reward_model_dir, training_args,
                     dataset)


@fails_here("The patched transformers GenerationMixin.generate is never called: on CPU, generation_engine='auto' "
            "samples Qwen2 with this package's engine (trainers/generation/sampling.py generate() -> "
            "trainers/generation/engine.py), so the random model's completions are all truncated at 8 tokens, "
            "mask_truncated_completions masks every one and no parameter moves (passes with generation_engine='hf')",
            condition=not torch.cuda.is_available())
def test_training_with_mask_truncated_completions(lib, tiny_model_dir, reward_model_dir, tmp_path):
    """Test that training works with mask_truncated_completions=True parameter."""
    eos, pad = AutoTokenizer.from_pretrained(tiny_model_dir)(["<|im_end|>", "<|endoftext|>"])["input_ids"]
    eos, pad = eos[0], pad[0]  # port: TRL's Qwen2.5 ids (151645, 151643) are the tiny tokenizer's

    # We mock the generate method because the model's random weights make it extremely unlikely to produce a
    # sequence containing the EOS token within the allowed max_completion_length. As a result, all tokens are
    # masked in the loss, the model doesn't update, and the final check (which verifies the update) fails.
    def fake_generate(input_ids, **kwargs):
        completion_ids = torch.tensor(
            [
                [1, 2, 3, 4, 5, 6, 7, 8],  # this one is truncated
                [9, 10, 11, eos, pad, pad, pad, pad],  # this one contains eos
                [12, 13, 14, 15, 16, 17, 18, eos],  # particular case, eos is generated just within the limit
            ],
            device=input_ids.device,
        )
        return torch.cat([input_ids, completion_ids], dim=1)

    with patch("transformers.generation.utils.GenerationMixin.generate") as mock_generate:
        mock_generate.side_effect = fake_generate

        dataset = zen("standard_prompt_only", split="train")
        # mask_truncated_completions: Enable masking of truncated completions
        _train_and_check(lib, tiny_model_dir, reward_model_dir, _args(lib, tmp_path, mask_truncated_completions=True),
                         dataset)


@pytest.fixture(scope="session")
def wide_vocab_model_dir(tmp_path_factory):
    """The tiny model with Qwen2.5's vocabulary size (151936; the ids past the tokenizer's 259 decode to nothing),
    so that EOS is as unlikely a sample as in TRL's Hub model."""
    from trainers.cli.tiny import save_tiny_model

    return save_tiny_model(str(tmp_path_factory.mktemp("wide") / "model"), vocab_size=151936, hidden_size=64,
                           num_layers=2)


def test_training_with_mask_truncated_completions_all_masked(lib, wide_vocab_model_dir, reward_model_dir, tmp_path):
    """
    Test that when all generated completions are truncated (i.e., none contain an EOS token), and
    mask_truncated_completions=True, the model receives no effective learning signal and therefore does not update
    its parameters.

    Here, we don't mock the generate method, be we rely on the fact that the model the probability of generating
    the EOS token is extremely low, so all generated completions are truncated.
    """
    # port: with the 259-token tiny model EOS is a 1/259 sample, and TRL 1.16 samples one within 4 steps
    dataset = zen("standard_prompt_only", split="train")

    trainer = lib.GRPOTrainer(
        model=wide_vocab_model_dir,
        reward_funcs=reward_model_dir,
        args=_args(lib, tmp_path, mask_truncated_completions=True),  # Enable masking of truncated completions
        train_dataset=dataset,
    )

    previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}

    trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None

    # Check that the params have changed
    for n, param in previous_trainable_params.items():
        new_param = trainer.model.get_parameter(n)
        assert torch.equal(param, new_param), f"Parameter {n} has changed."


@fails_here("GRPOTrainer has no training_step (AttributeError when patched): the loop is this package's own "
            "(trainers/loop/base.py; GRPO's rounds in GRPOTrainer.prepare_step/build_round/micro_batch), as "
            "docs/migrating-from-trl.md says of overriding training_step / _prepare_inputs")
def test_prepare_input_called_with_correct_data(lib, tiny_model_dir, reward_model_dir, tmp_path):
    dataset = zen("standard_prompt_only", split="train")
    training_args = lib.GRPOConfig(
        output_dir=str(tmp_path),
        learning_rate=0.1,  # use higher lr because gradients are tiny and default lr can stall updates
        max_completion_length=8,  # reduce the completion length to reduce memory usage
        gradient_accumulation_steps=3,  # can be anything in this test
        # steps_per_generation*per_device_train_batch_size=24 is divisible by num_generations=4
        steps_per_generation=4,
        num_generations=4,
        per_device_train_batch_size=6,  # reduce the batch size to reduce memory usage
        num_iterations=2,
        shuffle_dataset=False,
        report_to="none",
    )
    trainer = lib.GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=reward_model_dir,
        args=training_args,
        train_dataset=dataset,
    )
    # steps_per_generation=4, per_device_train_batch_size=6 and num_generations=4, so we expect a
    # generation batch of 24 samples (steps_per_generation * per_device_train_batch_size), containing 6
    # different prompts (steps_per_generation * per_device_train_batch_size // num_generations), each repeated
    # 4 times (num_generations).
    expected_first_generation_batch = (
        [{"prompt": "Beautiful is better than"}] * 4
        + [{"prompt": "Explicit is"}] * 4
        + [{"prompt": "Simple is better"}] * 4
        + [{"prompt": "Complex"}] * 4
        + [{"prompt": "Flat is better than"}] * 4
        + [{"prompt": "Sparse is better"}] * 4
    )
    expected_second_generation_batch = (
        [{"prompt": "Readability"}] * 4
        + [{"prompt": "Special cases aren't special"}] * 4
        + [{"prompt": "Although practicality beats"}] * 4
        + [{"prompt": "Errors should never"}] * 4
        + [{"prompt": "Unless explicitly"}] * 4
        + [{"prompt": "In the face of ambiguity, refuse"}] * 4
    )

    with patch.object(lib.GRPOTrainer, "training_step", wraps=trainer.training_step) as mock_prepare:
        trainer.train()
        # 3 epochs * 2 iterations * 2 generation batches to cover the dataset * 4 steps_per_generation
        assert mock_prepare.call_count == 48
        for i in range(8):  # Generation batch repeated 8 times (steps_per_generation*num_iterations)
            assert mock_prepare.call_args_list[i].args[1] == expected_first_generation_batch
        for i in range(8, 16):
            assert mock_prepare.call_args_list[i].args[1] == expected_second_generation_batch
