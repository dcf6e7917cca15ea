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

from trainers.data.formats import row_chat_kwargs
from trainers.preference.data import check_columns, extract_prompt, padded_completions, tokenize_completions

def tokenize_pair(row: dict, tokenizer, where: str) -> dict:
    """A preference row -> ``{"prompt_ids", "chosen_ids", "rejected_ids"}``, as TRL 1.16 (``tokenize_completions``;
    without a prompt column, the implicit one, ``extract_prompt``). ``where`` names the row in errors."""
    conversational = check_columns(row, where, ("chosen", "rejected"))
    chosen, rejected, prompt = row["chosen"], row["rejected"], row.get("prompt")
    if prompt is None:
        prompt, chosen, rejected = extract_prompt(chosen, rejected)
    kwargs = row_chat_kwargs(row) if conversational else {}
    prompt_ids, (chosen_ids, rejected_ids) = tokenize_completions(tokenizer, prompt, [chosen, rejected],
                                                                  conversational, kwargs)
    return {"prompt_ids": prompt_ids, "chosen_ids": chosen_ids, "rejected_ids": rejected_ids}


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
    """Pairs -> a PairBatch: the chosen sequences, then the rejected ones (``padded_completions``)."""
    prompts = [pair["prompt_ids"] for pair in pairs] * 2
    completions = [pair["chosen_ids"] for pair in pairs] + [pair["rejected_ids"] for pair in pairs]
    rows = padded_completions(prompts, completions, pad_id, max_length, truncation_mode, pad_to_multiple_of)
    ref = None
    if all("ref_chosen_logps" in pair for pair in pairs):
        ref = torch.tensor([p["ref_chosen_logps"] for p in pairs] + [p["ref_rejected_logps"] for p in pairs])
    rows = rows.to(device)
    return PairBatch(rows.input_ids, rows.attention_mask, rows.target_ids, rows.completion_mask,
                     None if ref is None else ref.to(device), rows.completion_mask[: len(pairs)],
                     rows.attention_mask.sum(), rows.input_ids.numel())
