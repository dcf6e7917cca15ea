"""Tiny models and tokenizers built offline, for the demo, the tests and the benchmarks.

Nothing here touches the network: the tokenizer is byte-level with no merges (one token per byte, so it
encodes any text) plus ChatML's special tokens and chat template, and the model is a randomly initialised
Qwen2 built from a config. Saved with ``save_pretrained``, a tiny model's folder works exactly as a Hub id.
"""

from __future__ import annotations

import copy
import os
import tempfile

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# ChatML with tools in Qwen2.5's Hermes form (a system turn listing the tools as JSON, <tool_call> blocks in the
# assistant turn, consecutive tool results as one user turn of <tool_response> blocks), but with a short system
# block: a tiny byte-level model pays one token per character of it on every prompt. Prefix-preserving (a turn
# renders the same whatever follows it), so the tool loop can append a tool turn's tokens to what the model wrote.
TOOLS_CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\n\n' }}{%- endif %}"
    "{{- '# Tools\n<tools>' }}"
    "{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\n</tools>\nCall a tool with <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call><|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first and tools %}"
    "{%- elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{- '<|im_start|>assistant\n' + (message['content'] or '') }}"
    "{%- for call in message['tool_calls'] %}"
    "{%- if call.get('function') is not none %}{%- set call = call['function'] %}{%- endif %}"
    "{{- '<tool_call>\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' }}"
    "{{- (call['arguments'] | tojson) + '}\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)

# transformers' response template (``tokenizer.parse_response``, transformers >= 5.13) for TOOLS_CHAT_TEMPLATE:
# TRL's ``qwen3_template`` without its <think> field. Each <tool_call> block's JSON becomes one
# ``{"type": "function", "function": {...}}`` entry of ``tool_calls``; the rest, up to <|im_end|>, is the content.
TOOLS_RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {
            "open": "<tool_call>",
            "close_pattern": r"</tool_call>\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}


def _set_templates(tokenizer, chat_template: bool, tools: bool) -> None:
    """``tools`` wins: it asks for a chat template that renders tools, and the parser of its tool calls."""
    if tools:
        tokenizer.chat_template = TOOLS_CHAT_TEMPLATE
        tokenizer.response_template = copy.deepcopy(TOOLS_RESPONSE_TEMPLATE)
    elif chat_template:
        tokenizer.chat_template = CHATML_TEMPLATE


def build_tokenizer(chat_template: bool = True, tools: bool = False):
    """A byte-level tokenizer (vocabulary: 256 bytes + 3 ChatML specials = 259 tokens). ``tools=True`` gives it
    TOOLS_CHAT_TEMPLATE and TOOLS_RESPONSE_TEMPLATE (both saved by ``save_pretrained``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {char: i for i, char in enumerate(bytes_to_unicode().values())}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    _set_templates(tokenizer, chat_template, tools)
    return tokenizer


def build_model(vocab_size: int, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                num_kv_heads: int = 2, intermediate_size: int | None = None, max_position_embeddings: int = 2048,
                tie_word_embeddings: bool = True, seed: int = 0, **config_kwargs):
    """A randomly initialised Qwen2 causal LM of the given shape (float32)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size or 4 * hidden_size, max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings, **config_kwargs,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


def save_tiny_model(path: str, tokenizer=None, vocab_size: int | None = None, **model_kwargs) -> str:
    """Build a tiny model (and a byte-level tokenizer unless one is given) and save both to ``path``.

    ``vocab_size`` defaults to the tokenizer's; a larger one gives a real model's embedding and output-head
    shape (ids the tokenizer lacks decode to nothing)."""
    tokenizer = tokenizer or build_tokenizer()
    if vocab_size is not None and vocab_size < len(tokenizer):
        raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer's {len(tokenizer)} tokens")
    model = build_model(vocab_size=vocab_size or len(tokenizer), **model_kwargs)
    model.config.eos_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    model.config.bos_token_id = None
    if model.generation_config is not None:
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.generation_config.bos_token_id = None
    # Every process of a launch builds the embedded default into the same folder, and one may already be reading
    # it while another writes: write into a private folder, then move each file into place (os.replace is
    # atomic), so a reader sees a whole file, old or new. The build is deterministic, so old and new are equal.
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(path, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=parent, prefix=".tiny-model-") as staging:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        for name in os.listdir(staging):
            os.replace(os.path.join(staging, name), os.path.join(path, name))
    return path


# ----------------------------------------------------------------------------------------------------------------
# Toy tasks: generated datasets that a tiny model can learn in seconds on a CPU.
# ----------------------------------------------------------------------------------------------------------------


def reverse_digits_rows(n: int, length: int = 5, seed: int = 0) -> list[dict]:
    """``{"prompt": "12345=", "answer": "54321"}`` rows: reverse a string of digits."""
    import random

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        digits = "".join(rng.choice("0123456789") for _ in range(length))
        rows.append({"prompt": digits + "=", "answer": digits[::-1]})
    return rows


def as_sft_rows(rows: list[dict]) -> list[dict]:
    """Prompt/answer rows -> SFT prompt/completion rows (the completion is the answer; EOS is appended)."""
    return [{"prompt": r["prompt"], "completion": r["answer"]} for r in rows]


def as_preference_rows(rows: list[dict]) -> list[dict]:
    """Prompt/answer rows -> DPO preference rows: the answer chosen, the digits copied unreversed rejected."""
    return [{"prompt": r["prompt"], "chosen": r["answer"], "rejected": r["prompt"].rstrip("=")} for r in rows]


def build_bpe_tokenizer(vocab_size: int = 8192, seed: int = 0, tools: bool = False):
    """A byte-level BPE of ``vocab_size`` tokens trained offline on synthetic words (benchmarks: logits then cost
    what they would with a real vocabulary), with ChatML's specials and chat template (``tools=True``: the
    tool-capable one and its response template, as ``build_tokenizer``)."""
    import random

    from tokenizers import pre_tokenizers

    rng = random.Random(seed)
    syllables = [a + b for a in "bcdfghjklmnprstvwz" for b in "aeiou"] + list("aeiou")
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(20000)]
    corpus = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(4000)]
    return _trained_bpe(pre_tokenizers.ByteLevel(add_prefix_space=False), None, corpus, vocab_size, tools)


def build_task_tokenizer(texts: list[str], vocab_size: int = 1024, tools: bool = False):
    """A byte-level BPE of at most ``vocab_size`` tokens trained on a task's own (rendered) texts, with ChatML's
    specials and chat template (``tools=True``: the tool-capable one and its response template).

    Its words are whole tokens (a tool schema's keys, "multiply", "answer"), so a tiny model's sequences are
    several times shorter than ``build_tokenizer``'s one token per byte, while digits stay one token each and
    no token goes on past a line end or across a special token (a turn's header and its content never share a
    token). It splits text exactly as Qwen2's tokenizer does (``Qwen2Tokenizer``'s pre-tokenizer and
    normalizer): loading a saved tiny Qwen2's folder, transformers' AutoTokenizer puts those back whatever the
    file says, so a tokenizer split any other way would tokenize differently once reloaded."""
    import re

    from tokenizers import normalizers
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

    specials = re.compile("|".join(re.escape(token) for token in SPECIAL_TOKENS))
    pieces = (piece for text in texts for piece in specials.split(text) if piece)
    qwen2_split = Qwen2Tokenizer()._tokenizer.pre_tokenizer  # an empty Qwen2 tokenizer's
    return _trained_bpe(qwen2_split, normalizers.NFC(), pieces, vocab_size, tools, min_frequency=2)


def _trained_bpe(pre_tokenizer, normalizer, corpus, vocab_size: int, tools: bool, min_frequency: int = 0):
    """A byte-level BPE trained on ``corpus`` (strings) with this pre-tokenizer and normalizer, wrapped with
    ChatML's specials (EOS <|im_end|>, padding <|endoftext|>) and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    if normalizer is not None:
        backend.normalizer = normalizer
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, min_frequency=min_frequency,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        additional_special_tokens=["<|im_start|>"])
    _set_templates(tokenizer, True, tools)
    return tokenizer


# ----------------------------------------------------------------------------------------------------------------
# The embedded default run: what `examples/*.py` and `trainers sft|grpo` do when no model is given.
# ----------------------------------------------------------------------------------------------------------------

EMBEDDED_DEFAULTS = {
    "sft": {"output_dir": "outputs/sft-tiny", "per_device_train_batch_size": 32, "learning_rate": 3e-3,
            "max_steps": 150, "logging_steps": 25, "save_strategy": "no", "lr_scheduler_type": "cosine",
            "warmup_steps": 10},
    # a random tiny model: expect a low (but working) reward
    "grpo": {"output_dir": "outputs/grpo-tiny", "per_device_train_batch_size": 16, "num_generations": 8,
             "max_completion_length": 8, "learning_rate": 1e-3, "max_steps": 20, "logging_steps": 5,
             "save_strategy": "no"},
    "rloo": {"output_dir": "outputs/rloo-tiny", "per_device_train_batch_size": 16, "num_generations": 4,
             "max_completion_length": 8, "learning_rate": 1e-3, "max_steps": 20, "logging_steps": 5,
             "save_strategy": "no"},
    # a random tiny student and a random, wider teacher (built too): the divergence falls
    "distill": {"output_dir": "outputs/distill-tiny", "per_device_train_batch_size": 16, "max_completion_length": 8,
                "learning_rate": 1e-3, "max_steps": 20, "logging_steps": 5, "save_strategy": "no", "beta": 0.0},
    "dpo": {"output_dir": "outputs/dpo-tiny", "per_device_train_batch_size": 16, "learning_rate": 3e-3,
            "max_steps": 40, "logging_steps": 10, "save_strategy": "no"},
    "reward": {"output_dir": "outputs/reward-tiny", "per_device_train_batch_size": 16, "learning_rate": 1e-3,
               "max_steps": 40, "logging_steps": 10, "save_strategy": "no"},
    "kto": {"output_dir": "outputs/kto-tiny", "per_device_train_batch_size": 16, "learning_rate": 3e-3,
            "max_steps": 40, "logging_steps": 10, "save_strategy": "no"},
}
EMBEDDED_MODELS = {"sft": {"hidden_size": 128, "num_layers": 4}, "grpo": {"hidden_size": 64, "num_layers": 2},
                   "rloo": {"hidden_size": 64, "num_layers": 2}, "distill": {"hidden_size": 64, "num_layers": 2},
                   "dpo": {"hidden_size": 64, "num_layers": 2}, "reward": {"hidden_size": 64, "num_layers": 2},
                   "kto": {"hidden_size": 64, "num_layers": 2}}


def embedded_default(method: str, overrides: dict) -> tuple[str, dict]:
    """A tiny model built offline under the run's output_dir, and the config fields of the embedded default
    (``overrides`` win). Returns (model path, config fields)."""
    fields = {**EMBEDDED_DEFAULTS[method], **overrides}
    model = save_tiny_model(os.path.join(fields["output_dir"], "tiny-model"), **EMBEDDED_MODELS[method])
    if method == "distill" and not (fields.get("teacher_model_name_or_path") or fields.get("teacher_model_server_url")):
        fields["teacher_model_name_or_path"] = save_tiny_model(os.path.join(fields["output_dir"], "tiny-teacher"),
                                                               hidden_size=128, num_layers=2)
    return model, fields


def embedded_rows(method: str) -> list[dict]:
    """The embedded default's training rows: digit reversal (SFT pairs, GRPO prompts with answers, DPO and
    reward-model preferences of the reversal over a copy, KTO's: the reversal desirable, the copy not; distillation's
    prompts with the reversal as their completion)."""
    if method in ("dpo", "reward"):
        return as_preference_rows(reverse_digits_rows(512, seed=1))
    if method == "kto":
        return [{"prompt": row["prompt"], "completion": row[side], "label": side == "chosen"}
                for row in as_preference_rows(reverse_digits_rows(256, seed=1)) for side in ("chosen", "rejected")]
    if method == "distill":  # prompts with a completion each: lmbda < 1 trains some rounds on them
        return as_sft_rows(reverse_digits_rows(256, seed=1))
    return as_sft_rows(reverse_digits_rows(2000, seed=1)) if method == "sft" else reverse_digits_rows(256, seed=1)
