"""TRL's ``trl-internal-testing/zen`` preference configurations, offline, for the tests ported from TRL.

``zen_preference(config, split, streaming)`` stands for ``load_dataset("trl-internal-testing/zen", config,
split=split, streaming=streaming)``: the same rows as on the Hub (TRL's ``scripts/generate_zen_dataset.py``: 19
rows split with ``train_test_split(test_size=0.1, shuffle=False)``, i.e. 17 train rows and 2 test rows).

Configurations: ``standard_preference``, ``conversational_preference``, ``standard_implicit_prompt_preference``,
``conversational_implicit_prompt_preference``, ``standard_unpaired_preference``,
``conversational_unpaired_preference``; and, for cases that mix them, ``standard_prompt_only``,
``conversational_prompt_only``, ``standard_prompt_completion``, ``conversational_prompt_completion``,
``standard_language_modeling``, ``conversational_language_modeling``.

Also what the ported DPO and KTO test modules share: ``toolcall_preference`` (``trl-internal-testing/toolcall``'s
``preference`` config, offline), ``ROLE_CAPITAL_TEMPLATE`` (TRL's chat-template-kwargs template), ``TinyHub`` /
``save_tiny_causal_lm`` / ``save_tiny_remote_model`` (the tiny ``trl-internal-testing`` models, built offline), and
``lib_fixture`` / ``fails_here`` (each case against this package and TRL; strict xfail for this package only).
"""

from __future__ import annotations

from datasets import Dataset, DatasetDict, IterableDatasetDict

# The 19 standard rows: (prompt, chosen completion, rejected completion).
STANDARD = [
    ("Beautiful is better than", " ugly.", " the moon."),
    ("Explicit is", " better than implicit.", " worse than nothing."),
    ("Simple is better", " than complex.", " than a long vacation."),
    ("Complex", " is better than complicated.", " is always the answer."),
    ("Flat is better than", " nested.", " chocolate."),
    ("Sparse is better", " than dense.", " without any context."),
    ("Readability", " counts.", " is optional."),
    ("Special cases aren't special", " enough to break the rules.", " enough to become unicorns."),
    ("Although practicality beats", " purity.", " reality."),
    ("Errors should never", " pass silently.", " pass their driving test."),
    ("Unless explicitly", " silenced.", " forgotten."),
    ("In the face of ambiguity, refuse", " the temptation to guess.", " the opportunity to laugh."),
    ("There should be one-- and preferably", " only one --obvious way to do it.", " two or more confusing methods."),
    ("Although that way may not be obvious at first unless you're", " Dutch.", " a time traveler."),
    ("Now is", " better than never.", " never better."),
    ("Although never is often", " better than *right* now.", " not even a possibility."),
    ("If the implementation is hard to explain,", " it's a bad idea.", " it's clearly the best choice."),
    ("If the implementation is easy", " to explain, it may be a good idea.", " it's probably magic."),
    ("Namespaces are one honking great", " idea -- let's do more of those!", " watermelon -- let's plant some!"),
]

# The 19 conversational rows: (user question, chosen answer, rejected answer).
CONVERSATIONAL = [
    ("What is better than ugly?", "Beautiful.", "Acceptable."),
    ("What is better than implicit?", "Explicit.", "Explained."),
    ("What is better than complex?", "Simple.", "Very complex."),
    ("What is better than complicated?", "Complex.", "Very complicated."),
    ("What is better than nested?", "Flat.", "Circular."),
    ("What is better than dense?", "Sparse.", "Heavy."),
    ("What counts?", "Readability.", "Looking complicated."),
    ("Are special cases enough to break the rules?", "No, special cases aren't special enough to break the rules.",
     "Yes, special cases are special enough to break the rules."),
    ("What beats purity?", "Practicality.", "Nothing."),
    ("What should never pass silently?", "Errors.", "Warnings."),
    ("When can errors pass silently?", "When explicitly silenced.", "Never."),
    ("What should you do in the face of ambiguity?", "Refuse the temptation to guess.", "Give up."),
    ("How many ways should there be to do it?", "One, and preferably only one.", "As many as possible."),
    ("For whom may the way not be obvious at first?", "Dutch.", "French."),
    ("What is better than never?", "Now is better than never.", "Some day."),
    ("Is never better than *right* now?", "Yes, often.", "No, never."),
    ("What does it mean if the implementation is hard to explain?", "It means it's a bad idea.",
     "It means it's a good idea."),
    ("What does it mean if the implementation is easy to explain?", "It means it may be a good idea.",
     "It means it's a bad idea."),
    ("Any great ideas?", "Namespaces are one honking great idea.", "Recursion."),
]

# The unpaired configurations: which of the two completions each row keeps, and its label (as on the Hub).
STANDARD_UNPAIRED_LABELS = [True, False, False, True, True, False, True, False, True, True, False, True, True,
                            False, True, False, True, False, False]
CONVERSATIONAL_UNPAIRED_LABELS = [True, True, True, False, True, True, True, False, True, False, True, False, True,
                                  False, False, True, True, True, True]

def _user(text):
    return [{"role": "user", "content": text}]


def _assistant(text):
    return [{"role": "assistant", "content": text}]


def _rows(config: str) -> list[dict]:
    if config == "standard_preference":
        return [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in STANDARD]
    if config == "conversational_preference":
        return [{"prompt": _user(q), "chosen": _assistant(c), "rejected": _assistant(r)} for q, c, r in CONVERSATIONAL]
    if config == "standard_implicit_prompt_preference":
        return [{"chosen": p + c, "rejected": p + r} for p, c, r in STANDARD]
    if config == "conversational_implicit_prompt_preference":
        return [{"chosen": _user(q) + _assistant(c), "rejected": _user(q) + _assistant(r)}
                for q, c, r in CONVERSATIONAL]
    if config == "standard_unpaired_preference":
        return [{"prompt": p, "completion": c if label else r, "label": label}
                for (p, c, r), label in zip(STANDARD, STANDARD_UNPAIRED_LABELS)]
    if config == "conversational_unpaired_preference":
        return [{"prompt": _user(q), "completion": _assistant(c if label else r), "label": label}
                for (q, c, r), label in zip(CONVERSATIONAL, CONVERSATIONAL_UNPAIRED_LABELS)]
    if config == "standard_prompt_only":
        return [{"prompt": p} for p, _, _ in STANDARD]
    if config == "conversational_prompt_only":
        return [{"prompt": _user(q)} for q, _, _ in CONVERSATIONAL]
    if config == "standard_prompt_completion":
        return [{"prompt": p, "completion": c} for p, c, _ in STANDARD]
    if config == "conversational_prompt_completion":
        return [{"prompt": _user(q), "completion": _assistant(c)} for q, c, _ in CONVERSATIONAL]
    if config == "standard_language_modeling":
        return [{"text": p + c} for p, c, _ in STANDARD]
    if config == "conversational_language_modeling":
        return [{"messages": _user(q) + _assistant(c)} for q, c, _ in CONVERSATIONAL]
    raise ValueError(f"unknown zen configuration: {config}")


def zen_preference(config: str, split: str | None = None, streaming: bool = False):
    """``load_dataset("trl-internal-testing/zen", config, split=split, streaming=streaming)``, offline.

    A DatasetDict (train: 17 rows, test: 2 rows), or the ``split`` ("train", "test", or "train[:n]") as a Dataset;
    with ``streaming=True``, an IterableDatasetDict / IterableDataset of the same rows."""
    rows = _rows(config)
    splits = DatasetDict({"train": Dataset.from_list(rows[:17]), "test": Dataset.from_list(rows[17:])})
    if split is None:
        return IterableDatasetDict({k: v.to_iterable_dataset() for k, v in splits.items()}) if streaming else splits
    if split.startswith("train[:"):
        dataset = splits["train"].select(range(int(split[len("train[:"):-1])))
    else:
        dataset = splits[split]
    return dataset.to_iterable_dataset() if streaming else dataset


# ------------------------------------------------------------------------- trl-internal-testing/toolcall, offline

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city."}},
                   "required": ["city"]}}}
MULTIPLY_TOOL = {"type": "function", "function": {
    "name": "multiply", "description": "a times b.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "description": "a"},
                                                   "b": {"type": "integer", "description": "b"}},
                   "required": ["a", "b"]}}}


def toolcall_preference(split: str = "train") -> Dataset:
    """``load_dataset("trl-internal-testing/toolcall", "preference", split=split)``, offline: a conversational
    preference dataset whose prompts hold a tool call and its result (``tools``: the tool schemas, as JSON text),
    the chosen answer reading the result and the rejected one contradicting it."""
    import json

    rows = []
    for i in range(10):
        if i % 2:
            call, result = {"name": "multiply", "arguments": {"a": i, "b": 3}}, str(3 * i)
            question, tools = f"What is {i} times 3?", [MULTIPLY_TOOL, WEATHER_TOOL]
            chosen, rejected = f"It is {3 * i}.", f"It is {3 * i + 1}."
        else:
            city = ["Paris", "Oslo", "Lima", "Rome", "Kyiv"][i // 2]
            call, result = {"name": "get_weather", "arguments": {"city": city}}, "sunny"
            question, tools = f"What is the weather in {city}?", [WEATHER_TOOL]
            chosen, rejected = "It is sunny.", "It is raining."
        rows.append({
            "prompt": [{"role": "user", "content": question},
                       {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]},
                       {"role": "tool", "name": call["name"], "content": result}],
            "chosen": _assistant(chosen), "rejected": _assistant(rejected), "tools": json.dumps(tools)})
    return Dataset.from_list(rows[:8] if split == "train" else rows[8:])


# A simplified Qwen chat template with an extra ``role_capital`` argument (TRL's test_train_with_chat_template_kwargs).
ROLE_CAPITAL_TEMPLATE = '{%- if messages[0]["role"] == "system" -%}    {{ "<|im_start|>" + ("SYSTEM" if role_capital else "system") + "\\n" + messages[0]["content"] + "<|im_end|>\\n" }}{%- else -%}    {{ "<|im_start|>" + ("SYSTEM" if role_capital else "system") + "\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n" }}{%- endif -%}{%- for message in messages -%}    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) -%}        {{ "<|im_start|>" + (message.role.upper() if role_capital else message.role) + "\\n" + message.content + "<|im_end|>\\n" }}    {%- elif message.role == "assistant" -%}        {{ "<|im_start|>" + ("ASSISTANT" if role_capital else "assistant") }}        {%- if message.content -%}            {{ "\\n" + message.content }}        {%- endif -%}        {{ "<|im_end|>\\n" }}    {%- elif message.role == "tool" -%}        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") -%}            {{ "<|im_start|>" + ("USER" if role_capital else "user") }}        {%- endif -%}        {{ "\\n<tool_response>\\n" + message.content + "\\n</tool_response>" }}        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") -%}            {{ "<|im_end|>\\n" }}        {%- endif -%}    {%- endif -%}{%- endfor -%}{%- if add_generation_prompt -%}    {{ "<|im_start|>" + ("ASSISTANT" if role_capital else "assistant") + "\\n" }}{%- endif -%}'


# ---------------------------------------------------------------------------- tiny Hub causal LMs, built offline

def _architecture(name: str, vocab_size: int, **ids):
    """The model of ``trl-internal-testing/tiny-<name>``, at the smallest useful size (``ids``: its special tokens'
    ids)."""
    import transformers as t

    small = dict(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, **ids)
    if name == "Qwen2ForCausalLM-2.5":
        return t.Qwen2ForCausalLM(t.Qwen2Config(intermediate_size=64, **small))
    if name == "Cohere2ForCausalLM":
        return t.Cohere2ForCausalLM(t.Cohere2Config(intermediate_size=64, sliding_window=64, **small))
    if name == "Glm4MoeForCausalLM":
        return t.Glm4MoeForCausalLM(t.Glm4MoeConfig(
            intermediate_size=64, moe_intermediate_size=16, n_routed_experts=4, n_shared_experts=1,
            num_experts_per_tok=2, first_k_dense_replace=1, n_group=1, topk_group=1, **small))
    if name == "GptOssForCausalLM":
        return t.GptOssForCausalLM(t.GptOssConfig(
            intermediate_size=32, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=64, **small))
    if name == "Qwen3MoeForCausalLM":
        return t.Qwen3MoeForCausalLM(t.Qwen3MoeConfig(
            intermediate_size=32, head_dim=16, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
            **small))
    if name == "NemotronHForCausalLM-nano":  # one Mamba-2 layer, one attention layer
        del small["num_hidden_layers"]
        return t.NemotronHForCausalLM(t.NemotronHConfig(
            layers_block_type=["mamba", "attention"], head_dim=16, intermediate_size=64, ssm_state_size=16,
            mamba_num_heads=4, mamba_head_dim=16, n_groups=1, chunk_size=16, **small))
    if name == "Olmo3ForCausalLM":
        return t.Olmo3ForCausalLM(t.Olmo3Config(intermediate_size=64, sliding_window=64, **small))
    if name in ("Lfm2ForCausalLM", "Lfm2ForCausalLM-2.5"):  # one short-convolution layer, one attention layer
        return t.Lfm2ForCausalLM(t.Lfm2Config(intermediate_size=64, layer_types=["conv", "full_attention"], **small))
    raise ValueError(f"no tiny offline twin of trl-internal-testing/tiny-{name}")


def save_tiny_causal_lm(path: str, name: str, seed: int = 0) -> str:
    """``trl-internal-testing/tiny-<name>`` offline: that architecture, randomly initialised at the smallest size
    (hidden 32, 2 layers), with the byte-level ChatML tokenizer of ``trainers.cli.tiny``, saved to ``path``."""
    import torch

    from trainers.cli.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    model = _architecture(name, len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                          pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.generation_config.bos_token_id = None
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


_REMOTE_CONFIGURATION = '''from transformers import Qwen2Config


class RemoteConfig(Qwen2Config):
    model_type = "remote"
'''
_REMOTE_MODELING = '''from transformers import Qwen2ForCausalLM

from .configuration_remote import RemoteConfig


class RemoteForCausalLM(Qwen2ForCausalLM):
    config_class = RemoteConfig
'''


def save_tiny_remote_model(path: str) -> str:
    """``trl-internal-testing/tiny-RemoteForCausalLM`` offline: a tiny causal LM whose code lives in its folder
    (``auto_map``), so loading it needs ``trust_remote_code=True``."""
    import json
    import os

    save_tiny_causal_lm(path, "Qwen2ForCausalLM-2.5")
    with open(os.path.join(path, "configuration_remote.py"), "w") as f:
        f.write(_REMOTE_CONFIGURATION)
    with open(os.path.join(path, "modeling_remote.py"), "w") as f:
        f.write(_REMOTE_MODELING)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config.update(model_type="remote", architectures=["RemoteForCausalLM"],
                  auto_map={"AutoConfig": "configuration_remote.RemoteConfig",
                            "AutoModelForCausalLM": "modeling_remote.RemoteForCausalLM"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return str(path)


# ------------------------------------------------------------------------------- TRL's repeated test blocks

def eval_dataset_of(eval_dataset_type: str, config: str):
    """TRL's if/elif chain of the eval-dataset cases: zen ``config``'s test split as a Dataset, an IterableDataset,
    a (Iterable)DatasetDict or a dict of either, named data1 and data2."""
    streaming = "iterable" in eval_dataset_type
    eval_split = zen_preference(config, split="test", streaming=streaming)
    if eval_dataset_type in ("dataset", "iterable_dataset"):
        return eval_split
    if eval_dataset_type in ("dataset_dict", "iterable_dataset_dict"):
        dataset_dict_cls = IterableDatasetDict if streaming else DatasetDict
        return dataset_dict_cls({"data1": eval_split, "data2": eval_split})
    return {"data1": eval_split, "data2": eval_split}  # "dict_of_dataset" or "dict_of_iterable_dataset"


def assert_all_changed(previous_trainable_params, trainer):
    """TRL's check after training: every parameter moved."""
    import torch

    for n, param in previous_trainable_params.items():
        new_param = trainer.model.get_parameter(n)
        assert not torch.equal(param, new_param), f"Parameter {n} has not changed."


def assert_peft_trained(previous_trainable_params, trainer, base_param_names, skip_ref=False):
    """TRL's check: the peft params have changed and the base model params have not."""
    import torch

    for n, param in previous_trainable_params.items():
        new_param = trainer.model.get_parameter(n)
        if n in base_param_names:  # We expect the base model params to be the same
            torch.testing.assert_close(param, new_param, msg=f"Parameter {n} has changed.")
        elif "base_layer" not in n and not (skip_ref and "ref" in n):  # the peft params to be different
            assert not torch.equal(param, new_param), f"Parameter {n} has not changed."


# ---------------------------------------------------------------------------------- the library under test

def fails_here(reason: str, **when):
    """Passes with TRL 1.16, fails with this package: a strict xfail for lib="trainers" only, for every
    parametrization or for those whose parameters match ``when`` (name=value, or name=(values, ...))."""

    def mark(function):
        function.__dict__.setdefault("_fails_here", []).append((reason, when))
        return function

    return mark


def _trl_cpu_config(trl, kind: str):
    """TRL's ``<kind>Config`` with ``use_cpu=True`` (TRL's bf16 default needs it on a machine without a bf16 GPU),
    defined once at module level (TRL pickles its args)."""
    name = f"CPU{kind}Config"
    if name not in globals():
        base = getattr(trl, f"{kind}Config")

        def __post_init__(self):
            self.use_cpu = True
            base.__post_init__(self)

        cls = type(name, (base,), {"__post_init__": __post_init__, "__module__": __name__, "__qualname__": name})
        globals()[name] = cls
    return globals()[name]


def lib_fixture(kind: str):
    """The ``lib`` fixture of a ported TRL test module for ``<kind>Config`` / ``<kind>Trainer`` (kind: "DPO",
    "KTO", ...): this package's, or TRL's where ``import trl`` works (with ``use_cpu=True`` without a bf16 GPU,
    its default config included). A case marked ``fails_here`` is a strict xfail for lib="trainers"."""
    import importlib

    import pytest

    @pytest.fixture(params=["trainers", "trl"])
    def lib(request, monkeypatch):
        from types import SimpleNamespace

        if request.param == "trainers":
            import trainers

            params = getattr(request.node, "callspec", None)
            params = params.params if params is not None else {}
            for reason, when in getattr(request.function, "_fails_here", []):
                if all(params.get(k) in (v if isinstance(v, tuple) else (v,)) for k, v in when.items()):
                    request.applymarker(pytest.mark.xfail(reason=reason, strict=True))
            yield SimpleNamespace(name="trainers", **{f"{kind}Config": getattr(trainers, f"{kind}Config"),
                                                      f"{kind}Trainer": getattr(trainers, f"{kind}Trainer")})
            return
        trl = pytest.importorskip("trl")
        config = getattr(trl, f"{kind}Config")
        from transformers.utils import is_torch_bf16_gpu_available

        if not is_torch_bf16_gpu_available():
            config = _trl_cpu_config(trl, kind)
            module = importlib.import_module(f"trl.trainer.{kind.lower()}_trainer")
            monkeypatch.setattr(module, f"{kind}Config", config)
        yield SimpleNamespace(name="trl", **{f"{kind}Config": config, f"{kind}Trainer": getattr(trl, f"{kind}Trainer")})
        # transformers' TrainingArguments resets Accelerate's process-wide state for each TRL trainer: the next
        # case (this package's trainer, another mixed precision) starts from a clean state too
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=True)

    return lib


class TinyHub:
    """The tiny ``trl-internal-testing`` models TRL's cases name, built offline into ``root`` on first use:
    ``hub["trl-internal-testing/tiny-Qwen2ForCausalLM-2.5"]`` is the folder of a tiny Qwen2 (see
    ``save_tiny_causal_lm``; ``tiny-RemoteForCausalLM``: ``save_tiny_remote_model``)."""

    def __init__(self, root):
        self.root, self.built = str(root), {}

    def __getitem__(self, model_id: str) -> str:
        if model_id not in self.built:
            import os

            name = model_id.removeprefix("trl-internal-testing/tiny-")
            path = os.path.join(self.root, name)
            if name == "RemoteForCausalLM":
                self.built[model_id] = save_tiny_remote_model(path)
            else:
                self.built[model_id] = save_tiny_causal_lm(path, name)
        return self.built[model_id]
