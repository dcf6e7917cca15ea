"""Small pure helpers on rows of token ids, shared by the samplers, the lean engine and the trainers' batches."""

from __future__ import annotations


def round_up(n: int, multiple: int | None) -> int:
    """``n`` rounded up to a multiple of ``multiple`` (None or 0: ``n`` itself)."""
    return -(-n // multiple) * multiple if multiple else n


def prompt_groups(prompt_ids: list[list[int]]) -> list[int]:
    """Each row's distinct prompt, numbered in order of first appearance: [[1, 2], [1, 2], [3]] -> [0, 0, 1]."""
    seen: dict[tuple, int] = {}
    return [seen.setdefault(tuple(ids), len(seen)) for ids in prompt_ids]
