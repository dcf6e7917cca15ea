"""SFT rows -> token sequences: the dataset formats, loss masks, truncation, shifted targets and the collator
(packing: trainers/sft/packing.py)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from trainers.data.formats import check_messages, is_conversational, render_chat, row_chat_kwargs
from trainers.errors import DatasetFormatError
from trainers.logs import logger

IGNORE = -100


FORMATS = {
    "language_modeling": "a text column (dataset_text_field, 'text' by default)",
    "conversational": "a 'messages' column (a list of {'role', 'content'} dicts; ShareGPT's 'conversations' of "
                      "{'from', 'value'} dicts too)",
    "prompt_completion": "'prompt' and 'completion' columns (strings, or lists of messages)",
    "tokenized": "an 'input_ids' column (optionally 'labels' or 'completion_mask')",
}


def detect_format(columns: Sequence[str], text_field: str = "text", name: str = "The SFT dataset") -> str:
    """Which SFT format a dataset (called ``name`` in errors) is in, judged by its columns."""
    columns = set(columns)
    if "input_ids" in columns:
        return "tokenized"
    if "messages" in columns or "conversations" in columns:
        return "conversational"
    if {"prompt", "completion"} <= columns:
        return "prompt_completion"
    if text_field in columns:
        return "language_modeling"
    known = "; ".join(f"{k}: {v}" for k, v in FORMATS.items())
    raise DatasetFormatError(
        f"{name} has columns {sorted(columns)}, none of the known SFT formats. Expected one of: {known}."
    )


SHAREGPT_ROLES = {"human": "user", "gpt": "assistant"}  # ShareGPT's role names -> the chat templates' names


def from_sharegpt(messages: Any) -> Any:
    """ShareGPT messages (``{"from": "human", "value": ...}``) as ``{"role": "user", "content": ...}``: TRL's
    maybe_convert_to_chatml renames the keys; the roles human/gpt are also renamed user/assistant (as Unsloth's
    standardize_sharegpt does), since chat templates and assistant_only_loss know only those. Other values are
    returned unchanged."""
    if not isinstance(messages, list):
        return messages
    converted = []
    for message in messages:
        if isinstance(message, dict) and ("from" in message or "value" in message):
            message = dict(message)
            if "from" in message:
                role = message.pop("from")
                message["role"] = SHAREGPT_ROLES.get(role, role)
            if "value" in message:
                message["content"] = message.pop("value")
        converted.append(message)
    return converted


def check_token_ids(ids: Any, where: str, allow_ignore: bool = False) -> list[int]:
    """A list of non-negative int token ids (and -100 where ``allow_ignore``)."""
    if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise DatasetFormatError(f"{where} must be a list of integer token ids, got {ids!r:.80}.")
    bad = [t for t in ids if t < 0 and not (allow_ignore and t == IGNORE)]
    if bad:
        raise DatasetFormatError(f"{where} holds negative token id {bad[0]}" + (" (only -100 marks an ignored label)"
                                                                                if allow_ignore else "") + ".")
    return list(ids)


def _tokenize_with_spans(tokenizer, text: str, spans: list[tuple[int, int]],
                         special_tokens: bool = False) -> tuple[list[int], list[bool]]:
    """Token ids of ``text`` and, per token, whether it overlaps one of the character ``spans``.

    ``special_tokens`` adds what the tokenizer adds around plain text (a Llama/Gemma BOS), as TRL does for text
    rows; a rendered chat already holds its special tokens. Added tokens have empty offsets, so none is trained.
    """
    encoded = tokenizer(text, add_special_tokens=special_tokens, return_offsets_mapping=True)
    in_span = [any(start < end_s and end > start_s for start_s, end_s in spans) for start, end in encoded["offset_mapping"]]
    return list(encoded["input_ids"]), in_span


def _assistant_spans(tokenizer, messages: list[dict], text: str, **chat_kwargs) -> list[tuple[int, int]]:
    """Character spans of every assistant turn in the rendered conversation ``text``.

    Found by rendering prefixes of the conversation, so any chat template works as long as rendering a longer
    conversation only appends text (true of ordinary templates).
    """
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        through = render_chat(tokenizer, messages[: i + 1], **chat_kwargs)
        if i:
            # ends with the assistant header
            before = render_chat(tokenizer, messages[:i], add_generation_prompt=True, **chat_kwargs)
            start = len(before)
        else:
            # A conversation cannot be rendered empty, so the header of a leading assistant turn ends where its
            # content starts.
            before, found = "", through.find(message["content"]) if message.get("content") else -1
            start = max(found, 0)
        if not (text.startswith(before) and text.startswith(through)):
            raise DatasetFormatError(
                "assistant_only_loss=True needs a chat template whose rendering of a conversation starts with the "
                "rendering of its first turns; this template rewrites earlier turns. Use a template without that "
                "behaviour, or assistant_only_loss=False."
            )
        spans.append((start, len(through)))
    return spans


def tokenize_row(row: dict, tokenizer, fmt: str, *, text_field: str = "text", eos_token: str,
                 completion_only_loss: bool | None = None, assistant_only_loss: bool = False) -> dict:
    """One dataset row -> ``{"input_ids", "labels"}`` (labels are input ids, or -100 where no loss is taken).

    A row's own 'labels' (any format) are its labels as given, as TRL leaves a 'labels' column as it is; they must
    match the tokens the row makes. ``completion_only_loss`` None applies the format's own mask (a 'completion_mask',
    a prompt/completion row's completion); the trainer passes TRL's resolved value (``resolve_completion_only_loss``).
    """
    sample = _tokenize_row(row, tokenizer, fmt, text_field=text_field, eos_token=eos_token,
                           completion_only_loss=completion_only_loss, assistant_only_loss=assistant_only_loss)
    given = row.get("labels")
    if given is None or fmt == "tokenized":  # a tokenized row's labels were taken already
        return sample
    labels = check_token_ids(given, "'labels' (a 'labels' column is used as the row's labels, as in TRL)",
                             allow_ignore=True)
    if len(labels) != len(sample["input_ids"]):
        raise DatasetFormatError(
            f"A row's 'labels' has {len(labels)} entries but the row tokenizes to {len(sample['input_ids'])} tokens: "
            f"a 'labels' column is used as the labels of the tokenized row as given (as TRL uses it), so it must "
            f"match them. Drop the column to have the labels computed from the {fmt} format.")
    return {"input_ids": sample["input_ids"], "labels": labels}


def resolve_completion_only_loss(completion_only_loss: bool | None, train_columns) -> bool:
    """TRL's completion_only_loss: None means True when the training dataset (its first row) has 'prompt' and
    'completion' columns, else False; the one value then applies to every dataset, evaluation ones included. So a
    pre-tokenized dataset's 'completion_mask' applies only with completion_only_loss=True (or prompt/completion
    columns beside it); 'assistant_masks' always applies."""
    if completion_only_loss is not None:
        return completion_only_loss
    return {"prompt", "completion"} <= set(train_columns)


def _tokenize_row(row: dict, tokenizer, fmt: str, *, text_field: str, eos_token: str,
                  completion_only_loss: bool | None, assistant_only_loss: bool) -> dict:
    if fmt == "tokenized":
        input_ids = check_token_ids(row["input_ids"], "'input_ids'")
        if row.get("labels") is not None:
            labels = check_token_ids(row["labels"], "'labels'", allow_ignore=True)
            if len(labels) != len(input_ids):
                raise DatasetFormatError(f"A row's 'labels' has {len(labels)} entries but 'input_ids' has "
                                         f"{len(input_ids)}.")
            return {"input_ids": input_ids, "labels": labels}
        # As in TRL: 'assistant_masks' always applies, 'completion_mask' unless completion_only_loss=False.
        masks = ["assistant_masks"] + (["completion_mask"] if completion_only_loss is not False else [])
        labels = list(input_ids)
        for column in masks:
            mask = row.get(column)
            if mask is None:
                continue
            if not all(m in (0, 1) for m in mask):
                raise DatasetFormatError(f"'{column}' must hold 0s and 1s, got {mask!r:.80}.")
            if len(mask) != len(input_ids):
                raise DatasetFormatError(f"A row's '{column}' has {len(mask)} entries but 'input_ids' has "
                                         f"{len(input_ids)}.")
            labels = [t if m else IGNORE for t, m in zip(labels, mask)]
        return {"input_ids": input_ids, "labels": labels}

    if fmt == "language_modeling":
        text = row[text_field]
        if not isinstance(text, str):
            raise DatasetFormatError(f"Column '{text_field}' must hold strings; got {type(text).__name__}.")
        if not text.endswith(eos_token):
            text += eos_token
        ids, _ = _tokenize_with_spans(tokenizer, text, [], special_tokens=True)
        return {"input_ids": ids, "labels": list(ids)}

    if fmt == "conversational":
        column = "messages" if "messages" in row else "conversations"
        messages = from_sharegpt(row[column])
        check_messages(messages, f"column '{column}'")
        chat_kwargs = row_chat_kwargs(row)
        text = render_chat(tokenizer, messages, **chat_kwargs)
        spans = _assistant_spans(tokenizer, messages, text, **chat_kwargs) if assistant_only_loss else [(0, len(text))]
        ids, trained = _tokenize_with_spans(tokenizer, text, spans)
        return {"input_ids": ids, "labels": [t if keep else IGNORE for t, keep in zip(ids, trained)]}

    if fmt == "prompt_completion":
        prompt, completion = from_sharegpt(row["prompt"]), from_sharegpt(row["completion"])
        if isinstance(prompt, list) != isinstance(completion, list):
            raise DatasetFormatError("'prompt' and 'completion' must both be strings or both be lists of messages.")
        if isinstance(prompt, list):
            check_messages(prompt, "column 'prompt'")
            check_messages(completion, "column 'completion'")
        if is_conversational(prompt):
            chat_kwargs = row_chat_kwargs(row)
            before = render_chat(tokenizer, prompt, add_generation_prompt=True, **chat_kwargs)
            text = render_chat(tokenizer, prompt + completion, **chat_kwargs)
            if not text.startswith(before):
                # As TRL: the completion starts where the two renderings diverge (DeepSeek-R1 distills end a
                # generation prompt with "<think>\n" that the rendered conversation drops); the rest of the prompt
                # rendering is not part of the training sequence.
                start = len(os.path.commonprefix([before, text]))
                _warn_once("prompt re-rendered",
                           "The chat template renders the prompt differently once a completion follows: the "
                           f"completion is trained from where they diverge, and {before[start:]!r} at the end of "
                           "the prompt is not part of the training sequence (the model trains on a context that "
                           "differs from the one it sees when generating). This likely applies to every row.")
                before = before[:start]
        elif isinstance(prompt, str) and isinstance(completion, str):
            before = prompt
            text = prompt + completion
            if not text.endswith(eos_token):
                text += eos_token
        else:
            raise DatasetFormatError("'prompt' and 'completion' must hold strings or lists of messages.")
        only_completion = True if completion_only_loss is None else completion_only_loss
        spans = [(len(before), len(text))] if only_completion else [(0, len(text))]
        ids, trained = _tokenize_with_spans(tokenizer, text, spans, special_tokens=not is_conversational(prompt))
        return {"input_ids": ids, "labels": [t if keep else IGNORE for t, keep in zip(ids, trained)]}

    raise ValueError(f"unknown format {fmt!r}")


_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    """Log ``message`` the first time ``key`` comes up in this process (a problem every row may share)."""
    if key not in _warned:
        _warned.add(key)
        logger.warning(message)


def truncate(sample: dict, max_length: int | None, mode: str = "keep_start") -> dict:
    if max_length is None or len(sample["input_ids"]) <= max_length:
        return sample
    cut = slice(0, max_length) if mode == "keep_start" else slice(-max_length, None)
    return {k: v[cut] for k, v in sample.items()}


def shift_targets(sample: dict) -> dict:
    """``{"input_ids", "labels"}`` -> ``{"input_ids", "target_ids"}``: each position's target is the next label."""
    labels = sample["labels"]
    return {"input_ids": sample["input_ids"], "target_ids": list(labels[1:]) + [IGNORE]}


def training_sample(sample: dict) -> dict:
    """``{"input_ids", "labels"}`` -> the sample the trainer keeps: ``shift_targets``'s, and, when the first label
    is not -100, ``first_labels``: ``{0: labels[0]}``. No target carries the first label (nothing predicts the
    first token), but TRL's prepared labels show it (``prepared_view``)."""
    shifted = shift_targets(sample)
    labels = sample["labels"]
    if labels and labels[0] != IGNORE:
        shifted["first_labels"] = {0: labels[0]}
    return shifted


def transformers_labels(target_ids: torch.Tensor) -> torch.Tensor:
    """Our targets (position t's next token) -> transformers' labels (position t's own token, -100 where not
    trained; position 0 always -100): [B, T] -> [B, T]. What compute_metrics and compute_loss_func receive."""
    labels = torch.full_like(target_ids, IGNORE)  # IGNORE is transformers' -100
    labels[:, 1:] = target_ids[:, :-1]
    return labels


@dataclass
class Collator:
    """Turns a list of samples into model inputs.

    Padded mode: ``input_ids``, ``attention_mask``, ``target_ids`` of shape [B, T] (right padding).
    Packed rows (samples carrying ``position_ids``): [B, T] with position ids restarting per document and no
    attention mask; the model's mask then keeps each document to itself.
    Padding-free mode: the samples are concatenated into one row [1, sum T] with ``position_ids`` restarting per
    sample and no attention mask.
    """

    pad_token_id: int
    padding_free: bool = False
    pad_to_multiple_of: int | None = None

    def _round_up(self, n: int) -> int:
        m = self.pad_to_multiple_of
        return n if not m else -(-n // m) * m

    def __call__(self, samples: Sequence[dict]) -> dict[str, torch.Tensor]:
        if any("position_ids" in s for s in samples):
            return self._packed_rows(samples)
        if self.padding_free:
            return self._padding_free(samples)
        width = self._round_up(max(len(s["input_ids"]) for s in samples))
        n = len(samples)
        input_ids = torch.full((n, width), self.pad_token_id, dtype=torch.long)  # [B, T]
        target_ids = torch.full((n, width), IGNORE, dtype=torch.long)  # [B, T]
        attention_mask = torch.zeros((n, width), dtype=torch.long)  # [B, T]
        for row, s in enumerate(samples):
            length = len(s["input_ids"])
            input_ids[row, :length] = torch.tensor(s["input_ids"])
            target_ids[row, :length] = torch.tensor(s["target_ids"])
            attention_mask[row, :length] = 1
        return {"input_ids": input_ids, "target_ids": target_ids, "attention_mask": attention_mask,
                "position_ids": None, "num_input_tokens": attention_mask.sum()}

    def _packed_rows(self, samples: Sequence[dict]) -> dict[str, torch.Tensor]:
        """Packed rows stay rows: [B, T] with position ids restarting per document, no attention mask.

        Flattening the rows into one would make attention cost (B x T)^2 instead of B x T^2 (the mask would
        hide, not skip, the cross-row pairs), which is what makes padding-free packing slow without
        FlashAttention. Trailing padding restarts its own positions, so it forms a block of its own."""
        width = self._round_up(max(len(s["input_ids"]) for s in samples))
        n = len(samples)
        input_ids = torch.full((n, width), self.pad_token_id, dtype=torch.long)  # [B, T]
        target_ids = torch.full((n, width), IGNORE, dtype=torch.long)
        position_ids = torch.zeros((n, width), dtype=torch.long)
        real = 0
        for row, s in enumerate(samples):
            length = len(s["input_ids"])
            input_ids[row, :length] = torch.tensor(s["input_ids"])
            target_ids[row, :length] = torch.tensor(s["target_ids"])
            # a row without position ids (skip_prepare_dataset's rows may mix packed and plain ones) is one document
            position_ids[row, :length] = torch.tensor(s.get("position_ids", range(length)))
            position_ids[row, length:] = torch.arange(width - length)
            real += length
        return {"input_ids": input_ids, "target_ids": target_ids, "position_ids": position_ids,
                "attention_mask": None, "num_input_tokens": torch.tensor(real)}

    def _padding_free(self, samples: Sequence[dict]) -> dict[str, torch.Tensor]:
        input_ids, target_ids, position_ids = [], [], []
        for s in samples:
            input_ids += s["input_ids"]
            target_ids += s["target_ids"]
            position_ids += s.get("position_ids", list(range(len(s["input_ids"]))))
        real = len(input_ids)
        pad = self._round_up(real) - real
        input_ids += [self.pad_token_id] * pad
        target_ids += [IGNORE] * pad
        position_ids += list(range(pad))
        as_row = lambda xs: torch.tensor(xs, dtype=torch.long).unsqueeze(0)  # noqa: E731  [1, T]
        return {"input_ids": as_row(input_ids), "target_ids": as_row(target_ids), "position_ids": as_row(position_ids),
                "attention_mask": None, "num_input_tokens": torch.tensor(real)}


def given_samples(rows: Sequence[dict], name: str, first: int = 0) -> list[dict]:
    """dataset_kwargs={'skip_prepare_dataset': True}: rows used as given, as TRL's collator reads them: 'input_ids',
    optional 'labels' (-100 where no loss is taken; otherwise every token is trained) and optional 'seq_lengths'
    (rows packed beforehand: the lengths of the sequences in the row, whose positions restart and which do not
    attend to each other). No EOS is added, nothing is truncated or packed. A row with 'completion_mask' or
    'assistant_masks' but no 'labels' is refused, as TRL refuses it (the masks would silently not apply). Rows are
    counted from ``first`` in errors."""
    samples = []
    for index, row in enumerate(rows, start=first):
        where = f"{name} row {index}"
        if row.get("input_ids") is None:
            raise DatasetFormatError(
                f"{where} has no 'input_ids' (columns {sorted(row)}): dataset_kwargs={{'skip_prepare_dataset': True}} "
                f"uses the rows as given, so they must be tokenized already ('input_ids', optionally 'labels' and "
                f"'seq_lengths'). Drop skip_prepare_dataset to have the trainer tokenize them.")
        input_ids = check_token_ids(row["input_ids"], f"{where}: 'input_ids'")
        if not input_ids:
            raise DatasetFormatError(f"{where}: 'input_ids' is empty.")
        labels = row.get("labels")
        if labels is None:
            masks = [column for column in ("completion_mask", "assistant_masks") if row.get(column) is not None]
            if masks:
                raise DatasetFormatError(
                    f"{where} has {masks} but no 'labels', and dataset_kwargs={{'skip_prepare_dataset': True}} skips "
                    f"building labels from them, so it would train on the full sequence (TRL refuses this too). Add "
                    f"a 'labels' column (-100 on the tokens without loss) or drop skip_prepare_dataset.")
            labels = list(input_ids)
        labels = check_token_ids(labels, f"{where}: 'labels'", allow_ignore=True)
        if len(labels) != len(input_ids):
            raise DatasetFormatError(f"{where}: 'labels' has {len(labels)} entries but 'input_ids' has "
                                     f"{len(input_ids)}.")
        lengths = row.get("seq_lengths")
        if lengths is not None and (not all(isinstance(n, int) and n > 0 for n in lengths)
                                    or sum(lengths) != len(input_ids)):
            raise DatasetFormatError(f"{where}: 'seq_lengths' {lengths!r:.80} must be positive lengths that add up "
                                     f"to the row's {len(input_ids)} tokens.")
        target_ids, position_ids, first_labels, start = [], [], {}, 0
        for length in lengths or [len(input_ids)]:  # each sequence predicts its own next tokens only
            target_ids += labels[start + 1: start + length] + [IGNORE]
            position_ids += list(range(length))
            if labels[start] != IGNORE:  # predicted by nothing, kept for prepared_view
                first_labels[start] = labels[start]
            start += length
        sample = {"input_ids": input_ids, "target_ids": target_ids}
        if first_labels:
            sample["first_labels"] = first_labels
        if lengths is not None:  # a packed row (the Collator keeps its sequences apart by position ids)
            sample["position_ids"] = position_ids
        samples.append(sample)
    return samples


def prepared_view(samples: Sequence[dict]):
    """Training samples as TRL's prepared dataset: a ``datasets.Dataset`` with 'input_ids', 'labels' (TRL's
    prepared labels: the token at each position, -100 where it is not trained on; a sequence's first token, which
    nothing predicts, shows the label the row gave it, as TRL's do) and, for packed rows, 'seq_lengths' (the lengths
    of the sequences in a row)."""
    from datasets import Dataset

    packed = any("position_ids" in s for s in samples)
    columns: dict[str, list] = {"input_ids": [], "labels": []} | ({"seq_lengths": []} if packed else {})
    for sample in samples:
        ids, targets = sample["input_ids"], sample["target_ids"]
        positions = sample.get("position_ids") or list(range(len(ids)))
        starts = [t for t, position in enumerate(positions) if position == 0] + [len(ids)]
        first = sample.get("first_labels", {})
        # position t's label: what position t - 1 predicts, or, where nothing does, the label kept for it
        labels = [first[t] if t in first else IGNORE if positions[t] == 0 else targets[t - 1] for t in range(len(ids))]
        columns["input_ids"].append(list(ids))
        columns["labels"].append(labels)
        if packed:
            columns["seq_lengths"].append([end - start for start, end in zip(starts, starts[1:])])
    return Dataset.from_dict(columns)
