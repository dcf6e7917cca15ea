"""What the preference trainers (DPO, reward models, KTO) share about their rows: the columns a row must have
(``check_columns``), dropping the rows that do not fit, with a warning that counts them (``kept_rows``), the
model's vocabulary and context (``check_fit``), and evaluation in equal batches on every process
(``evaluation_totals``)."""

from __future__ import annotations

from collections.abc import Callable

from trainers.data import check_messages, is_conversational
from trainers.errors import ConfigError, DatasetFormatError
from trainers.logs import logger
from trainers.modeling import context_length, vocabulary_size
from trainers.stats import Stats


def check_columns(row: dict, where: str, required: tuple[str, ...], optional: tuple[str, ...] = ("prompt",)) -> bool:
    """The row has every ``required`` column, and each of those and of the ``optional`` it has is text, or, in
    every one of them, a list of messages. Returns whether the row is conversational; errors name the row
    (``where``) and the column."""
    for column in required:
        if row.get(column) is None:
            raise DatasetFormatError(f"{where}: column '{column}' is missing or empty; a row needs "
                                     f"{', '.join(repr(c) for c in required)} (and optionally "
                                     f"{', '.join(repr(c) for c in optional)}).")
    conversational = is_conversational(row[required[0]])
    for column in required + tuple(c for c in optional if row.get(c)):
        if conversational:
            check_messages(row[column], f"{where} column '{column}'")
        elif not isinstance(row[column], str):
            raise DatasetFormatError(f"{where} column '{column}' must be text (or, in every column, a list of "
                                     f"messages), got {type(row[column]).__name__}: {row[column]!r:.80}.")
    return conversational


def kept_rows(rows: list[dict], keep: Callable[[dict], bool], name: str, why: str, log: bool) -> list[dict]:
    """The rows ``keep`` accepts; the others are dropped with a warning that counts them and says ``why`` (TRL
    drops them silently). No row left is an error."""
    kept = [row for row in rows if keep(row)]
    if len(kept) < len(rows) and log:
        logger.warning(f"{len(rows) - len(kept)} rows of {name} {why}: they are dropped, as TRL drops them.")
    if not kept:
        raise DatasetFormatError(f"No row of {name} is left to train on (check max_length).")
    return kept


def check_fit(model, name: str, top_id: int, longest: int, max_length: int | None) -> None:
    """Every token id (the largest: ``top_id``) is in the model's vocabulary and the longest sequence fits its
    context."""
    vocab, context = vocabulary_size(model), context_length(model)
    if top_id >= vocab:
        raise DatasetFormatError(f"{name} holds token id {top_id}, but the model's vocabulary has {vocab} tokens.")
    if context and longest > context:
        raise ConfigError(f"{name}: a sequence has {longest} tokens, more than the model's context of {context}. "
                          f"Set max_length <= {context} (now {max_length}).")


def evaluation_totals(accelerator, rows: list[dict], batch_size: int, measure: Callable[[list[dict]], Stats],
                      after_batch: Callable[[], None]) -> Stats:
    """Evaluation statistics over ``rows``: each process measures its share (rows rank, rank + processes, ...)
    ``batch_size`` at a time (``measure``: rows -> their (sum, count) statistics, "loss" included), and every
    process runs as many batches (ZeRO-3 gathers weights collectively): one with no rows left measures row 0 at
    zero weight. ``after_batch`` runs after each (the prediction_step callback)."""
    mine = list(range(accelerator.process_index, len(rows), accelerator.num_processes))
    per_process = -(-len(rows) // accelerator.num_processes)
    totals: dict[str, list] = {}
    for start in range(0, per_process, batch_size):
        chunk = mine[start:start + batch_size]
        weight = 1.0 if chunk else 0.0
        for name, (value, count) in measure([rows[i] for i in chunk or [0]]).items():
            total = totals.setdefault(name, [0.0, 0.0])
            total[0], total[1] = total[0] + value * weight, total[1] + count * weight
        after_batch()
    return {name: (value, count) for name, (value, count) in totals.items()}
