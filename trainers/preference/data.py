"""What the preference trainers (DPO, reward models, KTO) share about their rows: the columns a row must have
(``check_columns``), TRL's implicit prompt and tokenization of a prompt and its completions
(``extract_prompt``, ``tokenize_completions``), dropping the rows that do not fit, with a warning that counts
them (``kept_rows``), the model's vocabulary and context (``check_fit``), prompt + completion rows padded for one
forward (``padded_completions``), evaluation in equal batches on every process (``evaluation_totals``), and the
trainers' data hooks on their rows in memory (``PreferenceData``)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from trainers.data.formats import as_dataset, chat_ids, check_messages, is_conversational
from trainers.parallel.distributed import gather_objects
from trainers.errors import ConfigError, DatasetFormatError
from trainers.logs import logger
from trainers.model.modeling import context_length, vocabulary_size
from trainers.model.reference import disable_dropout
from trainers.data.samplers import local_slice
from trainers.loop.stats import Extreme, Stats
from trainers.data.streaming import (
    IndexedBatches,
    PerThread,
    is_stream,
    load_data_position,
    note_map_style_workers,
    save_data_position,
    stream_batches,
    stream_dispatch_batches,
)


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


def tokenize_completions(tokenizer, prompt, completions: list, conversational: bool, chat_kwargs: dict
                         ) -> tuple[list[int], list[list[int]]]:
    """The prompt's ids and each completion's, as TRL 1.16 tokenizes them: text completions end with the EOS
    (appended unless there), the prompt and each prompt + completion are tokenized whole (messages through the
    chat template, the prompt with the generation prompt), and the prompt's ids are cut where they stop being a
    prefix of every full sequence (a token merge across the boundary, a template that renders the prompt
    differently), so each completion token is scored once."""
    if conversational:
        prompt_ids = chat_ids(tokenizer, prompt, add_generation_prompt=True, **chat_kwargs)
        full = [chat_ids(tokenizer, prompt + completion, **chat_kwargs) for completion in completions]
    else:
        eos = tokenizer.eos_token or ""
        prompt_ids = tokenizer(prompt)["input_ids"]
        full = [tokenizer(prompt + (c if c.endswith(eos) else c + eos))["input_ids"] for c in completions]
    cut = min(common_prefix_length(prompt_ids, ids) for ids in full)
    return list(prompt_ids[:cut]), [list(ids[cut:]) for ids in full]


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
    ``batch_size`` at a time (``measure``: rows -> their statistics, "loss" included: (sum, count) pairs, summed;
    Extremes, the min or max over every batch), and every process runs as many batches (ZeRO-3 gathers weights
    collectively): one with no rows left measures row 0 at zero weight (left out of the extremes). ``after_batch``
    runs after each (the prediction_step callback)."""
    mine = list(range(accelerator.process_index, len(rows), accelerator.num_processes))
    per_process = -(-len(rows) // accelerator.num_processes)
    totals: dict[str, list] = {}
    extremes: dict[str, Extreme] = {}
    for start in range(0, per_process, batch_size):
        chunk = mine[start:start + batch_size]
        weight = 1.0 if chunk else 0.0
        for name, entry in measure([rows[i] for i in chunk or [0]]).items():
            if isinstance(entry, Extreme):  # NaN where nothing was measured: every process reports every name
                value = entry.value.detach().float()
                value = value if chunk else torch.full_like(value, math.nan)
                kept = extremes.get(name)
                if kept is None or torch.isnan(kept.value):
                    extremes[name] = Extreme(value, entry.reduce)
                elif chunk:
                    best = torch.minimum if entry.reduce == "min" else torch.maximum
                    extremes[name] = Extreme(best(kept.value, value), entry.reduce)
                continue
            value, count = entry
            total = totals.setdefault(name, [0.0, 0.0])
            total[0], total[1] = total[0] + value * weight, total[1] + count * weight
        after_batch()
    return {name: (value, count) for name, (value, count) in totals.items()} | extremes


def reference_scores(accelerator, rows: list[dict], size: int,
                     score: Callable[[list[dict]], list[tuple]]) -> list[tuple]:
    """precompute_ref_log_probs' pass over ``rows``: each process scores its share (rows rank, rank + processes,
    ...) ``size`` at a time (``score``: rows -> one tuple of floats per row), every process as many batches
    (ZeRO-3's forwards are collective: one out of rows scores row 0 and drops it); every row's scores, gathered
    to every process in row order. Each process thus runs 1/processes of the forwards, not all of them."""
    mine = list(range(accelerator.process_index, len(rows), accelerator.num_processes))
    per_process = -(-len(rows) // accelerator.num_processes)
    local = []
    for start in range(0, per_process, size):
        chunk = mine[start:start + size]
        scores = score([rows[i] for i in chunk or [0]])
        local += list(zip(chunk, scores))  # nothing for the stand-in row 0
    out: list = [None] * len(rows)
    for index, scores in gather_objects(accelerator, local):
        out[index] = scores
    return out


IGNORE = -100  # a target no loss is taken on


@dataclass(frozen=True)
class PaddedCompletions:
    """Prompt + completion sequences, right-padded: R rows of T positions."""

    input_ids: torch.Tensor  # [R, T] long
    attention_mask: torch.Tensor  # [R, T] long
    target_ids: torch.Tensor  # [R, T] long: the next token where it is a completion token, IGNORE elsewhere
    completion_mask: torch.Tensor  # [R, T] float: 1 where target_ids is a completion token

    def to(self, device) -> PaddedCompletions:
        return PaddedCompletions(*(t.to(device) for t in (self.input_ids, self.attention_mask, self.target_ids,
                                                          self.completion_mask)))


def padded_completions(prompts: list[list[int]], completions: list[list[int]], pad_id: int, max_length: int | None,
                       truncation_mode: str = "keep_start", pad_to_multiple_of: int | None = None
                       ) -> PaddedCompletions:
    """Each prompt + completion truncated to ``max_length`` as TRL's collators do (``keep_start`` keeps the first
    tokens, ``keep_end`` the last), then right-padded (to a multiple of ``pad_to_multiple_of``); each position's
    target is the next token where that token belongs to the completion."""
    sequences, masks = [], []
    for prompt, completion in zip(prompts, completions, strict=True):
        ids, mask = prompt + completion, [0] * len(prompt) + [1] * len(completion)
        if max_length is not None and len(ids) > max_length:
            cut = slice(None, max_length) if truncation_mode == "keep_start" else slice(-max_length, None)
            ids, mask = ids[cut], mask[cut]
        sequences.append(ids)
        masks.append(mask)
    width = max(len(ids) for ids in sequences)
    if pad_to_multiple_of:
        width = -(-width // pad_to_multiple_of) * pad_to_multiple_of
    input_ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    attention = torch.zeros_like(input_ids)
    completion = torch.zeros_like(input_ids)
    for row, (ids, mask) in enumerate(zip(sequences, masks)):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention[row, : len(ids)] = 1
        completion[row, : len(mask)] = torch.tensor(mask)
    targets = torch.full_like(input_ids, IGNORE)  # position t predicts token t + 1
    targets[:, :-1] = torch.where(completion[:, 1:].bool(), input_ids[:, 1:], IGNORE)
    return PaddedCompletions(input_ids, attention, targets, (targets != IGNORE).float())


class PreferenceData:
    """Mixin of the preference trainers (DPO, KTO, reward models) for their tokenized rows: the subclass sets
    ``pad_id`` and calls ``read_rows`` in prepare_data, and provides ``_prepare(raw_rows, name, first,
    tokenizer)`` (raw rows -> tokenized rows, errors naming row ``first`` + i), ``_check_fit(model, name, rows)``
    and ``_collate(rows)``; this gives the base trainer's data hooks, a streamed train_dataset read a chunk at a
    time, TRL's ``train_dataset`` / ``eval_dataset`` views and the checkpointed data position."""

    def read_rows(self, train_dataset, eval_dataset, length: Callable[[dict], int]) -> None:
        """The training rows: a map-style dataset tokenized now and ordered by the config's sampler (``length``:
        a row's tokens, for group_by_length); a stream (an IterableDataset) read and tokenized a chunk at a time
        during training, in its own order, as SFT reads one. The eval rows: tokenized now (a stream read whole)."""
        args, acc = self.args, self.accelerator
        self._given_train_dataset = train_dataset
        if is_stream(train_dataset):
            self._refuse_stream_with_precompute("train_dataset")
            stream_dispatch_batches(args, acc)
            self.train_rows, self.sampler = None, None
            tokenizers = PerThread(self.processing_class)  # dataloader_num_workers: one tokenizer per thread

            def prepare(raw: list[dict], first: int) -> list[dict]:
                return self._prepare(raw, "train_dataset", first, tokenizers.get())

            self.train_batches = stream_batches(args, acc, train_dataset, prepare, self.effective_batch_size)
        else:
            self.train_rows = self._tokenize(train_dataset, "train_dataset")
            self.sampler = self.batch_sampler([length(row) for row in self.train_rows], self.effective_batch_size,
                                              "global batch")
            self.train_batches = IndexedBatches(self.train_rows, self.sampler)
            note_map_style_workers(args, acc)
        self.eval_rows = self._tokenize(eval_dataset, "eval_dataset") if eval_dataset is not None else None

    def _refuse_stream_with_precompute(self, name: str) -> None:
        """TRL's rule (and words): reference log-probs computed before training need every row up front."""
        args = self.args
        if getattr(args, "precompute_ref_log_probs", False):
            raise ConfigError(f"{type(args).__name__}: `precompute_ref_log_probs=True` is not supported with "
                              f"IterableDataset ({name} is streamed): the reference scores every row before training. "
                              f"Turn it off, or pass a datasets.Dataset.")

    def _tokenize(self, dataset, name: str) -> list[dict]:
        """An eval dataset's (or a map-style train_dataset's) rows, tokenized: a stream is read whole."""
        if is_stream(dataset):
            self._refuse_stream_with_precompute(name)
        return self._prepare(as_dataset(dataset, name).to_list(), name, 0, self.processing_class)

    def eval_row_sets(self) -> list[list[dict]]:
        """Every set of evaluation rows: the eval_dataset's and each named eval dataset's."""
        return [rows for rows in [self.eval_rows, *(s["eval_rows"] for s in self.eval_sets.values())]
                if rows is not None]

    def optimizer_steps_per_epoch(self) -> int:
        # a stream's length is unknown: as transformers, one "epoch" spans max_steps
        return self.sampler.steps_per_epoch if self.sampler is not None else self.args.max_steps

    def micro_batch(self, step: int, accumulation_index: int):
        acc = self.accelerator
        rows = local_slice(self.train_batches.batch(step), accumulation_index, acc.process_index,
                           self.per_process_train_batch_size, acc.num_processes)
        return self._collate(rows)

    def tokenize_eval(self, dataset, name: str) -> None:
        self.eval_rows = self._tokenize(dataset, name)

    def check_eval_fit(self, model, name: str) -> None:
        self._check_fit(model, name, self.eval_rows)

    def eval_rows_per_batch(self) -> int:
        return self.per_process_eval_batch_size

    def after_load(self, model) -> None:
        """The model's pad id is the tokenizer's (a sequence classifier reads its score at the last non-pad token),
        the training rows fit it, and its dropout is off with disable_dropout."""
        model.config.get_text_config().pad_token_id = self.pad_id
        model.config.pad_token_id = self.pad_id
        if self.train_rows is not None:
            self._check_fit(model, "train_dataset", self.train_rows)
        else:  # a stream: each chunk when it is first read
            self.train_batches.validate = lambda rows, first: self._check_fit(
                model, f"train_dataset (the chunk from row {first})", rows)
        if self.args.disable_dropout:
            disable_dropout(model)

    @property
    def train_dataset(self):
        """The training rows as TRL keeps them, tokenized (a ``datasets.Dataset``; its columns: the trainer's); a
        stream as given (it is tokenized a chunk at a time during training)."""
        from datasets import Dataset

        return self._given_train_dataset if self.train_rows is None else Dataset.from_list(self.train_rows)

    @property
    def eval_dataset(self):
        """The evaluation rows as TRL keeps them, tokenized (a ``datasets.Dataset``); a dict of them for named eval
        datasets, each tokenized on its own."""
        from datasets import Dataset

        if self.eval_sets:
            return {name: Dataset.from_list(rows["eval_rows"]) for name, rows in self.eval_sets.items()}
        return None if self.eval_rows is None else Dataset.from_list(self.eval_rows)

    def save_extra_state(self, folder: str) -> None:
        save_data_position(self.train_batches, folder, self.accelerator.process_index)

    def load_extra_state(self, folder: str) -> None:
        load_data_position(self.train_batches, folder, self.accelerator.process_index)
