"""DPO's data: preference rows -> token ids, as TRL 1.16 tokenizes them (``tokenize_pair``), and a micro-batch
of pairs -> model inputs (``collate_pairs``, ``PairBatch``).

Rows hold ``chosen`` and ``rejected`` and, optionally, ``prompt`` (without it the prompt is the two texts'
common start, TRL's ``extract_prompt``); each is text (standard) or a list of messages (conversational, through
the chat template, with a row's own ``tools`` and ``chat_template_kwargs``). Text completions end with the
tokenizer's EOS (appended unless there), as in TRL.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainers.data import chat_ids, row_chat_kwargs
from trainers.preferences import check_columns

IGNORE = -100  # a target no loss is taken on


def extract_prompt(chosen, rejected) -> tuple:
    """TRL's implicit prompt: the common start of ``chosen`` and ``rejected`` (texts or message lists), a space
    before the first difference given to the completions. Returns (prompt, chosen, rejected)."""
    index = 0
    for index in range(min(len(chosen), len(rejected))):
        if chosen[index] != rejected[index]:
            if chosen[index - 1] == " ":
                index -= 1
            break
    return chosen[:index], chosen[index:], rejected[index:]


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def tokenize_pair(row: dict, tokenizer, where: str) -> dict:
    """A preference row -> ``{"prompt_ids", "chosen_ids", "rejected_ids"}``, as TRL 1.16: the prompt and each
    prompt + completion tokenized whole, the prompt's ids cut where it stops being a prefix of both (a merge
    across the boundary, a template that renders the prompt differently). ``where`` names the row in errors."""
    conversational = check_columns(row, where, ("chosen", "rejected"))
    chosen, rejected, prompt = row["chosen"], row["rejected"], row.get("prompt")
    if prompt is None:
        prompt, chosen, rejected = extract_prompt(chosen, rejected)
    if conversational:
        kwargs = row_chat_kwargs(row)
        prompt_ids = chat_ids(tokenizer, prompt, add_generation_prompt=True, **kwargs)
        with_chosen = chat_ids(tokenizer, prompt + chosen, **kwargs)
        with_rejected = chat_ids(tokenizer, prompt + rejected, **kwargs)
    else:
        eos = tokenizer.eos_token or ""
        chosen = chosen if chosen.endswith(eos) else chosen + eos
        rejected = rejected if rejected.endswith(eos) else rejected + eos
        prompt_ids = tokenizer(prompt)["input_ids"]
        with_chosen = tokenizer(prompt + chosen)["input_ids"]
        with_rejected = tokenizer(prompt + rejected)["input_ids"]
    cut = min(common_prefix_length(prompt_ids, with_chosen), common_prefix_length(prompt_ids, with_rejected))
    return {"prompt_ids": list(prompt_ids[:cut]), "chosen_ids": list(with_chosen[cut:]),
            "rejected_ids": list(with_rejected[cut:])}


def pair_length(pair: dict) -> int:
    """The longer of the pair's two sequences, in tokens (the data order's length)."""
    return len(pair["prompt_ids"]) + max(len(pair["chosen_ids"]), len(pair["rejected_ids"]))


@dataclass(frozen=True)
class PairBatch:
    """B preference pairs as one forward's inputs: the B chosen sequences, then the B rejected ones, right-padded
    (the base loop counts the step's pairs and their chosen tokens from ``loss_mask``)."""

    input_ids: torch.Tensor  # [2B, T] long: prompt + chosen (rows 0..B-1), prompt + rejected (rows B..2B-1)
    attention_mask: torch.Tensor  # [2B, T]
    target_ids: torch.Tensor  # [2B, T] long: the next token where it is a completion token, IGNORE elsewhere
    completion_mask: torch.Tensor  # [2B, T] float: 1 where target_ids is a completion token
    ref_logps: torch.Tensor | None  # [2B] precomputed reference log-probs (chosen, then rejected), or None
    loss_mask: torch.Tensor  # [B, T] float: the chosen completion tokens (the step's counts: pairs, sft's tokens)
    num_input_tokens: torch.Tensor  # 0-d: real tokens of both sequences
    num_padded_tokens: int  # 2B x T

    @property
    def pairs(self) -> int:
        return self.input_ids.shape[0] // 2


def collate_pairs(pairs: list[dict], pad_id: int, max_length: int | None, truncation_mode: str,
                  pad_to_multiple_of: int | None, device) -> PairBatch:
    """Pairs -> a PairBatch: each sequence truncated to ``max_length`` (TRL's collator: ``keep_start`` keeps the
    first tokens, ``keep_end`` the last), then right-padded (to a multiple of ``pad_to_multiple_of``)."""
    sequences, masks = [], []
    for side in ("chosen_ids", "rejected_ids"):
        for pair in pairs:
            ids = pair["prompt_ids"] + pair[side]
            mask = [0] * len(pair["prompt_ids"]) + [1] * len(pair[side])
            if max_length is not None and len(ids) > max_length:
                cut = slice(None, max_length) if truncation_mode == "keep_start" else slice(-max_length, None)
                ids, mask = ids[cut], mask[cut]
            sequences.append(ids)
            masks.append(mask)
    width = max(len(ids) for ids in sequences)
    if pad_to_multiple_of:
        width = -(-width // pad_to_multiple_of) * pad_to_multiple_of
    rows = len(sequences)
    input_ids = torch.full((rows, width), pad_id, dtype=torch.long)
    attention = torch.zeros((rows, width), dtype=torch.long)
    completion = torch.zeros((rows, width), dtype=torch.long)
    for row, (ids, mask) in enumerate(zip(sequences, masks)):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention[row, : len(ids)] = 1
        completion[row, : len(mask)] = torch.tensor(mask)
    # position t predicts token t + 1: its target where that token is a completion token
    targets = torch.full_like(input_ids, IGNORE)
    shifted = completion[:, 1:].bool()
    targets[:, :-1] = torch.where(shifted, input_ids[:, 1:], IGNORE)
    ref = None
    if all("ref_chosen_logps" in pair for pair in pairs):
        ref = torch.tensor([p["ref_chosen_logps"] for p in pairs] + [p["ref_rejected_logps"] for p in pairs])
    completion_mask = (targets != IGNORE).float().to(device)
    return PairBatch(input_ids.to(device), attention.to(device), targets.to(device), completion_mask,
                     None if ref is None else ref.to(device), completion_mask[: len(pairs)],
                     attention.sum().to(device), rows * width)
