"""SFT packing: shifted samples -> rows of up to max_length tokens. 'bfd' and 'bfd_split' fill rows best-fit
decreasing (``pack_bfd``, trainers/data/packing.py), 'wrapped' concatenates and cuts; each sample keeps its own
positions (``position_ids`` restart per sample), so the Collator keeps them apart. A sample is
``{"input_ids", "target_ids"}`` (and ``first_labels``, ``training_sample``'s), as trainers/sft/tokenize.py makes
it."""

from __future__ import annotations

from collections.abc import Sequence

from trainers.data.packing import pack_bfd
from trainers.sft.tokenize import IGNORE


def _moved_first_labels(sample: dict, offset: int, start: int = 0, end: int | None = None) -> dict[int, int]:
    """A sample's ``first_labels`` (position -> label) within positions [start, end), moved by ``offset``."""
    end = len(sample["input_ids"]) if end is None else end
    return {p + offset: label for p, label in sample.get("first_labels", {}).items() if start <= p < end}



def split_overflow(samples: Sequence[dict], max_length: int) -> list[dict]:
    """TRL's 'bfd_split' pieces: a sample longer than ``max_length`` becomes consecutive pieces of ``max_length``
    tokens (the last one shorter), each a sample of its own. A piece's last token predicts nothing
    (``cut_targets``): the token it would predict starts the next piece, which it does not attend to."""
    pieces = []
    for sample in samples:
        n = len(sample["input_ids"])
        if n <= max_length:
            pieces.append(sample)
            continue
        for start in range(0, n, max_length):
            pieces.append(cut_targets(sample, start, min(start + max_length, n)))
    return pieces


def cut_targets(sample: dict, start: int, end: int, first_labels: dict[int, int] | None = None) -> dict:
    """Tokens [start, end) of a shifted sample, its last target IGNORE: across the cut, as TRL (whose labels are
    shifted within each piece) leaves it. ``{"input_ids", "target_ids"}`` -> the same keys, and ``first_labels``
    where the piece has some: the sample's within it, and the label of the piece's first token (TRL's label
    there, which the target before the cut carried). The argument ``first_labels`` gives the sample's within the
    piece, counted from ``start``, when the caller has them already (a long sample cut many times)."""
    piece = {"input_ids": sample["input_ids"][start:end],
             "target_ids": sample["target_ids"][start:end - 1] + [IGNORE]}
    first = dict(first_labels) if first_labels is not None else _moved_first_labels(sample, -start, start, end)
    if start > 0 and 0 not in first and sample["target_ids"][start - 1] != IGNORE:
        first[0] = sample["target_ids"][start - 1]
    if first:
        piece["first_labels"] = first
    return piece


def pack_wrapped(samples: Sequence[dict], max_length: int) -> list[dict]:
    """TRL's 'wrapped' packing: every sample concatenated, in order, and cut into rows of ``max_length`` tokens
    (the last row shorter). Each row is one sequence, as in TRL: ``position_ids`` run 0..len-1 over the row and
    a sample attends to the samples before it in the row; a sample may be cut in the middle, its rest starting
    the next row at position 0.

    What each token predicts (targets are shifted per sample, before packing): the next token of its own sample.
    So a sample's last token predicts nothing, where TRL (which shifts the concatenated labels) trains it on the
    next sample's first token; and at a cut, the row's last token predicts nothing (its next token is in the next
    row, as in TRL), while the next row's first token, with no context before it, predicts its sample's next
    token (as in TRL)."""
    input_ids = [t for s in samples for t in s["input_ids"]]
    target_ids = [t for s in samples for t in s["target_ids"]]
    whole = {"input_ids": input_ids, "target_ids": target_ids}
    first_labels, offset = [], 0  # (position, label) over the concatenation, in order
    for s in samples:
        first_labels += sorted(_moved_first_labels(s, offset).items())
        offset += len(s["input_ids"])
    rows, next_first = [], 0
    for start in range(0, len(input_ids), max_length):
        end = min(start + max_length, len(input_ids))
        first = {}
        while next_first < len(first_labels) and first_labels[next_first][0] < end:
            position, label = first_labels[next_first]
            first[position - start] = label
            next_first += 1
        row = cut_targets(whole, start, end, first)
        rows.append({**row, "position_ids": list(range(len(row["input_ids"])))})
    return rows


def pack_samples(samples: Sequence[dict], max_length: int, strategy: str = "bfd") -> list[dict]:
    """Pack shifted samples into rows of at most ``max_length`` tokens, with TRL's ``packing_strategy``:
    'bfd' (samples already truncated to max_length) and 'bfd_split' (longer samples split first,
    ``split_overflow``) fill rows best-fit decreasing, ``position_ids`` restarting per sample; 'wrapped'
    concatenates and cuts (``pack_wrapped``)."""
    if strategy == "wrapped":
        return pack_wrapped(samples, max_length)
    if strategy == "bfd_split":
        samples = split_overflow(samples, max_length)
    elif strategy != "bfd":
        raise ValueError(f"unknown packing strategy {strategy!r}")
    bins = pack_bfd([len(s["input_ids"]) for s in samples], max_length)
    rows = []
    for members in bins:
        input_ids, target_ids, position_ids, first_labels = [], [], [], {}
        for i in sorted(members):
            first_labels.update(_moved_first_labels(samples[i], len(input_ids)))
            input_ids += samples[i]["input_ids"]
            target_ids += samples[i]["target_ids"]
            position_ids += list(range(len(samples[i]["input_ids"])))
        rows.append({"input_ids": input_ids, "target_ids": target_ids, "position_ids": position_ids}
                    | ({"first_labels": first_labels} if first_labels else {}))
    return rows
