"""Datasets in general, for every trainer: data files, conversations (checked), the one chat renderer
(``render_chat`` to text, ``chat_ids`` to tokens, a row's own template arguments ``row_chat_kwargs``), and any
dataset form as a ``datasets.Dataset``. What a trainer makes of its rows is its own (SFT:
trainers/sft/tokenize.py; DPO: trainers/dpo/data.py; prompts for sampling: trainers/generation/prompts.py)."""

from __future__ import annotations

import json
from typing import Any

from trainers.errors import DatasetFormatError, DatasetTypeError

DATA_FILE_KINDS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def load_dataset_file(path: str, option: str = "--dataset"):
    """A local .json/.jsonl/.parquet/.csv file as a ``datasets.Dataset`` (errors name the option and path)."""
    import os

    from datasets import load_dataset

    if not os.path.isfile(path):
        raise DatasetFormatError(f"{option} '{path}' does not exist.")
    ext = os.path.splitext(path)[1].lower()
    if ext not in DATA_FILE_KINDS:
        raise DatasetFormatError(f"{option} '{path}': unsupported extension {ext!r}; use one of {sorted(DATA_FILE_KINDS)}.")
    return load_dataset(DATA_FILE_KINDS[ext], data_files=path)["train"]


def is_conversational(value: Any) -> bool:
    """True for a list of {'role', 'content'} messages."""
    return isinstance(value, list) and len(value) > 0 and isinstance(value[0], dict) and "role" in value[0]


def check_messages(value: Any, where: str) -> None:
    """A conversation must be a non-empty list of {'role': str, 'content': str} dicts (an assistant message
    that calls tools may carry 'tool_calls' and no content)."""
    if not isinstance(value, list) or not value:
        raise DatasetFormatError(f"{where} must be a non-empty list of {{'role', 'content'}} messages, got {value!r:.80}.")
    for i, message in enumerate(value):
        calls_tools = isinstance(message, dict) and isinstance(message.get("tool_calls"), list) \
            and message.get("content") is None
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and (isinstance(message.get("content"), str) or calls_tools)):
            raise DatasetFormatError(f"{where}: message {i} must be a dict with string 'role' and 'content' (or "
                                     f"'tool_calls'), got {message!r:.80}.")


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = False, **kwargs) -> str:
    """The conversation as text through the tokenizer's chat template (errors name the fix)."""
    if not getattr(tokenizer, "chat_template", None):
        raise DatasetFormatError(
            "The data is conversational (lists of messages) but the tokenizer has no chat template. Set one with "
            "`tokenizer.chat_template = ...`, or SFTConfig(chat_template_path=...)."
        )
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             **kwargs)
    except Exception as error:  # a template's own checks (e.g. "roles must alternate") or Jinja errors
        raise DatasetFormatError(f"The chat template could not render a conversation: {error} "
                                 f"(first message: {messages[0]!r:.80}).") from error


def as_dataset(data, name: str):
    """A ``datasets.Dataset`` from a Dataset, a list of dicts, or a stream (an IterableDataset, read whole: for
    evaluation, whose streams are finite); refuses empty data and a dict of splits."""
    from datasets import Dataset, DatasetDict, IterableDataset, IterableDatasetDict

    if isinstance(data, (DatasetDict, IterableDatasetDict)):
        raise DatasetTypeError(f"`{name}` must be a `Dataset` or `IterableDataset`, got `{type(data).__name__}` (of "
                               f"splits {sorted(data)}); pass one split, e.g. "
                               f"{name}=dataset[{next(iter(data), 'train')!r}].")
    if isinstance(data, IterableDataset):
        data = read_stream(data, name)
    if isinstance(data, list):
        if not data:
            raise DatasetFormatError(f"{name} is empty.")
        if not all(isinstance(row, dict) for row in data):
            raise DatasetFormatError(f"{name} must be a list of dicts (one per row).")
        # Dataset.from_list takes its columns from the first row, silently dropping a key that only later rows
        # have; every key any row has becomes a column instead, None where a row lacks it (as JSON files load)
        columns = list(dict.fromkeys(key for row in data for key in row))
        if any(len(row) != len(columns) for row in data):
            data = [{key: row.get(key) for key in columns} for row in data]
        try:
            data = Dataset.from_list(data)
        except Exception as error:  # pyarrow refuses columns whose values have mixed types
            raise DatasetFormatError(f"{name} could not be turned into a dataset: {error}. Each column must hold "
                                     f"values of one type.") from error
    if not isinstance(data, Dataset):
        raise DatasetFormatError(f"{name} must be a datasets.Dataset or a list of dicts, got {type(data).__name__}.")
    if len(data) == 0:
        raise DatasetFormatError(f"{name} is empty.")
    return data


def chat_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = False, **kwargs) -> list[int]:
    """The conversation's token ids: the one renderer of a conversation to tokens (prompts, tool turns, the tool
    loop's prompts). Rendered as text (``render_chat``), then tokenized without special tokens: the template
    writes its own, as ``apply_chat_template(tokenize=True)`` does."""
    text = render_chat(tokenizer, messages, add_generation_prompt=add_generation_prompt, **kwargs)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def row_chat_kwargs(row: dict) -> dict:
    """A row's own ``apply_chat_template`` arguments, as in TRL: a 'tools' column (a list, or JSON text) and a
    'chat_template_kwargs' column (a dict)."""
    kwargs = {}
    tools = row.get("tools")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as error:
            raise DatasetFormatError(f"Column 'tools' holds text that is not JSON: {error} ({tools!r:.80}).") from error
    if tools is not None:
        kwargs["tools"] = tools
    extra = row.get("chat_template_kwargs")
    if extra is not None:
        if not isinstance(extra, dict):
            raise DatasetFormatError(f"Column 'chat_template_kwargs' must hold dicts, got {type(extra).__name__}.")
        kwargs.update(extra)
    return kwargs


def read_stream(stream, name: str) -> list[dict]:
    """Every row of a finite stream (an IterableDataset), read once, in order."""
    rows = list(stream)
    if not rows:
        raise DatasetFormatError(f"{name} is empty: the stream gave no rows.")
    return rows
