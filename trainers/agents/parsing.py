"""Parsing what a model wrote in a turn into tool calls (``parse_turn``): transformers' response-schema parser where
the tokenizer has one, else the Hermes ``<tool_call>{json}</tool_call>`` blocks TRL's templates render. Model output
never raises: a block that cannot be parsed is counted (``Turn.malformed``) and its text kept."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    """One call the model wrote."""
    name: str
    arguments: dict


@dataclass(frozen=True)
class Turn:
    """One assistant turn the model wrote, parsed. ``message`` is TRL's form: ``{"role": "assistant", "content":
    str}`` plus ``"tool_calls": [{"type": "function", "function": {"name", "arguments"}}]`` when it has calls (only
    the valid ones, so the chat template can render it back). ``malformed`` counts the tool-call blocks that could
    not be parsed (bad JSON, no ``"name"`` string, arguments not an object, cut off by the length limit)."""
    message: dict
    calls: tuple[ToolCall, ...]
    malformed: int


def _valid_call(raw: Any) -> ToolCall | None:
    """A parsed call (``{"type": "function", "function": {...}}`` or flat ``{name, arguments}``), or None when it
    is unusable. Missing arguments are ``{}`` (templates omit them for calls without arguments); arguments written
    as a JSON string are decoded."""
    function = raw.get("function", raw) if isinstance(raw, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        return None
    arguments = {} if function.get("arguments") is None else function["arguments"]
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    return ToolCall(function["name"], arguments) if isinstance(arguments, dict) else None


def _message(content: str, calls: Sequence[ToolCall], extra: Mapping | None = None) -> dict:
    message = {**(extra or {}), "role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                 for c in calls]
    return message


def _opening_pattern(response_template: Mapping) -> re.Pattern | None:
    """How the response template opens a tool call (to count the blocks the parser lost), or None."""
    field = (response_template.get("fields") or {}).get("tool_calls") or {}
    literals = [field["open"]] if isinstance(field.get("open"), str) else field.get("open") or []
    try:
        return re.compile("|".join(map(re.escape, literals)) or field["open_pattern"], re.DOTALL)
    except (KeyError, TypeError, re.error):
        return None


def _parse_with_transformers(tokenizer, completion_ids, prefix_ids, tools) -> Turn:
    """transformers' parser raises on a bad block (the whole turn is then content, as in TRL) or may drop one:
    either way the ``<tool_call>`` openings in the text that did not become a valid call are counted."""
    template = getattr(tokenizer, "response_template", None)
    pattern = _opening_pattern(template) if template is not None else re.compile(re.escape("<tool_call>"))
    openings = len(pattern.findall(tokenizer.decode(completion_ids))) if pattern is not None else 0
    try:
        if template is not None:
            parsed = tokenizer.parse_response(completion_ids, prefix=prefix_ids or [], tools=tools or None)
        else:  # the legacy ``response_schema`` parser takes neither
            parsed = tokenizer.parse_response(completion_ids)
    except Exception:  # noqa: BLE001 - the model's output, whatever it is, must not stop training
        parsed = None
    if not isinstance(parsed, dict):
        return Turn(_message(tokenizer.decode(completion_ids, skip_special_tokens=True), ()), (), openings)
    extra = dict(parsed)
    raw_calls = extra.pop("tool_calls", None)
    raw_calls = raw_calls if isinstance(raw_calls, list) else []
    calls = tuple(call for call in map(_valid_call, raw_calls) if call is not None)
    content = extra.pop("content", None)
    content = content.removesuffix(tokenizer.eos_token or "") if isinstance(content, str) else ""
    malformed = max(openings - len(calls), len(raw_calls) - len(calls), 0)
    return Turn(_message(content, calls, extra), calls, malformed)


_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)(</tool_call>|\Z)", re.DOTALL)


def _json_call(body: str) -> ToolCall | None:
    try:
        return _valid_call(json.loads(body))
    except ValueError:
        return None


def _parse_hermes(tokenizer, completion_ids) -> Turn:
    """The Qwen/Hermes form: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, each parsed on
    its own (a bad or unclosed block is counted, the good ones still run). When every block is a call, the text
    outside them is the content; a block that is not one (bad JSON, cut off by the length limit) stays in the
    content as the model wrote it, so the reward functions see it (TRL: a turn its parser cannot read is its
    text, ``"<tool_call>\\n{\\"name\\": \\"mul"`` for a call cut off)."""
    text = tokenizer.decode(completion_ids)
    text = text.split(tokenizer.eos_token)[0] if tokenizer.eos_token else text
    found = [_json_call(match[1]) if match[2] else None for match in _HERMES_BLOCK.finditer(text)]
    calls = tuple(call for call in found if call is not None)
    if len(calls) == len(found):
        return Turn(_message(_HERMES_BLOCK.sub("", text).strip(), calls), calls, 0)
    # only the blocks that became calls leave the content (they are its tool_calls)
    content = _HERMES_BLOCK.sub(lambda match: "" if match[2] and _json_call(match[1]) else match[0], text)
    return Turn(_message(content, calls), calls, len(found) - len(calls))


def _renders_hermes(tokenizer) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    templates = template.values() if isinstance(template, dict) else [template]
    return any(isinstance(t, str) and "<tool_call>" in t for t in templates)


def parse_turn(tokenizer, completion_ids: list[int], prefix_ids: list[int] | None, tools: list) -> Turn:
    """Parse one assistant turn: with the tokenizer's ``response_template`` (transformers' ``parse_response``,
    given the prompt ``prefix_ids`` and the ``tools``, which type the arguments) or legacy ``response_schema``;
    else, when the chat template renders ``<tool_call>``, the Hermes form from the text; else the text is the
    content. Never raises on model output."""
    completion_ids = list(completion_ids)
    if not completion_ids:
        return Turn(_message("", ()), (), 0)
    if getattr(tokenizer, "response_template", None) is not None or \
            getattr(tokenizer, "response_schema", None) is not None:
        return _parse_with_transformers(tokenizer, completion_ids, prefix_ids, tools)
    if _renders_hermes(tokenizer):
        return _parse_hermes(tokenizer, completion_ids)
    return Turn(_message(tokenizer.decode(completion_ids, skip_special_tokens=True), ()), (), 0)
