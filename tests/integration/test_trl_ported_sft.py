"""TRL's own ``TestSFTTrainer`` cases (tests/test_sft_trainer.py of huggingface/trl), ported by changing the import.

Each case keeps TRL's config and assertions; what changed is where the model and data come from:

- ``trl-internal-testing/tiny-Qwen2ForCausalLM-2.5`` (and ``tiny-Qwen3ForCausalLM`` where TRL uses it) is the
  ``tiny_model_dir`` fixture: a local tiny Qwen2 with a byte-level tokenizer and a ChatML template. Where a case
  needs another shape of model (a tokenizer without pad token or without chat template, a template with tools, a
  Mixture-of-Experts model, a template with ``{% generation %}`` markers, which TRL patches Qwen3's template into
  for ``assistant_only_loss``), a tiny twin is saved offline by a fixture below.
- ``load_dataset("trl-internal-testing/zen", config)`` is ``zen(config)``: offline rows of the same shapes (17 train
  and 2 test rows; the language-modeling texts are short enough that 17 of them pack into 3 rows of 64 byte
  tokens and the 2 test rows into 1, as zen's do with Qwen's tokenizer in TRL's packing cases).

Every case runs against this package (``lib="trainers"``) and, where TRL is importable, against TRL itself
(``lib="trl"``; CI has no TRL, so only "trainers" runs there). Cases that pass with TRL but not here are marked
``@fails_here(reason)``: a strict xfail for ``lib="trainers"`` only. Without a GPU, TRL's configs get
``use_cpu=True`` (TRL's bf16 default needs it there). Two documented differences are read per library: the model
card tag (TRL's "trl", this package's "trainers") and TRL's FutureWarnings deprecating ``compute_metrics`` /
``predict``, which cost TRL an extra forward (checked for TRL only).

Cases that fail with TRL 1.16 itself (they test a newer TRL) are not ported:
test_padding_free_warns_only_for_unsupported_attention (no such warning in 1.16) and
test_train_with_compute_loss_func (1.16 passes ``outputs.loss=None`` to the function).

Left out: cases on Hub-only models (other architectures, remote code, a Hub revision or template, harmony data),
GPU / Liger / bitsandbytes / kernels / flash-attention / vision cases; TestSFTTrainer cases already ported in
test_trl_ported.py (test_train_with_eval, test_train_with_multiple_eval_dataset) and the preparation cases that
test_sft_preparation.py covers (labels given, truncation, transforms, padding_free with max_length).
"""

import contextlib
import json
import pathlib

import pytest
import torch
from datasets import Dataset, DatasetDict, IterableDatasetDict
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainingArguments

try:
    import trl

    HAVE_TRL = True
except ImportError:  # not installed (CI)
    HAVE_TRL = False


# ------------------------------------------------------------------------------------------ the library under test


def fails_here(reason: str, **when):
    """Marks a case that passes with TRL but fails with this package: a strict xfail for lib='trainers' only, for
    every parametrization or those whose parameters match ``when`` (name=value or a tuple of values)."""

    def mark(function):
        function.__dict__.setdefault("_fails_here", []).append((reason, when))
        return function

    return mark


def pytest_generate_tests(metafunc):
    if "lib" in metafunc.fixturenames:
        metafunc.parametrize("lib", [
            "trainers",
            pytest.param("trl", marks=pytest.mark.skipif(not HAVE_TRL, reason="TRL is not installed")),
        ], indirect=True)


class Lib:
    def __init__(self, name: str):
        self.name = name
        if name == "trl":
            from trl import SFTConfig, SFTTrainer
        else:
            from trainers import SFTConfig, SFTTrainer
        self.SFTConfig, self.SFTTrainer = SFTConfig, SFTTrainer
        self.tag = name  # model card tag: TRL adds "trl", this package "trainers" (docs/migrating-from-trl.md)

    def warns_in_trl(self, category, match):
        """TRL's deprecation warnings for what costs TRL an extra forward (compute_metrics, compute_loss_func,
        predict). Here these reuse the trainer's forward and are not deprecated (docs/migrating-from-trl.md), so
        the warning is checked for TRL only."""
        return pytest.warns(category, match=match) if self.name == "trl" else contextlib.nullcontext()


if HAVE_TRL:
    class CpuSFTConfig(trl.SFTConfig):
        """TRL's SFTConfig with use_cpu=True (module level: TRL pickles its args into checkpoints)."""

        def __init__(self, *args, **kwargs):
            kwargs["use_cpu"] = True
            super().__init__(*args, **kwargs)


@pytest.fixture
def lib(request, monkeypatch):
    lib = Lib(request.param)
    if lib.name == "trainers":
        params = request.node.callspec.params
        for reason, when in getattr(request.function, "_fails_here", []):
            if all(params[name] in (value if isinstance(value, tuple) else (value,)) for name, value in when.items()):
                request.applymarker(pytest.mark.xfail(reason=reason, strict=True))
    if lib.name == "trl" and not torch.cuda.is_available():
        # TRL's bf16 default (True unless fp16) is refused by transformers on a machine without a GPU unless
        # use_cpu=True; also for the configs TRL builds itself (args=None, a TrainingArguments converted)
        import trl.trainer.sft_trainer

        lib.SFTConfig = CpuSFTConfig
        monkeypatch.setattr(trl.trainer.sft_trainer, "SFTConfig", CpuSFTConfig)
    yield lib
    if lib.name == "trl":
        # transformers' TrainingArguments resets Accelerate's process-wide state for each TRL trainer; the next
        # case's trainer (this package's, e.g. with another mixed precision) starts from a clean state too
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=True)


# ------------------------------------------------------------------------------------------------ offline "zen"

LM_TEXTS = ["Beautiful.", "Explicit.", "Simple.", "Complex.", "Flat.", "Sparse.", "Readable.", "Practical.",
            "Errors.", "Silenced.", "Ambiguity.", "One way.", "Obvious.", "Dutch.", "Now.", "Never.", "Hard.",
            # test
            "Namespaces.", "Idea."]
QA = [
    ("What is better than ugly?", "Beautiful."),
    ("What is better than implicit?", "Explicit."),
    ("What is better than complex?", "Simple."),
    ("What is better than complicated?", "Complex."),
    ("What is better than nested?", "Flat."),
    ("What is better than dense?", "Sparse."),
    ("What counts?", "Readability."),
    ("Are special cases special enough to break the rules?", "No, special cases aren't special enough."),
    ("What beats purity?", "Practicality."),
    ("Should errors pass silently?", "Errors should never pass silently."),
    ("When can errors pass silently?", "When explicitly silenced."),
    ("What to do in the face of ambiguity?", "Refuse the temptation to guess."),
    ("How many ways should there be to do it?", "One, and preferably only one."),
    ("What may the way not be at first?", "Obvious, unless you're Dutch."),
    ("What is better than never?", "Now."),
    ("What is often better than right now?", "Never."),
    ("What if the implementation is hard to explain?", "It's a bad idea."),
    # test
    ("What if the implementation is easy to explain?", "It may be a good idea."),
    ("What are one honking great idea?", "Namespaces."),
]
PROMPT_COMPLETION = [("The Zen of Python, by", " Tim Peters."), ("Beautiful is better", " than ugly."),
                     ("Explicit is better", " than implicit."), ("Simple is better", " than complex."),
                     ("Complex is better", " than complicated."), ("Flat is better", " than nested."),
                     ("Sparse is better", " than dense."), ("Readability", " counts."),
                     ("Special cases aren't special", " enough to break the rules."),
                     ("Although practicality", " beats purity."), ("Errors should never", " pass silently."),
                     ("Unless explicitly", " silenced."), ("In the face of ambiguity,", " refuse to guess."),
                     ("There should be one", " obvious way to do it."), ("Although that way", " may not be obvious."),
                     ("Now is better", " than never."), ("Although never is", " often better than right now."),
                     # test
                     ("If the implementation is hard to explain,", " it's a bad idea."),
                     ("Namespaces are one", " honking great idea.")]


def zen(config: str, split: str | None = None):
    """The trl-internal-testing/zen configuration ``config``, offline: a DatasetDict (train 17 rows, test 2), or
    the ``split`` ("train", "test", or "train[:n]")."""
    if config == "standard_language_modeling":
        rows = [{"text": text} for text in LM_TEXTS]
    elif config == "conversational_language_modeling":
        rows = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in QA]
    elif config == "standard_prompt_completion":
        rows = [{"prompt": p, "completion": c} for p, c in PROMPT_COMPLETION]
    elif config == "conversational_prompt_completion":
        rows = [{"prompt": [{"role": "user", "content": q}], "completion": [{"role": "assistant", "content": a}]}
                for q, a in QA]
    elif config == "standard_implicit_prompt_preference":
        rows = [{"chosen": p + c, "rejected": p + " than Perl."} for p, c in PROMPT_COMPLETION]
    else:
        raise ValueError(config)
    dataset = DatasetDict({"train": Dataset.from_list(rows[:17]), "test": Dataset.from_list(rows[17:])})
    if split is None:
        return dataset
    if split.startswith("train[:"):
        return dataset["train"].select(range(int(split[len("train[:"):-1])))
    return dataset[split]


def zen_stream(config: str, split: str):
    """``load_dataset(..., streaming=True)``: the split as an IterableDataset."""
    return zen(config, split).to_iterable_dataset()


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "description": "The city."}},
                                                "required": ["city"]}}}
MULTIPLY = {"type": "function", "function": {"name": "multiply", "description": "a times b.",
                                             "parameters": {"type": "object", "properties": {
                                                 "a": {"type": "integer", "description": "a"},
                                                 "b": {"type": "integer", "description": "b"}},
                                                 "required": ["a", "b"]}}}


def toolcall_language_modeling() -> Dataset:
    """trl-internal-testing/toolcall's language_modeling train split, offline: a conversation with a tool call,
    its result and the answer, and the tools as JSON text."""
    rows = []
    for i in range(10):
        if i % 2:
            call, result, answer = {"name": "multiply", "arguments": {"a": i, "b": 3}}, str(3 * i), f"It is {3 * i}."
            question, tools = f"What is {i} times 3?", [MULTIPLY, WEATHER]
        else:
            city = ["Paris", "Oslo", "Lima", "Rome", "Kyiv"][i // 2]
            call, result, answer = {"name": "get_weather", "arguments": {"city": city}}, "sunny", "It is sunny."
            question, tools = f"What is the weather in {city}?", [WEATHER]
        rows.append({"messages": [
            {"role": "user", "content": question},
            {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]},
            {"role": "tool", "name": call["name"], "content": result},
            {"role": "assistant", "content": answer}], "tools": json.dumps(tools)})
    return Dataset.from_list(rows)


# ------------------------------------------------------------------------------------------- tiny model twins

# ChatML with {% generation %} markers around the assistant's turn: renders as tiny_model_dir's template. TRL needs
# the markers for assistant_only_loss (it patches Qwen3's template, TRL's model there, into such a template).
CHATML_TRAINING_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{ '\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CHATML_TEMPLATE_FILE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _save(tmp_path_factory, name: str, **tokenizer_options):
    from trainers.cli.tiny import build_tokenizer, save_tiny_model

    template = tokenizer_options.pop("template", None)
    no_pad = tokenizer_options.pop("no_pad", False)
    tokenizer = build_tokenizer(**tokenizer_options)
    if template is not None:
        tokenizer.chat_template = template
    if no_pad:
        tokenizer.pad_token = None
    return save_tiny_model(str(tmp_path_factory.mktemp(name) / "model"), tokenizer=tokenizer, hidden_size=64,
                           num_layers=2)


@pytest.fixture(scope="module")
def assistant_model_dir(tmp_path_factory):
    """tiny_model_dir with a ChatML template that has {% generation %} markers (for tiny-Qwen3ForCausalLM)."""
    return _save(tmp_path_factory, "assistant", template=CHATML_TRAINING_TEMPLATE)


@pytest.fixture(scope="module")
def no_template_model_dir(tmp_path_factory):
    """A tiny model whose tokenizer has no chat template (for tiny-GPTNeoXForCausalLM)."""
    return _save(tmp_path_factory, "no-template", chat_template=False)


@pytest.fixture(scope="module")
def tools_model_dir(tmp_path_factory):
    """A tiny model whose chat template renders tools and tool calls (Qwen2.5's Hermes form)."""
    return _save(tmp_path_factory, "tools", tools=True)


@pytest.fixture(scope="module")
def no_pad_model_dir(tmp_path_factory):
    """A tiny model whose tokenizer has no pad token (for tiny-MistralForCausalLM-0.2)."""
    return _save(tmp_path_factory, "no-pad", no_pad=True)


@pytest.fixture(scope="module")
def moe_model_dir(tmp_path_factory):
    """A tiny Qwen3-MoE (its config's router_aux_loss_coef: 0.001), for tiny-Qwen3MoeForCausalLM."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from trainers.cli.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, intermediate_size=32, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id))
    path = str(tmp_path_factory.mktemp("moe") / "model")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


# ----------------------------------------------------------------------------------------------------- helpers


def snapshot(trainer) -> dict:
    return {n: param.clone() for n, param in trainer.model.named_parameters()}


def assert_all_changed(trainer, previous: dict, skip=lambda name: False) -> None:
    for n, param in previous.items():
        if skip(n):
            continue
        new_param = trainer.model.get_parameter(n)
        assert not torch.equal(param, new_param), f"Parameter {n} has not changed."


def assert_only_peft_changed(trainer, previous: dict, base_param_names: list[str]) -> None:
    """TRL's PEFT check: base model params unchanged, peft params (but base_layer ones) changed."""
    for n, param in previous.items():
        new_param = trainer.model.get_parameter(n)
        if n in base_param_names:  # We expect the base model params to be the same
            torch.testing.assert_close(param, new_param, msg=f"Parameter {n} has changed.")
        elif "base_layer" not in n:  # We expect the peft params to be different (except for the base layer)
            assert not torch.equal(param, new_param), f"Parameter {n} has not changed."


# ------------------------------------------------------------------------------------------------------- cases

def test_init_with_training_arguments(lib, tiny_model_dir, tmp_path):
    dataset = zen("standard_language_modeling", "train")
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none")
    lib.SFTTrainer(model=tiny_model_dir, args=args, train_dataset=dataset)


@pytest.mark.parametrize("model_name", ["tiny-Qwen2ForCausalLM-2.5", "tiny-Qwen3MoeForCausalLM"])
def test_train(lib, tiny_model_dir, moe_model_dir, tmp_path, model_name):
    """TRL's test_train with its Qwen2 and Qwen3-MoE models (the others are Hub-only architectures)."""
    model_id = moe_model_dir if "Moe" in model_name else tiny_model_dir
    dataset = zen("standard_language_modeling", "train")

    training_args = lib.SFTConfig(output_dir=str(tmp_path), report_to="none")
    trainer = lib.SFTTrainer(model=model_id, args=training_args, train_dataset=dataset)
    previous_trainable_params = snapshot(trainer)
    trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None

    # MoE models log the load-balancing auxiliary loss (on by default)
    if trainer.aux_loss_enabled:
        assert trainer.state.log_history[-1]["aux_loss"] is not None

    assert_all_changed(trainer, previous_trainable_params)


@pytest.mark.parametrize("config_name", ["standard_language_modeling", "conversational_language_modeling",
                                         "standard_prompt_completion", "conversational_prompt_completion"])
def test_train_dataset_format(lib, tiny_model_dir, tmp_path, config_name):
    dataset = zen(config_name, "train")

    training_args = lib.SFTConfig(output_dir=str(tmp_path), report_to="none")
    trainer = lib.SFTTrainer(model=tiny_model_dir, args=training_args, train_dataset=dataset)
    previous_trainable_params = snapshot(trainer)
    trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None
    assert_all_changed(trainer, previous_trainable_params)


def test_train_model(lib, tiny_model_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype="float32")
    dataset = zen("standard_language_modeling", "train")

    training_args = lib.SFTConfig(output_dir=str(tmp_path), report_to="none")
    trainer = lib.SFTTrainer(model=model, args=training_args, train_dataset=dataset)
    previous_trainable_params = snapshot(trainer)
    trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None
    assert_all_changed(trainer, previous_trainable_params)


def test_train_dft_loss(lib, tiny_model_dir, tmp_path):
    dataset = zen("standard_language_modeling")

    training_args = lib.SFTConfig(
        output_dir=str(tmp_path),
        loss_type="dft",
        learning_rate=0.1,  # use higher lr because gradients are tiny and default lr can stall updates
        report_to="none",
        eval_strategy="steps",
        eval_steps=3,
    )
    trainer = lib.SFTTrainer(model=tiny_model_dir, args=training_args, train_dataset=dataset["train"],
                             eval_dataset=dataset["test"])
    previous_trainable_params = snapshot(trainer)
    trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None
    assert_all_changed(trainer, previous_trainable_params)


def test_train_with_formatting_func(lib, tiny_model_dir, tmp_path):
    # Dummy formatting function
    def formatting_prompts_func(example):
        chosen, rejected = example["chosen"], example["rejected"]
        return f"### Chosen: {chosen}\n### Rejected: {rejected}"

    dataset = zen("standard_implicit_prompt_preference", "train")

    training_args = lib.SFTConfig(output_dir=str(tmp_path), report_to="none")
    trainer = lib.SFTTrainer(model=tiny_model_dir, args=training_args, train_dataset=dataset,
                             formatting_func=formatting_prompts_func)
    previous_trainable_params = snapshot(trainer)
    trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None
    assert_all_changed(trainer, previous_trainable_params)


def test_train_model_dtype(lib, tiny_model_dir, tmp_path):
    dataset = zen("standard_language_modeling", "train")

    training_args = lib.SFTConfig(
        output_dir=str(tmp_path),
        model_init_kwargs={"dtype": torch.float16},
        learning_rate=0.1,  # use higher lr because gradients are tiny and default lr can stall updates
        report_to="none",
    )
    trainer = lib.SFTTrainer(model=tiny_model_dir, args=training_args, train_dataset=dataset)
    previous_trainable_params = snapshot(trainer)
    trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None
    for n, param in previous_trainable_params.items():
        # For some reasonn model.layers.0.input_layernorm.weight doesn't change in GitHub Actions but does
        # locally. We ignore this parameter for now
        if "layernorm" in n:
            continue
        new_param = trainer.model.get_parameter(n)
        # Check the torch dtype
        assert new_param.dtype == torch.float16
        assert not torch.equal(param, new_param), f"Parameter {n} has not changed."


def test_peft_init_is_seeded(lib, tiny_model_dir, tmp_path):
    from peft import LoraConfig

    # Two trainers with the same seed start from the same adapter weights
    dataset = zen("standard_language_modeling", "train")
    adapters = []
    for global_seed in range(2):
        torch.manual_seed(global_seed)  # a different global RNG state, as in two separate runs
        trainer = lib.SFTTrainer(model=tiny_model_dir, args=lib.SFTConfig(output_dir=str(tmp_path), report_to="none"),
                                 train_dataset=dataset, peft_config=LoraConfig())
        adapters.append({n: p.clone() for n, p in trainer.model.named_parameters() if "lora_A" in n})

    assert adapters[0]
    for n, param in adapters[0].items():
        assert torch.equal(param, adapters[1][n]), f"Parameter {n} differs between the two trainers."


def test_train_dense_with_peft_config_lora(lib, tiny_model_dir, tmp_path):
    from peft import LoraConfig

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype="float32")
    base_param_names = [f"base_model.model.{n}" for n, _ in model.named_parameters()]
    dataset = zen("standard_language_modeling", "train")

    training_args = lib.SFTConfig(output_dir=str(tmp_path), report_to="none")
    trainer = lib.SFTTrainer(model=tiny_model_dir, args=training_args, train_dataset=dataset, peft_config=LoraConfig())
    previous_trainable_params = snapshot(trainer)
    trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None
    assert_only_peft_changed(trainer, previous_trainable_params, base_param_names)


@pytest.mark.parametrize("peft_type", ["prompt_tuning", "prefix_tuning", "prompt_encoder"])
def test_train_with_peft_config_prompt_tuning(lib, tiny_model_dir, tmp_path, peft_type):
    from peft import PrefixTuningConfig, PromptEncoderConfig, PromptTuningConfig, TaskType

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype="float32")
    base_param_names = [f"base_model.{n}" for n, _ in model.named_parameters()]
    dataset = zen("standard_language_modeling", "train")

    # Initialize the trainer, p-tuning doesn't support gradient checkpointing
    training_args = lib.SFTConfig(bf16=False, output_dir=str(tmp_path), report_to="none", gradient_checkpointing=False)
    if peft_type == "prompt_tuning":
        peft_config = PromptTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=4,
                                         tokenizer_name_or_path=tiny_model_dir)
    elif peft_type == "prefix_tuning":
        peft_config = PrefixTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=4)
    else:
        peft_config = PromptEncoderConfig(
            task_type=TaskType.CAUSAL_LM,
            num_virtual_tokens=4,
            encoder_hidden_size=model.config.hidden_size,  # This will be overwritten below
        )
    trainer = lib.SFTTrainer(model=tiny_model_dir, args=training_args, train_dataset=dataset, peft_config=peft_config)
    previous_trainable_params = snapshot(trainer)
    trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None
    for n, param in previous_trainable_params.items():
        new_param = trainer.model.get_parameter(n)
        if n in base_param_names:  # We expect the base model params to be the same
            torch.testing.assert_close(param, new_param, msg=f"Parameter {n} has changed.")
        else:  # We expect the peft params to be different
            assert not torch.equal(param, new_param), f"Parameter {n} has not changed."


@pytest.mark.parametrize("model_name, expect_coef, expect_aux_loss", [
    # MoE whose forward returns an auxiliary loss: the architecture's own coefficient is applied
    ("moe", 0.001, True),
    # Dense model: no coefficient to inherit
    ("dense", 0.0, False),
])  # (TRL's tiny-DeepseekV3ForCausalLM case is Hub-only)
def test_router_aux_loss_coef_defaults_to_the_architecture(lib, tiny_model_dir, moe_model_dir, tmp_path, model_name,
                                                           expect_coef, expect_aux_loss):
    model_id = moe_model_dir if model_name == "moe" else tiny_model_dir
    dataset = zen("standard_language_modeling", "train[:2]")
    training_args = lib.SFTConfig(output_dir=str(tmp_path), report_to="none")
    trainer = lib.SFTTrainer(model=model_id, args=training_args, train_dataset=dataset)

    assert trainer.router_aux_loss_coef == expect_coef
    assert trainer.aux_loss_enabled == expect_aux_loss


def test_router_aux_loss_coef_fails_without_router_logits(lib, tiny_model_dir, tmp_path):
    dataset = zen("standard_language_modeling", "train[:2]")
    training_args = lib.SFTConfig(output_dir=str(tmp_path), router_aux_loss_coef=0.5, report_to="none")

    # Dense model: no `output_router_logits` on its config, so there is nothing to compute the term from
    with pytest.raises(ValueError, match="not a Mixture-of-Experts model"):
        lib.SFTTrainer(model=tiny_model_dir, args=training_args, train_dataset=dataset)


def test_router_aux_loss_coef_explicit_value_overrides_the_architecture(lib, moe_model_dir, tmp_path):
    dataset = zen("standard_language_modeling", "train[:2]")
    training_args = lib.SFTConfig(output_dir=str(tmp_path), router_aux_loss_coef=0.5, report_to="none")

    trainer = lib.SFTTrainer(model=moe_model_dir, args=training_args, train_dataset=dataset)

    assert trainer.router_aux_loss_coef == 0.5
    assert trainer.aux_loss_enabled


def test_train_peft_model(lib, tiny_model_dir, tmp_path):
    from peft import LoraConfig, get_peft_model

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype="float32")
    base_param_names = [f"base_model.model.{n}" for n, _ in model.named_parameters()]
    model = get_peft_model(model, LoraConfig())
    dataset = zen("standard_language_modeling", "train")

    training_args = lib.SFTConfig(output_dir=str(tmp_path), report_to="none")
    trainer = lib.SFTTrainer(model=model, args=training_args, train_dataset=dataset)
    previous_trainable_params = snapshot(trainer)
    trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None
    assert_only_peft_changed(trainer, previous_trainable_params, base_param_names)


def test_train_with_peft_config_and_gradient_checkpointing(lib, tiny_model_dir, tmp_path):
    from peft import LoraConfig

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype="float32")
    base_param_names = [f"base_model.model.{n}" for n, _ in model.named_parameters()]
    dataset = zen("standard_language_modeling", "train")

    training_args = lib.SFTConfig(output_dir=str(tmp_path), gradient_checkpointing=True, report_to="none")
    trainer = lib.SFTTrainer(model=tiny_model_dir, args=training_args, train_dataset=dataset, peft_config=LoraConfig())
    previous_trainable_params = snapshot(trainer)
    trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None
    assert_only_peft_changed(trainer, previous_trainable_params, base_param_names)


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_train_with_peft_config_and_gradient_checkpointing_reentrant(lib, tiny_model_dir, tmp_path, use_reentrant):
    from peft import LoraConfig

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype="float32")
    base_param_names = [f"base_model.model.{n}" for n, _ in model.named_parameters()]
    dataset = zen("standard_language_modeling", "train")

    training_args = lib.SFTConfig(output_dir=str(tmp_path), gradient_checkpointing=True,
                                  gradient_checkpointing_kwargs={"use_reentrant": use_reentrant}, report_to="none")
    trainer = lib.SFTTrainer(model=tiny_model_dir, args=training_args, train_dataset=dataset, peft_config=LoraConfig())
    previous_trainable_params = snapshot(trainer)
    trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None
    assert_only_peft_changed(trainer, previous_trainable_params, base_param_names)


def test_train_with_non_chatml_conversational_data(lib, tiny_model_dir, tmp_path):
    dataset = zen("conversational_language_modeling", "train")

    # Rename role/content to from/value to ensure SFT works with non-chatML conversational data
    def rename_fields(example: list[dict]):
        return {"conversations": [{"from": m["role"], "value": m["content"]} for m in example["messages"]]}

    dataset = dataset.map(rename_fields, remove_columns="messages")

    training_args = lib.SFTConfig(output_dir=str(tmp_path), report_to="none")
    trainer = lib.SFTTrainer(model=tiny_model_dir, args=training_args, train_dataset=dataset)
    previous_trainable_params = snapshot(trainer)
    trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None
    assert_all_changed(trainer, previous_trainable_params)


def test_train_with_pretokenized_data(lib, tiny_model_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    dataset = zen("standard_language_modeling", "train")

    def tokenize_example(example):
        return tokenizer(example["text"])

    tokenized_dataset = dataset.map(tokenize_example, remove_columns=["text"])

    training_args = lib.SFTConfig(output_dir=str(tmp_path), report_to="none")
    trainer = lib.SFTTrainer(model=tiny_model_dir, args=training_args, train_dataset=tokenized_dataset)
    previous_trainable_params = snapshot(trainer)
    trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None
    assert_all_changed(trainer, previous_trainable_params)


def test_train_with_iterable_dataset(lib, tiny_model_dir, tmp_path):
    dataset = zen_stream("standard_language_modeling", "train")

    training_args = lib.SFTConfig(output_dir=str(tmp_path), max_steps=3, report_to="none")
    trainer = lib.SFTTrainer(model=tiny_model_dir, args=training_args, train_dataset=dataset)
    previous_trainable_params = snapshot(trainer)
    trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None
    assert_all_changed(trainer, previous_trainable_params)


@pytest.mark.parametrize("packing_strategy", ["bfd", "wrapped"])
def test_train_packing(lib, tiny_model_dir, tmp_path, packing_strategy):
    dataset = zen("standard_language_modeling", "train")

    training_args = lib.SFTConfig(output_dir=str(tmp_path), packing=True, packing_strategy=packing_strategy,
                                  max_length=10, report_to="none")
    trainer = lib.SFTTrainer(model=tiny_model_dir, args=training_args, train_dataset=dataset)
    previous_trainable_params = snapshot(trainer)
    trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None
    assert_all_changed(trainer, previous_trainable_params)


def test_eval_packing(lib, tiny_model_dir, tmp_path):
    dataset = zen("standard_language_modeling")

    training_args = lib.SFTConfig(output_dir=str(tmp_path), packing=True, max_length=64, report_to="none")
    trainer = lib.SFTTrainer(model=tiny_model_dir, args=training_args, train_dataset=dataset["train"],
                             eval_dataset=dataset["test"])

    # Check the number of sequences in train and eval datasets
    num_train_seqs = sum(len(x) for x in trainer.train_dataset["seq_lengths"])
    num_eval_seqs = sum(len(x) for x in trainer.eval_dataset["seq_lengths"])
    assert num_train_seqs == 17  # we should still have 17 seqs
    assert num_eval_seqs == 2  # we should still have 2 seqs

    # Check that all sequences are shorter than the max length
    assert all(sum(x) <= 64 for x in trainer.train_dataset["seq_lengths"])
    assert all(sum(x) <= 64 for x in trainer.eval_dataset["seq_lengths"])

    # Check the number of sequences in train and eval datasets
    assert len(trainer.train_dataset["input_ids"]) == 3
    assert len(trainer.eval_dataset["input_ids"]) == 1


def test_only_train_packing(lib, tiny_model_dir, tmp_path):
    dataset = zen("standard_language_modeling")

    training_args = lib.SFTConfig(output_dir=str(tmp_path), packing=True, eval_packing=False, max_length=64,
                                  report_to="none")
    trainer = lib.SFTTrainer(model=tiny_model_dir, args=training_args, train_dataset=dataset["train"],
                             eval_dataset=dataset["test"])

    # Check the number of sequences in train dataset
    num_train_seqs = sum(len(x) for x in trainer.train_dataset["seq_lengths"])
    assert num_train_seqs == 17  # we should still have 17 seqs

    # We expect eval dataset not having "seq_lengths" as eval_packing is False
    assert "seq_lengths" not in trainer.eval_dataset

    # Check that all sequences are shorter than the max length
    assert all(sum(x) <= 64 for x in trainer.train_dataset["seq_lengths"])

    # Check the number of sequences in train and eval datasets
    assert len(trainer.train_dataset["input_ids"]) == 3
    assert len(trainer.eval_dataset["input_ids"]) == 2


# TRL's simplified Qwen chat template, where an additional argument `role_capital` controls the roles' capitalization
ROLE_CAPITAL_TEMPLATE = (
    '{%- if messages[0]["role"] == "system" -%}    {{ "<|im_start|>" + ("SYSTEM" if role_capital else "system") +'
    ' "\\n" + messages[0]["content"] + "<|im_end|>\\n" }}{%- else -%}    {{ "<|im_start|>" + ("SYSTEM" if'
    ' role_capital else "system") + "\\nYou are Qwen, created by Alibaba Cloud. You are a helpful'
    ' assistant.<|im_end|>\\n" }}{%- endif -%}{%- for message in messages -%}    {%- if (message.role == "user")'
    ' or (message.role == "system" and not loop.first) or (message.role == "assistant" and not'
    ' message.tool_calls) -%}        {{ "<|im_start|>" + (message.role.upper() if role_capital else message.role)'
    ' + "\\n" + message.content + "<|im_end|>\\n" }}    {%- elif message.role == "assistant" -%}        {{'
    ' "<|im_start|>" + ("ASSISTANT" if role_capital else "assistant") }}        {%- if message.content -%}'
    '            {{ "\\n" + message.content }}        {%- endif -%}        {{ "<|im_end|>\\n" }}    {%- elif'
    ' message.role == "tool" -%}        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool")'
    ' -%}            {{ "<|im_start|>" + ("USER" if role_capital else "user") }}        {%- endif -%}        {{'
    ' "\\n<tool_response>\\n" + message.content + "\\n</tool_response>" }}        {%- if loop.last or'
    ' (messages[loop.index0 + 1].role != "tool") -%}            {{ "<|im_end|>\\n" }}        {%- endif -%}    {%-'
    ' endif -%}{%- endfor -%}{%- if add_generation_prompt -%}    {{ "<|im_start|>" + ("ASSISTANT" if role_capital'
    ' else "assistant") + "\\n" }}{%- endif -%}'
)


def test_train_with_chat_template_kwargs(lib, tiny_model_dir, tmp_path):
    dataset = zen("conversational_language_modeling", "train")

    training_args = lib.SFTConfig(output_dir=str(tmp_path), report_to="none")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = ROLE_CAPITAL_TEMPLATE

    dataset = dataset.add_column("chat_template_kwargs", [{"role_capital": bool(i % 2)} for i in range(len(dataset))])
    assert "chat_template_kwargs" in dataset.features

    trainer = lib.SFTTrainer(model=tiny_model_dir, args=training_args, train_dataset=dataset,
                             processing_class=tokenizer)

    assert trainer.processing_class.chat_template == tokenizer.chat_template

    for i in range(2):
        role = "SYSTEM" if i else "system"
        system_prompt = (
            f"<|im_start|>{role}\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>"
        )
        system_prompt_ids = trainer.processing_class(system_prompt)["input_ids"]
        assert trainer.train_dataset[i]["input_ids"][: len(system_prompt_ids)] == system_prompt_ids

    previous_trainable_params = snapshot(trainer)
    trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None
    assert_all_changed(trainer, previous_trainable_params)


def test_train_assistant_only(lib, assistant_model_dir, tmp_path):
    dataset = zen("conversational_language_modeling", "train")

    training_args = lib.SFTConfig(output_dir=str(tmp_path), assistant_only_loss=True, report_to="none")
    trainer = lib.SFTTrainer(model=assistant_model_dir, args=training_args, train_dataset=dataset)
    previous_trainable_params = snapshot(trainer)
    trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None
    assert_all_changed(trainer, previous_trainable_params)


def test_dataset_preparation_builds_labels_for_assistant_only_loss(lib, assistant_model_dir, tmp_path):
    """Dataset preparation must bake the assistant masks into a labels column."""
    dataset = zen("conversational_language_modeling", "train")

    training_args = lib.SFTConfig(output_dir=str(tmp_path), assistant_only_loss=True, report_to="none")
    trainer = lib.SFTTrainer(model=assistant_model_dir, args=training_args, train_dataset=dataset)

    assert "labels" in trainer.train_dataset.column_names
    for example in trainer.train_dataset:
        labels, input_ids = example["labels"], example["input_ids"]
        assert len(labels) == len(input_ids)
        # Labels are input_ids with non-assistant tokens masked to -100.
        assert all(label == -100 or label == token_id for label, token_id in zip(labels, input_ids, strict=True))
        assert any(label != -100 for label in labels)  # assistant tokens contribute to the loss
        assert any(label == -100 for label in labels)  # non-assistant tokens are masked


def test_dataset_preparation_builds_labels_for_completion_only(lib, tiny_model_dir, tmp_path):
    """Dataset preparation must bake the completion mask into a labels column when completion_only_loss resolves
    to True (the default for prompt-completion datasets)."""
    dataset = zen("standard_prompt_completion", "train")

    training_args = lib.SFTConfig(output_dir=str(tmp_path), report_to="none")
    trainer = lib.SFTTrainer(model=tiny_model_dir, args=training_args, train_dataset=dataset)

    assert "labels" in trainer.train_dataset.column_names
    for example in trainer.train_dataset:
        labels, input_ids = example["labels"], example["input_ids"]
        assert len(labels) == len(input_ids)
        # Labels are input_ids with prompt tokens masked to -100.
        assert all(label == -100 or label == token_id for label, token_id in zip(labels, input_ids, strict=True))
        assert any(label != -100 for label in labels)  # completion tokens contribute to the loss
        assert any(label == -100 for label in labels)  # prompt tokens are masked


def test_dataset_preparation_builds_labels_for_pretokenized_with_masks(lib, tiny_model_dir, tmp_path):
    """Pre-tokenized datasets that carry mask columns but no labels must get labels built at preparation."""
    dataset = Dataset.from_list([
        {"input_ids": [1, 2, 3, 4], "assistant_masks": [0, 0, 1, 1]},
        {"input_ids": [5, 6, 7], "assistant_masks": [0, 1, 0]},
    ])

    training_args = lib.SFTConfig(output_dir=str(tmp_path), report_to="none")
    trainer = lib.SFTTrainer(model=tiny_model_dir, args=training_args, train_dataset=dataset)

    assert trainer.train_dataset[:]["labels"] == [[-100, -100, 3, 4], [-100, 6, -100]]


def test_packing_carries_labels(lib, tiny_model_dir, tmp_path):
    """With packing enabled, the labels column must be packed alongside input_ids (replacing the masks)."""
    dataset = zen("standard_prompt_completion", "train")

    training_args = lib.SFTConfig(output_dir=str(tmp_path), packing=True, max_length=64, report_to="none")
    trainer = lib.SFTTrainer(model=tiny_model_dir, args=training_args, train_dataset=dataset)

    column_names = trainer.train_dataset.column_names
    assert "labels" in column_names
    assert "completion_mask" not in column_names
    for example in trainer.train_dataset:
        assert len(example["labels"]) == len(example["input_ids"])
    # The packed dataset must still contain trainable (non -100) labels
    assert any(label != -100 for example in trainer.train_dataset for label in example["labels"])


def test_skip_prepare_dataset_with_masks_but_no_labels_raises(lib, tiny_model_dir, tmp_path):
    """With `skip_prepare_dataset=True`, labels are not built at preparation time and the collator doesn't consume
    the mask columns; such datasets must be rejected instead of silently training on the full sequence."""
    dataset = Dataset.from_list([{"input_ids": [1, 2, 3, 4], "assistant_masks": [0, 0, 1, 1]} for _ in range(2)])

    training_args = lib.SFTConfig(output_dir=str(tmp_path), dataset_kwargs={"skip_prepare_dataset": True},
                                  report_to="none")
    with pytest.raises(ValueError, match="Add a 'labels' column"):
        lib.SFTTrainer(model=tiny_model_dir, args=training_args, train_dataset=dataset)


def test_train_completion_only(lib, tiny_model_dir, tmp_path):
    dataset = zen("conversational_prompt_completion", "train")

    training_args = lib.SFTConfig(output_dir=str(tmp_path), completion_only_loss=True, report_to="none")
    trainer = lib.SFTTrainer(model=tiny_model_dir, args=training_args, train_dataset=dataset)
    previous_trainable_params = snapshot(trainer)
    trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None
    assert_all_changed(trainer, previous_trainable_params)


@fails_here("assistant_only_loss=True is refused for conversational prompt/completion rows (ConfigError "
            "'assistant_only_loss=True needs a 'messages' column; train_dataset is in the prompt_completion format', "
            "trainers/sft/trainer.py _row_kwargs; tokenize.py's prompt_completion branch has no assistant spans). TRL "
            "masks the rendered prompt + completion to the assistant turns. Documented (docs/migrating-from-trl.md, "
            "assistant_only_loss)")
def test_train_assistant_only_and_completion_only(lib, assistant_model_dir, tmp_path):
    dataset = zen("conversational_prompt_completion", "train")

    # To test this case, we need to add user messages in the completion (they'll be masked in the loss)
    def add_to_completion(example):
        example["completion"].append(example["prompt"][0])
        example["completion"].append(example["completion"][0])
        return example

    dataset = dataset.map(add_to_completion)

    training_args = lib.SFTConfig(output_dir=str(tmp_path), assistant_only_loss=True, completion_only_loss=True,
                                  report_to="none")
    trainer = lib.SFTTrainer(model=assistant_model_dir, args=training_args, train_dataset=dataset)
    previous_trainable_params = snapshot(trainer)
    trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None
    assert_all_changed(trainer, previous_trainable_params)


def test_train_assistant_only_iterable_dataset(lib, assistant_model_dir, tmp_path):
    dataset = zen_stream("conversational_language_modeling", "train")

    training_args = lib.SFTConfig(output_dir=str(tmp_path), assistant_only_loss=True, max_steps=3, report_to="none")
    trainer = lib.SFTTrainer(model=assistant_model_dir, args=training_args, train_dataset=dataset)
    previous_trainable_params = snapshot(trainer)
    trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None
    assert_all_changed(trainer, previous_trainable_params)


def test_train_with_set_chat_template_from_model(lib, no_template_model_dir, tiny_model_dir, tmp_path):
    dataset = zen("conversational_language_modeling", "train")

    # (TRL's chat_template_path="Qwen/Qwen3-4B":) a tokenizer folder whose chat template is cloned
    training_args = lib.SFTConfig(output_dir=str(tmp_path), chat_template_path=tiny_model_dir, report_to="none")
    # (TRL's tiny-GPTNeoXForCausalLM:) the model doesn't have a chat template set by default
    trainer = lib.SFTTrainer(model=no_template_model_dir, args=training_args, train_dataset=dataset)
    previous_trainable_params = snapshot(trainer)
    trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None
    assert_all_changed(trainer, previous_trainable_params)


@fails_here("checkpoint-9 holds accelerator.save_state's files only (model.safetensors, optimizer.bin, ...): no "
            "tokenizer files, so no chat_template.jinja (trainers/loop/checkpoint.py). TRL's checkpoints are save_model "
            "folders with the tokenizer. Documented layout difference (docs/migrating-from-trl.md#checkpoints); "
            "training passes")
def test_train_with_set_chat_template_from_path(lib, no_template_model_dir, tmp_path):
    dataset = zen("conversational_language_modeling", "train")
    template_file = tmp_path / "data" / "template.jinja"  # TRL's tests/data/template.jinja: a ChatML template
    template_file.parent.mkdir()
    template_file.write_text(CHATML_TEMPLATE_FILE)
    output_dir = tmp_path / "out"

    training_args = lib.SFTConfig(output_dir=str(output_dir), chat_template_path=str(template_file), report_to="none")
    # (TRL's tiny-GPTNeoXForCausalLM:) the model doesn't have a chat template set by default
    trainer = lib.SFTTrainer(model=no_template_model_dir, args=training_args, train_dataset=dataset)
    previous_trainable_params = snapshot(trainer)
    trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None
    assert_all_changed(trainer, previous_trainable_params)

    # Check that the template saved in the output directory is the same as the one used for training
    template_path = pathlib.Path(output_dir) / "checkpoint-9" / "chat_template.jinja"
    assert template_path.exists(), f"Chat template not found at {template_path}"

    with open(template_path) as f:
        template_content = f.read()
    with open(training_args.chat_template_path) as f:
        original_template_content = f.read()
    assert template_content == original_template_content, "Chat template content does not match the original"


def test_train_toolcall_data(lib, tools_model_dir, tmp_path):
    dataset = toolcall_language_modeling()

    training_args = lib.SFTConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,  # toolcall sequences are longer than standard data, reduce batch size
        max_length=512,  # toolcall sequences are longer than standard data, limit length
        report_to="none",
    )
    trainer = lib.SFTTrainer(model=tools_model_dir, args=training_args, train_dataset=dataset)
    previous_trainable_params = snapshot(trainer)
    trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None
    assert_all_changed(trainer, previous_trainable_params)


def test_train_toolcall_data_as_json(lib, tools_model_dir, tmp_path):
    # Tabular backends (Arrow/Parquet) can insert `None` for missing keys in nested structures. If `tools` is stored
    # as a list of dicts and examples use different dict schemas, nulls may be introduced and break tool processing.
    # This test ensures we also support `tools` provided as a list of dicts.
    dataset = toolcall_language_modeling()

    def convert_to_json(example):
        return {"tools": json.loads(example["tools"])}

    dataset = dataset.map(convert_to_json)

    training_args = lib.SFTConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,  # toolcall sequences are longer than standard data, reduce batch size
        max_length=512,  # toolcall sequences are longer than standard data, limit length
        report_to="none",
    )
    trainer = lib.SFTTrainer(model=tools_model_dir, args=training_args, train_dataset=dataset)
    previous_trainable_params = snapshot(trainer)
    trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None
    assert_all_changed(trainer, previous_trainable_params)


@pytest.mark.parametrize("eval_dataset_type", ["dataset", "iterable_dataset", "dataset_dict", "iterable_dataset_dict",
                                               "dict_of_dataset", "dict_of_iterable_dataset"])
def test_evaluate_with_eval_dataset(lib, tiny_model_dir, tmp_path, eval_dataset_type):
    # `evaluate` accepts a raw (unprepared) dataset passed directly, not only a preprocessed `eval_dataset` set at
    # init. See https://github.com/huggingface/trl/issues/6115.
    train_dataset = zen("standard_language_modeling", "train")
    streaming = "iterable" in eval_dataset_type
    eval_split = zen_stream("standard_language_modeling", "test") if streaming \
        else zen("standard_language_modeling", "test")
    if eval_dataset_type in ("dataset", "iterable_dataset"):
        eval_dataset = eval_split
    elif eval_dataset_type in ("dataset_dict", "iterable_dataset_dict"):
        dataset_dict_cls = IterableDatasetDict if streaming else DatasetDict
        eval_dataset = dataset_dict_cls({"data1": eval_split, "data2": eval_split})
    else:  # "dict_of_dataset" or "dict_of_iterable_dataset"
        eval_dataset = {"data1": eval_split, "data2": eval_split}

    training_args = lib.SFTConfig(output_dir=str(tmp_path), report_to="none")
    trainer = lib.SFTTrainer(model=tiny_model_dir, args=training_args, train_dataset=train_dataset)

    metrics = trainer.evaluate(eval_dataset=eval_dataset)
    if eval_dataset_type in ("dataset", "iterable_dataset"):
        assert metrics["eval_loss"] is not None
    else:
        assert metrics["eval_data1_loss"] is not None
        assert metrics["eval_data2_loss"] is not None


def test_train_with_metric_for_best_model(lib, tiny_model_dir, tmp_path):
    dataset = zen("standard_language_modeling")

    training_args = lib.SFTConfig(
        output_dir=str(tmp_path),
        eval_strategy="steps",
        eval_steps=3,
        # It's important to use a key that SFTTrainer adds itself (not one from the base Trainer), since the bug is
        # that trainer-specific metrics don't reach the dict returned by `evaluate()`.
        metric_for_best_model="eval_mean_token_accuracy",
        report_to="none",
    )
    trainer = lib.SFTTrainer(model=tiny_model_dir, args=training_args, train_dataset=dataset["train"],
                             eval_dataset=dataset["test"])
    trainer.train()


@pytest.mark.parametrize("train_dataset_type", ["dataset", "iterable_dataset", "none", "unsupported_dataset_dict"])
@fails_here("trainer.train_dataset returns a streamed train set as given (raw {'text'} rows; trainers/sft/trainer.py "
            "train_dataset property: self._given_train_dataset when train_rows is None, as chunks are prepared during "
            "training); TRL's is the stream mapped to tokenized rows. Documented ('a stream is kept as given')",
            train_dataset_type="iterable_dataset")
def test_init_with_train_dataset(lib, tiny_model_dir, tmp_path, train_dataset_type):
    streaming = "iterable" in train_dataset_type
    if train_dataset_type == "none":
        train_dataset = None
    else:
        train_dataset = zen_stream("standard_language_modeling", "train") if streaming \
            else zen("standard_language_modeling", "train")
        if train_dataset_type == "unsupported_dataset_dict":
            # `DatasetDict` is representative of any unsupported type here; not exhaustive
            train_dataset = DatasetDict({"train": train_dataset})

    # Iterable (streaming) datasets have no length, so `max_steps` is required.
    training_args = lib.SFTConfig(output_dir=str(tmp_path), max_steps=3 if streaming else -1, report_to="none")

    if train_dataset_type == "none":
        with pytest.raises(ValueError, match="`train_dataset` is required"):
            lib.SFTTrainer(model=tiny_model_dir, args=training_args, train_dataset=train_dataset)
    elif train_dataset_type == "unsupported_dataset_dict":
        with pytest.raises(TypeError, match="`train_dataset` must be a `Dataset` or `IterableDataset`"):
            lib.SFTTrainer(model=tiny_model_dir, args=training_args, train_dataset=train_dataset)
    else:
        trainer = lib.SFTTrainer(model=tiny_model_dir, args=training_args, train_dataset=train_dataset)
        assert "input_ids" in next(iter(trainer.train_dataset))


@pytest.mark.parametrize("eval_dataset_type", ["dataset", "iterable_dataset", "dataset_dict", "iterable_dataset_dict",
                                               "dict_of_dataset", "dict_of_iterable_dataset", "none"])
def test_init_with_eval_dataset(lib, tiny_model_dir, tmp_path, eval_dataset_type):
    train_dataset = zen("standard_language_modeling", "train")

    if eval_dataset_type == "none":
        eval_dataset = None
    else:
        streaming = "iterable" in eval_dataset_type
        eval_split = zen_stream("standard_language_modeling", "test") if streaming \
            else zen("standard_language_modeling", "test")
        if eval_dataset_type in ("dataset", "iterable_dataset"):
            eval_dataset = eval_split
        elif eval_dataset_type in ("dataset_dict", "iterable_dataset_dict"):
            dataset_dict_cls = IterableDatasetDict if streaming else DatasetDict
            eval_dataset = dataset_dict_cls({"data1": eval_split, "data2": eval_split})
        else:  # "dict_of_dataset" or "dict_of_iterable_dataset"
            eval_dataset = {"data1": eval_split, "data2": eval_split}

    training_args = lib.SFTConfig(output_dir=str(tmp_path), report_to="none")
    trainer = lib.SFTTrainer(model=tiny_model_dir, args=training_args, train_dataset=train_dataset,
                             eval_dataset=eval_dataset)

    if eval_dataset_type == "none":
        assert trainer.eval_dataset is None
    elif isinstance(trainer.eval_dataset, dict):
        assert set(trainer.eval_dataset.keys()) == {"data1", "data2"}
        # Each split was tokenized independently.
        assert "input_ids" in next(iter(trainer.eval_dataset["data1"]))
        assert "input_ids" in next(iter(trainer.eval_dataset["data2"]))
    else:
        assert "input_ids" in next(iter(trainer.eval_dataset))


def test_train_with_compute_metrics(lib, tiny_model_dir, tmp_path):
    dataset = zen("standard_language_modeling")

    def dummy_compute_metrics(eval_pred):
        # The logits are the full-vocabulary logits, as before the fused LM head
        assert eval_pred.predictions.shape[-1] == trainer.model.config.vocab_size
        return {"my_metric": 0.123}

    training_args = lib.SFTConfig(output_dir=str(tmp_path), eval_strategy="steps", eval_steps=3, report_to="none")
    trainer = lib.SFTTrainer(model=tiny_model_dir, args=training_args, train_dataset=dataset["train"],
                             eval_dataset=dataset["test"], compute_metrics=dummy_compute_metrics)

    with lib.warns_in_trl(FutureWarning, match="`return_outputs=True`"):
        trainer.train()

    assert trainer.state.log_history[-2]["eval_my_metric"] == 0.123


def test_predict_returns_logits(lib, tiny_model_dir, tmp_path):
    dataset = zen("standard_language_modeling", "test")
    training_args = lib.SFTConfig(output_dir=str(tmp_path), report_to="none")
    trainer = lib.SFTTrainer(model=tiny_model_dir, args=training_args, train_dataset=dataset)

    with lib.warns_in_trl(FutureWarning, match="`return_outputs=True`"):
        predictions = trainer.predict(trainer.train_dataset)

    assert predictions.predictions.shape[-1] == trainer.model.config.vocab_size


def test_chunked_nll_is_deprecated_alias_of_nll(lib, tmp_path):
    with pytest.warns(FutureWarning, match="`loss_type='chunked_nll'` is deprecated"):
        training_args = lib.SFTConfig(output_dir=str(tmp_path), loss_type="chunked_nll", report_to="none")
    assert training_args.loss_type == "nll"


def test_train_with_gradient_checkpointing(lib, tiny_model_dir, tmp_path):
    dataset = zen("standard_language_modeling", "train")

    training_args = lib.SFTConfig(output_dir=str(tmp_path), gradient_checkpointing=True, report_to="none")
    trainer = lib.SFTTrainer(model=tiny_model_dir, args=training_args, train_dataset=dataset)
    previous_trainable_params = snapshot(trainer)
    trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None
    assert_all_changed(trainer, previous_trainable_params)


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_train_with_gradient_checkpointing_reentrant(lib, tiny_model_dir, tmp_path, use_reentrant):
    dataset = zen("standard_language_modeling", "train")

    training_args = lib.SFTConfig(output_dir=str(tmp_path), gradient_checkpointing=True,
                                  gradient_checkpointing_kwargs={"use_reentrant": use_reentrant}, report_to="none")
    trainer = lib.SFTTrainer(model=tiny_model_dir, args=training_args, train_dataset=dataset)
    previous_trainable_params = snapshot(trainer)
    trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None
    assert_all_changed(trainer, previous_trainable_params)


def test_tag_added(lib, tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no args: the default output_dir ("<model>-SFT") is relative
    dataset = zen("standard_language_modeling", "train")

    trainer = lib.SFTTrainer(model=tiny_model_dir, train_dataset=dataset)

    for tag in ["sft", lib.tag]:  # TRL: ["sft", "trl"]
        assert tag in trainer.model.model_tags


def test_tag_added_peft(lib, tiny_model_dir, tmp_path, monkeypatch):
    from peft import LoraConfig

    monkeypatch.chdir(tmp_path)
    dataset = zen("standard_language_modeling", "train")

    trainer = lib.SFTTrainer(model=tiny_model_dir, train_dataset=dataset, peft_config=LoraConfig())

    for tag in ["sft", lib.tag]:  # TRL: ["sft", "trl"]
        assert tag in trainer.model.model_tags


def _assert_prompt_encoder_trained(trainer, previous_trainable_params):
    for n, param in previous_trainable_params.items():
        new_param = trainer.model.get_parameter(n)
        if "base_model" in n:  # We expect the base model params to be the same
            torch.testing.assert_close(param, new_param, msg=f"Parameter {n} has changed.")
        elif "prompt_encoder" in n:  # We expect the peft params to be different
            assert not torch.equal(param, new_param), f"Parameter {n} has not changed."
        else:
            raise ValueError(f"Unexpected parameter {n} in model: {trainer.model}")


def test_prompt_tuning(lib, tiny_model_dir, tmp_path):
    """Test that SFT works with Prompt Tuning."""
    from peft import PromptEncoderConfig, TaskType

    dataset = zen("standard_language_modeling", "train")

    training_args = lib.SFTConfig(output_dir=str(tmp_path), report_to="none")
    trainer = lib.SFTTrainer(model=tiny_model_dir, args=training_args, train_dataset=dataset,
                             peft_config=PromptEncoderConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=8))
    previous_trainable_params = snapshot(trainer)
    trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None
    assert trainer.state.log_history[-1]["mean_token_accuracy"] is not None
    _assert_prompt_encoder_trained(trainer, previous_trainable_params)


def test_prompt_tuning_peft_model(lib, tiny_model_dir, tmp_path):
    """Test that SFT works with Prompt Tuning and a pre-converted PeftModel"""
    from peft import PromptEncoderConfig, TaskType, get_peft_model

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype="float32")
    model = get_peft_model(model, PromptEncoderConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=8))
    dataset = zen("standard_language_modeling", "train")

    training_args = lib.SFTConfig(output_dir=str(tmp_path), report_to="none")
    trainer = lib.SFTTrainer(model=model, args=training_args, train_dataset=dataset)
    previous_trainable_params = snapshot(trainer)
    trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None
    assert trainer.state.log_history[-1]["mean_token_accuracy"] is not None
    _assert_prompt_encoder_trained(trainer, previous_trainable_params)


def test_pad_token_id_synced_with_model_config(lib, no_pad_model_dir, tmp_path):
    # This model's tokenizer has no pad token, so the trainer falls back to the eos token. The model configs must
    # follow: otherwise `Trainer` realigns them at train time and reports it as a change the user did not make.
    dataset = zen("standard_language_modeling", "train")

    training_args = lib.SFTConfig(output_dir=str(tmp_path), report_to="none")
    trainer = lib.SFTTrainer(model=no_pad_model_dir, args=training_args, train_dataset=dataset)

    pad_token_id = trainer.processing_class.pad_token_id
    assert pad_token_id is not None
    assert trainer.model.config.pad_token_id == pad_token_id
    assert trainer.model.generation_config.pad_token_id == pad_token_id


# TRL's ids are Qwen's: 151643 <|endoftext|>, 151644 <|im_start|>, 151645 <|im_end|>; here the tiny tokenizer's
@pytest.mark.parametrize("generation_eos_tokens, expected_eos_tokens", [
    (["<|im_end|>", "<|endoftext|>"], ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]),  # a list, as Qwen and Llama
    ("<|im_end|>", ["<|im_start|>", "<|im_end|>"]),  # a single id, as Mistral and GPT-2 ship
    (None, ["<|im_start|>"]),  # no id at all
    (["<|im_start|>", "<|im_end|>"], ["<|im_start|>", "<|im_end|>"]),  # a list that already holds the requested token
])
def test_eos_token_id_synced_with_model_config(lib, tiny_model_dir, tmp_path, generation_eos_tokens,
                                               expected_eos_tokens):
    # The trainer sets the requested eos token on the tokenizer. The model configs must follow: otherwise `Trainer`
    # realigns them at train time and reports it as a change the user did not make. The generation config holds the
    # eos token as a list, as a single id, or not at all, so cover the three shapes.
    ids = AutoTokenizer.from_pretrained(tiny_model_dir).convert_tokens_to_ids
    generation_eos_token_id = generation_eos_tokens if generation_eos_tokens is None else ids(generation_eos_tokens)
    expected_eos_token_ids = ids(expected_eos_tokens)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype="float32")
    model.generation_config.eos_token_id = generation_eos_token_id

    dataset = zen("standard_language_modeling", "train")

    training_args = lib.SFTConfig(output_dir=str(tmp_path), eos_token="<|im_start|>", report_to="none")
    trainer = lib.SFTTrainer(model=model, args=training_args, train_dataset=dataset)

    eos_token_id = trainer.processing_class.eos_token_id
    assert eos_token_id == ids("<|im_start|>")
    assert trainer.model.config.eos_token_id == eos_token_id
    # The model's own eos tokens are kept, since any of them halts generation
    assert trainer.model.generation_config.eos_token_id == expected_eos_token_ids
