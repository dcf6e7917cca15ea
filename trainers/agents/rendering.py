"""Tools as the chat template sees them: their JSON schemas (``tool_schemas``), a toolbox by name (``toolbox``),
the template's check before training (``check_tool_template``), and the tokens of a tool turn appended to the
model's own (``tool_turn_ids``). Every rendering goes through the one renderer, ``trainers.data.formats.chat_ids``."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from trainers.agents.runner import ToolResult
from trainers.data.formats import chat_ids
from trainers.errors import ConfigError

_TEMPLATE_FIX = ("Give the tokenizer a chat template that renders tools, e.g. Qwen2.5's "
                 "(trainers.cli.tiny.TOOLS_CHAT_TEMPLATE for the tiny offline tokenizers)")


def _name_of(tool: Any) -> str:
    if not callable(tool):
        raise ConfigError(f"tools: {tool!r} is not callable; a tool is a function (or an environment's method)")
    name = getattr(tool, "__name__", None)
    if not isinstance(name, str):
        raise ConfigError(f"tools: {tool!r} has no __name__; a tool is a function (the model calls it by name)")
    return name


def tool_schemas(tools: list[Callable]) -> list[dict]:
    """The JSON schemas the chat template renders into the prompt, built exactly as transformers does
    (``get_json_schema``: type hints and a Google-style docstring), so the model sees what it sees under TRL."""
    from transformers.utils import get_json_schema

    schemas = []
    for tool in tools:
        name = _name_of(tool)
        try:
            schemas.append(get_json_schema(tool))
        except Exception as error:  # transformers' own exceptions, reworded
            raise ConfigError(f"tools: cannot describe {name} to the model: {error}. A tool needs a type hint on "
                              f"every argument and a Google-style docstring with an Args: entry for each") from error
    return schemas


def toolbox(tools: list[Callable]) -> dict[str, Callable]:
    """The tools by name: the model calls a tool by its ``__name__``, so two tools of one name are an error."""
    box: dict[str, Callable] = {}
    for tool in tools:
        name = _name_of(tool)
        if name in box:
            raise ConfigError(f"tools: two tools are named {name!r}; the model calls a tool by name, so tool "
                              f"names (functions and environment methods) must be unique")
        box[name] = tool
    return box


def _suffix_ids(tokenizer, tool_messages: list[dict], kwargs: Mapping) -> list[int] | None:
    """TRL's ``_get_tool_suffix_ids``: render a dummy exchange with and without the tool turn (and the next
    assistant header), trim the shorter at its last EOS (templates add "\\n" after it), and return what the tool
    turn adds; None when the shorter rendering is not a prefix of the longer (not prefix-preserving)."""
    call = {"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}
    exchange = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    prefix = chat_ids(tokenizer, exchange, False, **kwargs)
    full = chat_ids(tokenizer, exchange + tool_messages, True, **kwargs)
    eos = [i for i, token in enumerate(prefix) if token == tokenizer.eos_token_id]
    prefix = prefix[:eos[-1] + 1] if eos else prefix
    return full[len(prefix):] if full[:len(prefix)] == prefix else None


def check_tool_template(tokenizer, chat_template_kwargs: dict | None) -> None:
    """Before training: the chat template must render a whole tool exchange (user -> assistant with tool_calls ->
    tool: the tool's name, an argument's key and value, the tool's answer all appear) and be prefix-preserving
    (``tool_turn_ids`` appends a tool turn's tokens to the model's own). TRL's ``supports_tool_calling`` and
    ``is_chat_template_prefix_preserving``."""
    kwargs = dict(chat_template_kwargs or {})
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"tools: the tokenizer has no chat template. {_TEMPLATE_FIX}.")
    parts = {"tool name": "tool_name_a8f3", "argument key": "arg_key_b9d4", "argument value": "arg_value_d6e7",
             "tool result": "tool_content_c4f9"}
    call = {"type": "function", "function": {"name": parts["tool name"],
                                             "arguments": {parts["argument key"]: parts["argument value"]}}}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "name": parts["tool name"], "content": parts["tool result"]}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
        suffix = _suffix_ids(tokenizer, messages[2:], kwargs)
    except Exception as error:  # any failure to render: the template's problem
        raise ConfigError(f"tools: the tokenizer's chat template cannot render a tool conversation (user -> "
                          f"assistant with tool_calls -> tool): {type(error).__name__}: {error}. "
                          f"{_TEMPLATE_FIX}.") from error
    dropped = [part for part, sentinel in parts.items() if sentinel not in text]
    if dropped:
        raise ConfigError(f"tools: the tokenizer's chat template does not render tool calls: a tool conversation "
                          f"loses its {', '.join(dropped)}. {_TEMPLATE_FIX}.")
    if suffix is None:
        raise ConfigError(f"tools: the tokenizer's chat template is not prefix-preserving: an assistant turn with "
                          f"tool calls renders differently once a tool result follows it, so the tool turn's tokens "
                          f"cannot be appended to the model's. {_TEMPLATE_FIX}.")


def tool_turn_ids(tokenizer, results: list[ToolResult], chat_template_kwargs: dict | None) -> list[int]:
    """The template's tokens for a tool turn holding ``results`` (in order) and the next assistant header: what
    follows the model's EOS before it writes again."""
    if not results:
        raise ValueError("tool_turn_ids: no results")
    messages = [{"role": "tool", "name": result.name, "content": result.content} for result in results]
    suffix = _suffix_ids(tokenizer, messages, dict(chat_template_kwargs or {}))
    if suffix is None:
        raise ConfigError(f"tools: the tokenizer's chat template is not prefix-preserving for a tool turn of "
                          f"{[result.name for result in results]}. {_TEMPLATE_FIX}.")
    return suffix
