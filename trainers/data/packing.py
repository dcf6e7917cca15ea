"""Packing items of known token counts into bins of a token capacity: best-fit decreasing (``pack_bfd``: SFT's
packed rows, GRPO's token-budget micro-batches), and cutting bins until there are as many as asked
(``split_to_count``: every process trains on as many micro-batches, since a forward under ZeRO-3 or FSDP is a
collective). Pure functions of lengths; items are named by their index.
"""

from __future__ import annotations

from collections.abc import Sequence


def pack_bfd(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Best-fit decreasing: assign items (by index) to bins of ``capacity`` tokens, each item to the fullest bin
    it still fits in. Returns the bins, each a list of item indices. An item longer than ``capacity`` gets a
    bin of its own (SFT's samples never are: they are truncated or split first)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    free: list[int] = []  # free[b]: tokens left in bin b
    for i in order:
        n = lengths[i]
        best = None
        for b, space in enumerate(free):
            if n <= space and (best is None or space < free[best]):
                best = b
        if best is None:
            bins.append([i])
            free.append(capacity - n)
        else:
            bins[best].append(i)
            free[best] -= n
    return bins


def split_to_count(bins: Sequence[Sequence[int]], lengths: Sequence[int], count: int) -> list[list[int]]:
    """``bins`` cut until there are ``count`` of them: each cut halves (by tokens, keeping the bin's order) the
    bin with the most tokens among those with two items or more. Bins already ``count`` or more are returned
    as they are. Raises ValueError when there are fewer than ``count`` items."""
    bins = [list(b) for b in bins]
    if count > sum(len(b) for b in bins):
        raise ValueError(f"cannot make {count} bins of {sum(len(b) for b in bins)} items")
    while len(bins) < count:
        loads = [sum(lengths[i] for i in b) if len(b) > 1 else -1 for b in bins]
        widest = max(range(len(bins)), key=loads.__getitem__)
        items = bins.pop(widest)
        half, running, cut = loads[widest] / 2, 0, 1
        for cut in range(1, len(items)):  # the first cut whose left part holds at least half the tokens
            running += lengths[items[cut - 1]]
            if running >= half:
                break
        bins[widest:widest] = [items[:cut], items[cut:]]
    return bins
