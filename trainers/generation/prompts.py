"""Prompt datasets for the trainers that sample: each row's ``prompt`` (a string, or messages rendered with the
chat template and its generation prompt) as token ids, checked row by row (``tokenize_prompts``), and a prompt as
a round holds it (``PromptRow``)."""

from __future__ import annotations

from typing import NamedTuple

from trainers.data.formats import as_dataset, chat_ids, check_messages
from trainers.errors import DatasetFormatError


class PromptRow(NamedTuple):
    """A training prompt of a trainer that samples: the dataset row (what reward functions get) and its
    prompt's token ids."""

    row: dict
    ids: list[int]


def tokenize_prompts(dataset, name: str, tokenizer, chat_template_kwargs: dict | None = None
                     ) -> tuple[list[dict], list[list[int]]]:
    """A prompt dataset (a 'prompt' column: a string, or a list of messages rendered with the chat template and
    its generation prompt) -> (its rows, each prompt's token ids). Errors name the dataset and the row."""
    dataset = as_dataset(dataset, name)
    if "prompt" not in dataset.column_names:
        raise DatasetFormatError(f"{name} has columns {dataset.column_names}; GRPO needs a 'prompt' column "
                                 f"(a string, or a list of {{'role', 'content'}} messages).")
    rows = dataset.to_list()
    return rows, tokenize_prompt_rows(rows, name, tokenizer, chat_template_kwargs)


def tokenize_prompt_rows(rows: list[dict], name: str, tokenizer, chat_template_kwargs: dict | None = None,
                         first_index: int = 0) -> list[list[int]]:
    """Each row's prompt as token ids (``tokenize_prompts``); rows are counted from ``first_index`` in errors (a
    chunk of a stream)."""
    kwargs = dict(chat_template_kwargs or {})
    ids = []
    for index, row in enumerate(rows, start=first_index):
        if "prompt" not in row:
            raise DatasetFormatError(f"{name} row {index} has columns {sorted(row)}; GRPO needs a 'prompt' column "
                                     f"(a string, or a list of {{'role', 'content'}} messages).")
        prompt = row["prompt"]
        if isinstance(prompt, list):
            check_messages(prompt, f"{name} row {index}: 'prompt'")
            ids.append(chat_ids(tokenizer, prompt, add_generation_prompt=True, **kwargs))
        elif isinstance(prompt, str):
            ids.append(tokenizer(prompt)["input_ids"])
        else:
            raise DatasetFormatError(f"{name} row {index}: 'prompt' must be a string or a list of messages, "
                                     f"got {type(prompt).__name__}.")
        if not ids[-1]:
            raise DatasetFormatError(f"{name} row {index}: the prompt is empty.")
    return ids
