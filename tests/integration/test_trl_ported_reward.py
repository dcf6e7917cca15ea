"""TRL's own ``TestRewardTrainer`` cases (huggingface/trl, tests/test_reward_trainer.py), ported by changing the
import.

Each case keeps TRL's config and assertions. What changes (marked ``# port:`` where a line changed):

- ``TrlTestCase`` methods become plain functions, ``self.tmp_dir`` pytest's ``tmp_path``;
- the Hub models become tiny models built offline: ``trl-internal-testing/tiny-Qwen2ForCausalLM-2.5`` is the
  ``tiny_model_dir`` fixture (a tiny Qwen2 causal LM, loaded as a sequence classifier as TRL loads it),
  ``tiny-Qwen2ForSequenceClassification-2.5`` a tiny Qwen2 classifier (``num_labels=1``, the same tokenizer), and
  the other tiny Hub models (Qwen3-MoE, Llama, GPT-NeoX without a chat template, a remote-code model with its
  ``RemoteForSequenceClassification``) are built the same way; ``Qwen/Qwen3-4B`` as a ``chat_template_path`` is a
  tokenizer folder with a ChatML template; for the tool-call cases the tiny Qwen2 has a template that renders tools
  and a BPE trained on those conversations, so that they fit TRL's ``max_length=512`` as Qwen2.5's tokens do;
- ``load_dataset("trl-internal-testing/zen", config)`` becomes ``zen_preference(config)`` (tests/trl_zen.py: the
  same rows, 17 train and 2 test), ``trl-internal-testing/toolcall`` its ``toolcall_preference()``;
- TRL's ``lazy_shared_datadir / "template.jinja"`` is a ChatML template file written to ``tmp_path``;
- TRL trains its default 3 epochs (9 steps of 8 pairs); the training cases add ``max_steps=MAX_STEPS`` to stay
  short (not the case that reads ``checkpoint-9``).

Every case runs against this package and, where ``import trl`` works (TRL 1.16 locally; not in CI), against TRL
too: the ``lib`` fixture. A case that passes with TRL but not here is marked ``xfail(strict=True)`` for
``lib="trainers"`` only, with the reason (``fails_here``; with parameter values, only those parametrizations).

Every case of ``TestRewardTrainer`` passes with TRL 1.16 and runs offline on a CPU (it has no GPU, Liger,
bitsandbytes or vision case). Not ported: ``test_tag_added`` / ``test_tag_added_peft`` (this package tags its
models "trainers", not "trl", on purpose); ``TestDataCollatorForPreference`` (TRL's collator class, not public API
here).
"""

import json
import os
import pathlib

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from tests.trl_zen import (
    ROLE_CAPITAL_TEMPLATE,
    eval_dataset_of,
    fails_here,
    lib_fixture,
    save_tiny_causal_lm,
    save_tiny_remote_model,
    toolcall_preference,
)
from tests.trl_zen import zen_preference as zen

MAX_STEPS = 3  # port: max_steps (TRL's default 3 epochs are 9 steps of 8 pairs)


# ------------------------------------------------------------------------------------------------------ libraries


lib = lib_fixture("Reward")


# --------------------------------------------------------------------------------------- tiny models, offline

CHATML_TEMPLATE_FILE = (  # TRL's tests/data/template.jinja: a ChatML template
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
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
    with the byte-level ChatML tokenizer."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from trainers.cli.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    model = Qwen2ForSequenceClassification(Qwen2Config(vocab_size=len(tokenizer), num_labels=1, **_small()))
    return _save(model, tokenizer, tmp_path_factory.mktemp("reward") / "tiny-Qwen2ForSequenceClassification-2.5")


@pytest.fixture(scope="session")
def moe_model_dir(tmp_path_factory):
    """``trl-internal-testing/tiny-Qwen3MoeForCausalLM``."""
    return save_tiny_causal_lm(str(tmp_path_factory.mktemp("moe") / "tiny-Qwen3MoeForCausalLM"),
                               "Qwen3MoeForCausalLM")


@pytest.fixture(scope="session")
def llama_model_dir(tmp_path_factory):
    """``trl-internal-testing/tiny-LlamaForCausalLM-3.2``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainers.cli.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    torch.manual_seed(2)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), bos_token_id=None, **_small()))
    return _save(model, tokenizer, tmp_path_factory.mktemp("llama") / "tiny-LlamaForCausalLM-3.2")


@pytest.fixture(scope="session")
def gpt_neox_model_dir(tmp_path_factory):
    """``trl-internal-testing/tiny-GPTNeoXForCausalLM``: a GPT-NeoX whose tokenizer has no chat template."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    from trainers.cli.tiny import build_tokenizer

    tokenizer = build_tokenizer(chat_template=False)
    torch.manual_seed(3)
    model = GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1,
                                             num_attention_heads=2, intermediate_size=64, bos_token_id=None))
    return _save(model, tokenizer, tmp_path_factory.mktemp("neox") / "tiny-GPTNeoXForCausalLM")


@pytest.fixture(scope="session")
def tools_model_dir(tmp_path_factory):
    """``trl-internal-testing/tiny-Qwen2ForCausalLM-2.5`` for the tool-call cases: its chat template renders tools
    and tool calls (as Qwen2.5's), and its tokenizer is a BPE trained on those rendered conversations, so that they
    fit TRL's ``max_length=512`` (the byte-level tokenizer makes them ~780 tokens; Qwen2.5's makes them short)."""
    from trainers.cli.tiny import build_task_tokenizer, build_tokenizer, save_tiny_model

    renderer = build_tokenizer(tools=True)
    texts = [renderer.apply_chat_template(row["prompt"] + row[column], tools=json.loads(row["tools"]), tokenize=False)
             for split in ("train", "test") for row in toolcall_preference(split) for column in ("chosen", "rejected")]
    tokenizer = build_task_tokenizer(texts * 4, vocab_size=600, tools=True)
    return save_tiny_model(str(tmp_path_factory.mktemp("tools") / "model"), tokenizer=tokenizer, hidden_size=64,
                           num_layers=2)


_REMOTE_SEQUENCE_CLASSIFICATION = '''

from torch import nn
from transformers import Qwen2ForSequenceClassification, Qwen2Model, Qwen2PreTrainedModel


class RemoteForSequenceClassification(Qwen2ForSequenceClassification):
    config_class = RemoteConfig

    def __init__(self, config):  # the base model built directly: AutoModel does not know RemoteConfig
        Qwen2PreTrainedModel.__init__(self, config)
        self.num_labels = config.num_labels
        self.model = Qwen2Model(config)
        self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False)
        self.post_init()
'''


@pytest.fixture(scope="session")
def remote_model_dir(tmp_path_factory):
    """``trl-internal-testing/tiny-RemoteForCausalLM``: a tiny model whose code lives in its folder (``auto_map``),
    with a sequence classifier of its own (``RemoteForSequenceClassification``)."""
    path = save_tiny_remote_model(str(tmp_path_factory.mktemp("remote") / "tiny-RemoteForCausalLM"))
    with open(os.path.join(path, "modeling_remote.py"), "a") as f:
        f.write(_REMOTE_SEQUENCE_CLASSIFICATION)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["auto_map"]["AutoModelForSequenceClassification"] = "modeling_remote.RemoteForSequenceClassification"
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return path


@pytest.fixture
def models(tiny_model_dir, moe_model_dir, llama_model_dir):
    """The tiny Hub causal LMs TRL's cases name, by their Hub id."""
    return {"trl-internal-testing/tiny-Qwen2ForCausalLM-2.5": tiny_model_dir,
            "trl-internal-testing/tiny-Qwen3MoeForCausalLM": moe_model_dir,
            "trl-internal-testing/tiny-LlamaForCausalLM-3.2": llama_model_dir}


# ------------------------------------------------------------------------------------------ TestRewardTrainer


def test_raises_error_when_model_num_labels_not_one(lib, tiny_model_dir, tmp_path):
    """Test that RewardTrainer raises ValueError when model doesn't have num_labels=1."""
    model = AutoModelForSequenceClassification.from_pretrained(
        tiny_model_dir,  # port: tiny-Qwen2ForCausalLM-2.5
        dtype="float32",
        # num_labels=2,  # Defaults to 2 num_labels for causal models
    )

    dataset = zen("standard_implicit_prompt_preference", split="train")

    training_args = lib.RewardConfig(output_dir=str(tmp_path), report_to="none")
    with pytest.raises(ValueError, match=r"reward models require `num_labels=1`"):
        lib.RewardTrainer(model=model, args=training_args, train_dataset=dataset)


@pytest.mark.parametrize(
    "model_id",
    [
        "trl-internal-testing/tiny-Qwen2ForCausalLM-2.5",
        "trl-internal-testing/tiny-Qwen3MoeForCausalLM",
        "trl-internal-testing/tiny-LlamaForCausalLM-3.2",
    ],
)
def test_train(lib, models, tmp_path, model_id):
    dataset = zen("standard_implicit_prompt_preference", split="train")

    training_args = lib.RewardConfig(output_dir=str(tmp_path), report_to="none",
                                     max_steps=MAX_STEPS)  # port: max_steps
    trainer = lib.RewardTrainer(model=models[model_id], args=training_args,  # port: tiny offline model
                                train_dataset=dataset)

    previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}

    trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None

    # Check that the params have changed
    for n, param in previous_trainable_params.items():
        new_param = trainer.model.get_parameter(n)
        assert not torch.equal(param, new_param), f"Parameter {n} has not changed."


def _eval_split(eval_dataset_type):
    return eval_dataset_of(eval_dataset_type, "standard_implicit_prompt_preference")


@pytest.mark.parametrize(
    "eval_dataset_type",
    [
        "dataset",
        "iterable_dataset",
        "dataset_dict",
        "iterable_dataset_dict",
        "dict_of_dataset",
        "dict_of_iterable_dataset",
    ],
)
def test_evaluate_with_eval_dataset(lib, tiny_model_dir, tmp_path, eval_dataset_type):
    # `evaluate` accepts a raw (unprepared) dataset passed directly, not only a preprocessed `eval_dataset` set
    # at init. See https://github.com/huggingface/trl/issues/6115.
    train_dataset = zen("standard_implicit_prompt_preference", split="train")
    eval_dataset = _eval_split(eval_dataset_type)

    training_args = lib.RewardConfig(output_dir=str(tmp_path), report_to="none")
    trainer = lib.RewardTrainer(
        model=tiny_model_dir, args=training_args, train_dataset=train_dataset  # port: tiny offline model
    )

    metrics = trainer.evaluate(eval_dataset=eval_dataset)
    if eval_dataset_type in ("dataset", "iterable_dataset"):
        assert metrics["eval_loss"] is not None
    else:
        assert metrics["eval_data1_loss"] is not None
        assert metrics["eval_data2_loss"] is not None


def test_trust_remote_code(lib, remote_model_dir, tmp_path):
    dataset = zen("standard_implicit_prompt_preference", split="train")
    model_id = remote_model_dir  # port: tiny-RemoteForCausalLM, offline

    with pytest.raises(ValueError, match="custom code"):
        lib.RewardTrainer(
            model=model_id,
            args=lib.RewardConfig(output_dir=str(tmp_path), report_to="none"),
            train_dataset=dataset,
        )

    trainer = lib.RewardTrainer(
        model=model_id,
        args=lib.RewardConfig(output_dir=str(tmp_path), report_to="none", trust_remote_code=True),
        train_dataset=dataset,
    )
    assert type(trainer.model).__name__ == "RemoteForSequenceClassification"


def _train_and_check(trainer):
    """TRL's common tail: train, a train_loss, every parameter changed."""
    previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}

    trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None

    # Check that the params have changed
    for n, param in previous_trainable_params.items():
        new_param = trainer.model.get_parameter(n)
        assert not torch.equal(param, new_param), f"Parameter {n} has not changed."


@pytest.mark.parametrize(
    "config_name",
    [
        "standard_preference",
        "conversational_preference",
        "standard_implicit_prompt_preference",
        "conversational_implicit_prompt_preference",
    ],
)
def test_train_dataset_types(lib, tiny_model_dir, tmp_path, config_name):
    dataset = zen(config_name, split="train")

    training_args = lib.RewardConfig(output_dir=str(tmp_path), report_to="none",
                                     max_steps=MAX_STEPS)  # port: max_steps
    trainer = lib.RewardTrainer(
        model=tiny_model_dir,  # port: tiny offline model
        args=training_args,
        train_dataset=dataset,
    )

    _train_and_check(trainer)


def test_train_model(lib, tiny_model_dir, tmp_path):
    model = AutoModelForSequenceClassification.from_pretrained(
        tiny_model_dir,  # port: tiny-Qwen2ForCausalLM-2.5
        num_labels=1,  # required for reward models
        dtype="float32",
    )

    dataset = zen("standard_implicit_prompt_preference", split="train")

    training_args = lib.RewardConfig(output_dir=str(tmp_path), report_to="none",
                                     max_steps=MAX_STEPS)  # port: max_steps
    trainer = lib.RewardTrainer(model=model, args=training_args, train_dataset=dataset)

    _train_and_check(trainer)


def test_train_from_sequence_classification_model(lib, reward_model_dir, tmp_path):
    dataset = zen("standard_implicit_prompt_preference", split="train")

    training_args = lib.RewardConfig(output_dir=str(tmp_path), report_to="none",
                                     max_steps=MAX_STEPS)  # port: max_steps
    trainer = lib.RewardTrainer(
        model=reward_model_dir,  # port: tiny-Qwen2ForSequenceClassification-2.5, offline
        args=training_args,
        train_dataset=dataset,
    )

    _train_and_check(trainer)


def test_train_model_dtype(lib, tiny_model_dir, tmp_path):
    dataset = zen("standard_implicit_prompt_preference", split="train")

    training_args = lib.RewardConfig(
        output_dir=str(tmp_path),
        model_init_kwargs={"dtype": torch.float16},
        learning_rate=0.1,  # use higher lr because gradients are tiny and default lr can stall updates
        report_to="none",
        max_steps=MAX_STEPS,  # port: max_steps
    )
    trainer = lib.RewardTrainer(
        model=tiny_model_dir,  # port: tiny offline model
        args=training_args,
        train_dataset=dataset,
    )

    previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}

    trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None

    # Check that the params have changed
    for n, param in previous_trainable_params.items():
        # For some reasonn model.layers.0.input_layernorm.weight doesn't change in GitHub Actions but does
        # locally. We ignore this parameter for now
        if "layernorm" in n:
            continue
        new_param = trainer.model.get_parameter(n)
        # Check the torch dtype
        assert new_param.dtype == torch.float16
        assert not torch.equal(param, new_param), f"Parameter {n} has not changed."


def _train_and_check_peft(trainer, base_param_names):
    """TRL's PEFT tail: train, a train_loss, the base model's parameters unchanged and the adapters' changed."""
    previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}

    trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None

    # Check that the peft params have changed and the base model params have not changed
    for n, param in previous_trainable_params.items():
        new_param = trainer.model.get_parameter(n)
        if n in base_param_names:  # We expect the base model params to be the same
            torch.testing.assert_close(param, new_param, msg=f"Parameter {n} has changed.")
        elif "base_layer" not in n:  # We expect the peft params to be different (except for the base layer)
            assert not torch.equal(param, new_param), f"Parameter {n} has not changed."


def test_train_dense_with_peft_config(lib, tiny_model_dir, tmp_path):
    from peft import LoraConfig

    model_id = tiny_model_dir  # port: tiny-Qwen2ForCausalLM-2.5
    model = AutoModelForSequenceClassification.from_pretrained(model_id, dtype="float32")
    base_param_names = [f"base_model.model.{n}" for n, _ in model.named_parameters()]

    dataset = zen("standard_implicit_prompt_preference", split="train")

    training_args = lib.RewardConfig(output_dir=str(tmp_path), report_to="none",
                                     max_steps=MAX_STEPS)  # port: max_steps

    trainer = lib.RewardTrainer(
        model=model_id,
        args=training_args,
        train_dataset=dataset,
        peft_config=LoraConfig(),
    )

    _train_and_check_peft(trainer, base_param_names)


def test_train_moe_with_peft_config(lib, moe_model_dir, tmp_path):
    from peft import LoraConfig

    model_id = moe_model_dir  # port: tiny-Qwen3MoeForCausalLM
    model = AutoModelForSequenceClassification.from_pretrained(model_id, dtype="float32")
    base_param_names = [f"base_model.model.{n}" for n, _ in model.named_parameters()]

    dataset = zen("standard_implicit_prompt_preference", split="train")

    training_args = lib.RewardConfig(output_dir=str(tmp_path), report_to="none",
                                     max_steps=MAX_STEPS)  # port: max_steps

    trainer = lib.RewardTrainer(
        model=model_id,
        args=training_args,
        train_dataset=dataset,
        peft_config=LoraConfig(target_modules=["gate_proj", "up_proj", "down_proj", "score"]),
    )

    _train_and_check_peft(trainer, base_param_names)


def test_train_peft_model(lib, tiny_model_dir, tmp_path):
    from peft import LoraConfig, get_peft_model

    model_id = tiny_model_dir  # port: tiny-Qwen2ForCausalLM-2.5
    model = AutoModelForSequenceClassification.from_pretrained(
        model_id,
        num_labels=1,  # required for reward models
        dtype="float32",
    )

    base_param_names = [f"base_model.model.{n}" for n, _ in model.named_parameters()]

    lora_config = LoraConfig()
    model = get_peft_model(model, lora_config)

    dataset = zen("standard_implicit_prompt_preference", split="train")

    training_args = lib.RewardConfig(output_dir=str(tmp_path), report_to="none",
                                     max_steps=MAX_STEPS)  # port: max_steps
    trainer = lib.RewardTrainer(model=model, args=training_args, train_dataset=dataset)

    _train_and_check_peft(trainer, base_param_names)


# In practice, this test is the same as `test_train_dense_with_peft_config`, since gradient checkpointing is
# enabled by default in `RewardTrainer`. We keep it as a regression guard: if the default ever changes, we still
# explicitly test PEFT + gradient checkpointing, which has caused issues in the past.
def test_train_with_peft_config_and_gradient_checkpointing(lib, tiny_model_dir, tmp_path):
    from peft import LoraConfig

    model_id = tiny_model_dir  # port: tiny-Qwen2ForCausalLM-2.5
    model = AutoModelForSequenceClassification.from_pretrained(model_id, dtype="float32")
    base_param_names = [f"base_model.model.{n}" for n, _ in model.named_parameters()]

    dataset = zen("standard_implicit_prompt_preference", split="train")

    training_args = lib.RewardConfig(output_dir=str(tmp_path), gradient_checkpointing=True, report_to="none",
                                     max_steps=MAX_STEPS)  # port: max_steps

    trainer = lib.RewardTrainer(
        model=model_id,
        args=training_args,
        train_dataset=dataset,
        peft_config=LoraConfig(),
    )

    _train_and_check_peft(trainer, base_param_names)


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_train_with_peft_config_and_gradient_checkpointing_reentrant(lib, reward_model_dir, tmp_path, use_reentrant):
    from peft import LoraConfig

    model_id = reward_model_dir  # port: tiny-Qwen2ForSequenceClassification-2.5, offline
    model = AutoModelForSequenceClassification.from_pretrained(model_id, dtype="float32")
    base_param_names = [f"base_model.model.{n}" for n, _ in model.named_parameters()]

    dataset = zen("standard_implicit_prompt_preference", split="train")

    training_args = lib.RewardConfig(
        output_dir=str(tmp_path),
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": use_reentrant},
        report_to="none",
        max_steps=MAX_STEPS,  # port: max_steps
    )

    trainer = lib.RewardTrainer(
        model=model_id,
        args=training_args,
        train_dataset=dataset,
        peft_config=LoraConfig(),
    )

    _train_and_check_peft(trainer, base_param_names)


@fails_here("Pre-tokenized rows are refused: DatasetFormatError \"train_dataset row 0: column 'chosen' is missing "
            "or empty\" (trainers/preference/data.py check_columns); TRL takes chosen_ids/rejected_ids as they are, and "
            "chosen_input_ids/rejected_input_ids renamed to them with a FutureWarning",
            chosen_column=("chosen_ids", "chosen_input_ids"))
@pytest.mark.parametrize(
    "chosen_column,rejected_column,expect_deprecation_warning",
    [
        ("chosen_ids", "rejected_ids", False),
        ("chosen_input_ids", "rejected_input_ids", True),
    ],
)
def test_train_with_pretokenized_data(lib, tiny_model_dir, tmp_path, chosen_column, rejected_column,
                                      expect_deprecation_warning):
    model_id = tiny_model_dir  # port: tiny-Qwen2ForCausalLM-2.5
    tokenizer = AutoTokenizer.from_pretrained(model_id)
    dataset = zen("standard_implicit_prompt_preference", split="train")

    def tokenize_example(example):
        return {
            chosen_column: tokenizer(example["chosen"]).input_ids,
            rejected_column: tokenizer(example["rejected"]).input_ids,
        }

    # Apply tokenization
    tokenized_dataset = dataset.map(tokenize_example, remove_columns=["chosen", "rejected"])

    training_args = lib.RewardConfig(output_dir=str(tmp_path), report_to="none",
                                     max_steps=MAX_STEPS)  # port: max_steps
    if expect_deprecation_warning:
        with pytest.warns(FutureWarning, match=r"will not be supported in v1"):
            trainer = lib.RewardTrainer(model=model_id, args=training_args, train_dataset=tokenized_dataset)
    else:
        trainer = lib.RewardTrainer(model=model_id, args=training_args, train_dataset=tokenized_dataset)

    assert "chosen_ids" in trainer.train_dataset.column_names
    assert "rejected_ids" in trainer.train_dataset.column_names
    assert "chosen_input_ids" not in trainer.train_dataset.column_names
    assert "rejected_input_ids" not in trainer.train_dataset.column_names

    _train_and_check(trainer)


def test_train_with_iterable_dataset(lib, tiny_model_dir, tmp_path):
    dataset = zen("standard_implicit_prompt_preference", split="train", streaming=True)

    training_args = lib.RewardConfig(output_dir=str(tmp_path), max_steps=3, report_to="none")
    trainer = lib.RewardTrainer(
        model=tiny_model_dir,  # port: tiny offline model
        args=training_args,
        train_dataset=dataset,
    )

    _train_and_check(trainer)


def test_train_with_chat_template_kwargs(lib, tiny_model_dir, tmp_path):
    dataset = zen("conversational_implicit_prompt_preference", split="train")

    training_args = lib.RewardConfig(output_dir=str(tmp_path), report_to="none",
                                     max_steps=MAX_STEPS)  # port: max_steps

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)  # port: tiny-Qwen2ForCausalLM-2.5
    # The following template is a simplified version of the Qwen chat template, where an additional argument
    # `role_capital` is used to control the capitalization of roles.
    tokenizer.chat_template = ROLE_CAPITAL_TEMPLATE

    dataset = dataset.add_column(
        "chat_template_kwargs", [{"role_capital": bool(i % 2)} for i in range(len(dataset))]
    )
    assert "chat_template_kwargs" in dataset.features

    trainer = lib.RewardTrainer(
        model=tiny_model_dir,  # port: tiny offline model
        args=training_args,
        train_dataset=dataset,
        processing_class=tokenizer,
    )

    assert trainer.processing_class.chat_template == tokenizer.chat_template

    for i in range(2):
        role = "SYSTEM" if i else "system"
        system_prompt = (
            f"<|im_start|>{role}\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>"
        )
        system_prompt_ids = trainer.processing_class(system_prompt)["input_ids"]
        assert trainer.train_dataset[i]["chosen_ids"][: len(system_prompt_ids)] == system_prompt_ids
        assert trainer.train_dataset[i]["rejected_ids"][: len(system_prompt_ids)] == system_prompt_ids

    _train_and_check(trainer)


def _train_and_check_neox(trainer):
    """TRL's tail for tiny-GPTNeoXForCausalLM: every parameter but the final LayerNorm's bias changed."""
    previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}

    trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None

    # Check that the params have changed
    for n, param in previous_trainable_params.items():
        new_param = trainer.model.get_parameter(n)
        # RewardTrainer uses a mean-free loss that cancels uniform shifts in output scores. Since GPT-NeoX models
        # include a final LayerNorm, its bias consistently receives zero gradient and remains unchanged, so we skip
        # this parameter.
        if n == "gpt_neox.final_layer_norm.bias":
            continue
        assert not torch.equal(param, new_param), f"Parameter {n} has not changed."


def test_train_with_set_chat_template_from_model(lib, gpt_neox_model_dir, tiny_model_dir, tmp_path):
    dataset = zen("conversational_preference", split="train")

    training_args = lib.RewardConfig(
        output_dir=str(tmp_path),
        chat_template_path=tiny_model_dir,  # port: Qwen/Qwen3-4B -> a tokenizer folder with a ChatML template
        report_to="none",
        max_steps=MAX_STEPS,  # port: max_steps
    )
    # trl-internal-testing/tiny-GPTNeoXForCausalLM doesn't have a chat template set by default
    trainer = lib.RewardTrainer(
        model=gpt_neox_model_dir,  # port: tiny-GPTNeoXForCausalLM, offline
        args=training_args,
        train_dataset=dataset,
    )

    _train_and_check_neox(trainer)


@fails_here("checkpoint-9 holds accelerator.save_state's files only (no tokenizer files, so no "
            "chat_template.jinja; trainers/loop/checkpoint.py). TRL's checkpoints are save_model folders with the "
            "tokenizer. Documented layout difference (docs/migrating-from-trl.md#checkpoints); training passes")
def test_train_with_set_chat_template_from_path(lib, gpt_neox_model_dir, tmp_path):
    dataset = zen("conversational_preference", split="train")
    template_file = tmp_path / "data" / "template.jinja"  # port: lazy_shared_datadir -> a template file written here
    template_file.parent.mkdir()
    template_file.write_text(CHATML_TEMPLATE_FILE)
    output_dir = tmp_path / "out"  # port: self.tmp_dir

    training_args = lib.RewardConfig(
        output_dir=str(output_dir),
        chat_template_path=str(template_file),
        report_to="none",
    )
    # trl-internal-testing/tiny-GPTNeoXForCausalLM doesn't have a chat template set by default
    trainer = lib.RewardTrainer(
        model=gpt_neox_model_dir,  # port: tiny-GPTNeoXForCausalLM, offline
        args=training_args,
        train_dataset=dataset,
    )

    _train_and_check_neox(trainer)

    # Check that the template saved in the output directory is the same as the one used for training
    template_path = pathlib.Path(output_dir) / "checkpoint-9" / "chat_template.jinja"
    assert template_path.exists(), f"Chat template not found at {template_path}"

    with open(template_path) as f:
        template_content = f.read()
    with open(training_args.chat_template_path) as f:
        original_template_content = f.read()
    assert template_content == original_template_content, "Chat template content does not match the original"


def test_train_toolcall_data(lib, tools_model_dir, tmp_path):
    dataset = toolcall_preference(split="train")  # port: trl-internal-testing/toolcall, offline

    training_args = lib.RewardConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,  # toolcall sequences are longer than standard data, reduce batch size
        max_length=512,  # toolcall sequences are longer than standard data, limit length to avoid OOM
        report_to="none",
        max_steps=MAX_STEPS,  # port: max_steps
    )
    trainer = lib.RewardTrainer(
        model=tools_model_dir,  # port: tiny-Qwen2ForCausalLM-2.5 (its template renders tools)
        args=training_args,
        train_dataset=dataset,
    )

    _train_and_check(trainer)


def test_train_toolcall_data_as_json(lib, tools_model_dir, tmp_path):
    # Tabular backends (Arrow/Parquet) can insert `None` for missing keys in nested structures.
    # If `tools` is stored as a list of dicts and examples use different dict schemas, nulls may
    # be introduced and break tool processing. This test ensures we also support `tools` provided
    # as a list of dicts.
    dataset = toolcall_preference(split="train")  # port: trl-internal-testing/toolcall, offline

    def convert_to_json(example):
        return {"tools": json.loads(example["tools"])}

    dataset = dataset.map(convert_to_json)

    training_args = lib.RewardConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,  # toolcall sequences are longer than standard data, reduce batch size
        max_length=512,  # toolcall sequences are longer than standard data, limit length to avoid OOM
        report_to="none",
        max_steps=MAX_STEPS,  # port: max_steps
    )
    trainer = lib.RewardTrainer(
        model=tools_model_dir,  # port: tiny-Qwen2ForCausalLM-2.5 (its template renders tools)
        args=training_args,
        train_dataset=dataset,
    )

    _train_and_check(trainer)


def test_train_with_eval(lib, tiny_model_dir, tmp_path):
    dataset = zen("standard_implicit_prompt_preference")

    training_args = lib.RewardConfig(output_dir=str(tmp_path), eval_strategy="steps", eval_steps=3,
                                     report_to="none", max_steps=MAX_STEPS)  # port: max_steps
    trainer = lib.RewardTrainer(
        model=tiny_model_dir,  # port: tiny offline model
        args=training_args,
        train_dataset=dataset["train"],
        eval_dataset=dataset["test"],
    )

    trainer.train()

    assert trainer.state.log_history[0]["eval_loss"] is not None


def test_train_with_multiple_eval_dataset(lib, tiny_model_dir, tmp_path):
    dataset = zen("standard_implicit_prompt_preference")

    training_args = lib.RewardConfig(output_dir=str(tmp_path), eval_strategy="steps", eval_steps=3,
                                     report_to="none", max_steps=MAX_STEPS)  # port: max_steps
    trainer = lib.RewardTrainer(
        model=tiny_model_dir,  # port: tiny offline model
        args=training_args,
        train_dataset=dataset["train"],
        eval_dataset={"data1": dataset["test"], "data2": dataset["test"]},
    )
    trainer.train()

    assert trainer.state.log_history[-3]["eval_data1_loss"] is not None
    assert trainer.state.log_history[-2]["eval_data2_loss"] is not None


def test_train_dataset_required(lib, tiny_model_dir, tmp_path):
    training_args = lib.RewardConfig(output_dir=str(tmp_path), report_to="none")
    with pytest.raises(ValueError, match="`train_dataset` is required"):
        lib.RewardTrainer(model=tiny_model_dir, args=training_args)  # port: tiny offline model


@pytest.mark.parametrize(
    "eval_dataset_type",
    [
        "dataset",
        "iterable_dataset",
        "dataset_dict",
        "iterable_dataset_dict",
        "dict_of_dataset",
        "dict_of_iterable_dataset",
        "none",
    ],
)
def test_init_with_eval_dataset(lib, tiny_model_dir, tmp_path, eval_dataset_type):
    train_dataset = zen("standard_implicit_prompt_preference", split="train")

    eval_dataset = None if eval_dataset_type == "none" else _eval_split(eval_dataset_type)

    training_args = lib.RewardConfig(output_dir=str(tmp_path), report_to="none")
    trainer = lib.RewardTrainer(
        model=tiny_model_dir,  # port: tiny offline model
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
    )

    if eval_dataset_type == "none":
        assert trainer.eval_dataset is None
    elif isinstance(trainer.eval_dataset, dict):
        assert set(trainer.eval_dataset.keys()) == {"data1", "data2"}
        # Each split was tokenized independently.
        assert "chosen_ids" in next(iter(trainer.eval_dataset["data1"]))
        assert "chosen_ids" in next(iter(trainer.eval_dataset["data2"]))
    else:
        assert "chosen_ids" in next(iter(trainer.eval_dataset))


@fails_here("RewardTrainer refuses compute_metrics: ConfigError 'RewardTrainer(compute_metrics=...) is not "
            "supported' (trainers/reward/trainer.py __init__); TRL calls it on each evaluation and logs eval_my_metric")
def test_train_with_compute_metrics(lib, tiny_model_dir, tmp_path):
    dataset = zen("standard_implicit_prompt_preference")

    def dummy_compute_metrics(eval_pred):
        return {"my_metric": 0.123}

    training_args = lib.RewardConfig(
        output_dir=str(tmp_path),
        eval_strategy="steps",
        eval_steps=3,
        report_to="none",
        max_steps=MAX_STEPS,  # port: max_steps
    )
    trainer = lib.RewardTrainer(
        model=tiny_model_dir,  # port: tiny offline model
        args=training_args,
        train_dataset=dataset["train"],
        eval_dataset=dataset["test"],
        compute_metrics=dummy_compute_metrics,
    )

    trainer.train()

    assert trainer.state.log_history[-2]["eval_my_metric"] == 0.123


# In practice, this test is the same as `test_train`, since gradient checkpointing is enabled by default in
# `RewardTrainer`. We keep it as a regression guard: if the default ever changes, we still explicitly test gradient
# checkpointing, which has caused issues in the past.
def test_train_with_gradient_checkpointing(lib, tiny_model_dir, tmp_path):
    dataset = zen("standard_implicit_prompt_preference", split="train")

    training_args = lib.RewardConfig(output_dir=str(tmp_path), gradient_checkpointing=True, report_to="none",
                                     max_steps=MAX_STEPS)  # port: max_steps
    trainer = lib.RewardTrainer(
        model=tiny_model_dir,  # port: tiny offline model
        args=training_args,
        train_dataset=dataset,
    )

    _train_and_check(trainer)


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_train_with_gradient_checkpointing_reentrant(lib, reward_model_dir, tmp_path, use_reentrant):
    dataset = zen("standard_implicit_prompt_preference", split="train")

    training_args = lib.RewardConfig(
        output_dir=str(tmp_path),
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": use_reentrant},
        report_to="none",
        max_steps=MAX_STEPS,  # port: max_steps
    )
    trainer = lib.RewardTrainer(
        model=reward_model_dir,  # port: tiny-Qwen2ForSequenceClassification-2.5, offline
        args=training_args,
        train_dataset=dataset,
    )

    _train_and_check(trainer)


def test_train_with_margin(lib, tiny_model_dir, tmp_path):
    dataset = zen("standard_implicit_prompt_preference", split="train")

    def add_margin(example):
        # dummy margin based on the length of the chosen summary
        return {"margin": len(example["chosen"])}

    dataset = dataset.map(add_margin)

    training_args = lib.RewardConfig(output_dir=str(tmp_path), report_to="none",
                                     max_steps=MAX_STEPS)  # port: max_steps
    trainer = lib.RewardTrainer(
        model=tiny_model_dir,  # port: tiny offline model
        args=training_args,
        train_dataset=dataset,
    )

    _train_and_check(trainer)


def test_train_with_center_rewards_coefficient(lib, tiny_model_dir, tmp_path):
    dataset = zen("standard_implicit_prompt_preference", split="train")

    training_args = lib.RewardConfig(output_dir=str(tmp_path), center_rewards_coefficient=0.01, report_to="none",
                                     max_steps=MAX_STEPS)  # port: max_steps
    trainer = lib.RewardTrainer(
        model=tiny_model_dir,  # port: tiny offline model
        args=training_args,
        train_dataset=dataset,
    )

    _train_and_check(trainer)
