"""Training batches from a stream (a ``datasets.IterableDataset``), and the same interface over rows in memory.

A trainer reads its training data through one interface, ``batch(step) -> the rows of global batch `step```, laid
out ``[accumulation step][process][row]`` (``trainers.data.samplers.local_slice`` cuts each process's rows out of it):

- ``IndexedBatches``: rows prepared in memory before training, ordered by a ``GlobalBatchSampler`` (a pure
  function of the seed and the step);
- ``StreamedBatches``: a stream read in order (the user shuffles it, with ``.shuffle(seed=..., buffer_size=...)``),
  prepared ``CHUNK_ROWS`` raw rows at a time (SFT: tokenized, truncated, packed within the chunk, as TRL packs a
  streamed dataset 1000 rows at a time; GRPO: prompts tokenized), cut into global batches in order. When the stream
  ends, the next epoch starts (``set_epoch(epoch)`` first, as transformers does, so a shuffled stream reshuffles)
  and batches go on filling across the boundary (with ``dataloader_drop_last``, an epoch's last incomplete batch is
  dropped instead).

Every process reads the whole stream and prepares it identically, so all processes hold the same global batch
without talking, and each trains on its own distinct slice of it (a check that they agree runs on every batch). The
position in the stream (epoch, raw rows before the current chunk, prepared rows of it used, batches handed out) is
saved in checkpoints (``state`` / ``restore``): a resumed run skips the raw rows already used, without preparing
them, and continues with exactly the rows the uninterrupted run would have seen next.

With ``workers > 0`` (``dataloader_num_workers``) the chunks ahead are prepared in background threads while the
model trains (a reader thread reads the stream in order; a pool of ``workers`` threads prepares up to
``workers x prefetch_factor`` chunks ahead); the batches are the same as without.
"""

from __future__ import annotations

import concurrent.futures
import copy
import itertools
import json
import os
import queue
import threading
import zlib
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from trainers.parallel import distributed as dist
from trainers.errors import CheckpointError, ConfigError, DatasetFormatError
from trainers.logs import logger

CHUNK_ROWS = 1000  # raw rows prepared together (TRL's batched map over a streamed dataset uses 1000 too)


def is_stream(data: Any) -> bool:
    """Whether ``data`` is a ``datasets.IterableDataset`` (a stream: no length, read in order)."""
    from datasets import IterableDataset

    return isinstance(data, IterableDataset)


def stream_batches(args, accelerator, stream, prepare: Callable[[list, int], list], batch_size: int,
                   name: str = "train_dataset") -> StreamedBatches:
    """A trainer's streamed training data: its options checked (a stream has no length, so max_steps must say how
    long to train; it is read in the order it gives), then ``StreamedBatches`` with the config's dataloader
    options and, with several processes, the check that they all hold the same batch."""
    acc = accelerator
    config = type(args).__name__
    if args.max_steps <= 0:
        raise ConfigError(f"{config}: {name} is a datasets.IterableDataset (a stream), whose length is unknown: set "
                          f"max_steps > 0 to say how many optimizer steps to train (as transformers' Trainer "
                          f"requires); num_train_epochs cannot be used with a stream.")
    if args.train_sampling_strategy == "group_by_length":
        raise ConfigError(f"{config}: train_sampling_strategy='group_by_length' needs every row's length before "
                          f"training, which a stream ({name}) does not give; use 'random' or 'sequential' (a stream "
                          f"is read in its own order either way).")
    if args.shuffle_dataset and args.train_sampling_strategy == "random" and acc.is_main_process:
        logger.info(f"{name} is a stream: it is read in the order it gives (shuffle_dataset applies to map-style "
                    f"datasets); shuffle it with {name}.shuffle(seed=..., buffer_size=...) to train in another order.")

    def agree(fingerprint: int) -> None:
        fingerprints = dist.gather_objects(acc, [fingerprint])
        if len(set(fingerprints)) > 1:
            raise DatasetFormatError(
                f"{name}: the processes read different rows from the stream for the same batch, so some rows would "
                f"be trained twice and others never. Every process must read the same stream in the same order: "
                f"shuffle it with a seed ({name}.shuffle(seed=..., buffer_size=...)), and do not split it by "
                f"process yourself (the trainer gives each process its share of every batch).")

    return StreamedBatches(stream, prepare, batch_size, name, drop_last=args.dataloader_drop_last,
                           workers=args.dataloader_num_workers, prefetch_factor=args.dataloader_prefetch_factor,
                           agree=agree if acc.num_processes > 1 else None)


def first_row_columns(data) -> list:
    """The columns of a dataset's first row (a list of dicts, a Dataset, or a stream, whose first row is read when
    its columns are not declared), as TRL reads them off ``next(iter(train_dataset))``; [] when there is none."""
    if isinstance(data, list):
        return list(data[0]) if data and isinstance(data[0], dict) else []
    columns = getattr(data, "column_names", None)
    if isinstance(columns, list):
        return columns
    if is_stream(data):
        return list(next(iter(data), None) or [])
    return []


def stream_dispatch_batches(args, accelerator, name: str = "train_dataset") -> None:
    """TRL's SFTTrainer rule for a streamed train_dataset: accelerator_config's ``dispatch_batches=True`` is forced
    to False, with TRL's warning (here each process reads the whole stream and takes its own rows of every batch,
    never one process's batches sent to the others). TRL's GRPOTrainer refuses it instead (a ValueError)."""
    if (args.accelerator_config or {}).get("dispatch_batches") is not True:
        return
    if accelerator.is_main_process:
        logger.warning(f"You are using an `IterableDataset` for training with `dispatch_batches=True`. "
                       f"`dispatch_batches` is forced to `False` when using an `IterableDataset`. To remove this "
                       f"warning, unset `dispatch_batches` in `{type(args).__name__}` or set it to `False`. "
                       f"({name} is a stream.)")
    args.accelerator_config["dispatch_batches"] = False


def refuse_dispatch_batches(args) -> None:
    """TRL's GRPOTrainer rule for a streamed train or eval dataset: accelerator_config's ``dispatch_batches=True`` is
    refused with TRL's message (a ConfigError, a ValueError as TRL's)."""
    if (args.accelerator_config or {}).get("dispatch_batches") is True:
        raise ConfigError(f"{type(args).__name__}.accelerator_config: Iterable datasets require "
                          f"`dispatch_batches=False`, but it is set to `True` in `accelerator_config`. Please set it "
                          f"to `False`.")


def note_map_style_workers(args, accelerator) -> None:
    """dataloader_num_workers with a map-style train_dataset: said once that it has nothing to do."""
    if args.dataloader_num_workers and accelerator.is_main_process:
        logger.info("dataloader_num_workers applies to a streamed train_dataset: this one was tokenized before "
                    "training and its batches are collated from memory, so no worker is started.")


def save_data_position(batches, folder: str, process_index: int) -> None:
    """A checkpoint's record of where the training data is (a stream's position; nothing for rows in memory)."""
    state = batches.state()
    if state is not None:
        with open(os.path.join(folder, f"data-position-{process_index}.json"), "w") as f:
            json.dump(state, f)


def load_data_position(batches, folder: str, process_index: int) -> None:
    """Continue a stream from the position a checkpoint recorded (rows in memory need none)."""
    if batches.state() is None:  # rows in memory: their order is a function of the step
        return
    path = os.path.join(folder, f"data-position-{process_index}.json")
    if not os.path.exists(path):
        raise CheckpointError(f"{folder} records no position in a streamed train_dataset (it was written by a run on "
                              f"a map-style dataset?): resume with the training data the checkpoint was written with.")
    with open(path) as f:
        batches.restore(json.load(f))


@dataclass
class StreamPosition:
    """Where a stream is: what a checkpoint saves to resume exactly."""

    epoch: int = 0  # passes over the stream started so far, minus one
    chunk_start: int = 0  # raw rows of this epoch before the current chunk
    offset: int = 0  # prepared rows of the current chunk already handed out
    batches: int = 0  # global batches handed out (the next one asked for is this one)


@dataclass
class Chunk:
    """``raw`` rows read from the stream at raw row ``start`` of ``epoch``, prepared into ``rows``; an empty chunk
    with ``epoch_end`` marks the end of a pass over the stream."""

    epoch: int
    start: int
    raw: list = field(default_factory=list)
    rows: list = field(default_factory=list)
    epoch_end: bool = False


class IndexedBatches:
    """Rows prepared in memory, in the order of a ``GlobalBatchSampler`` (trainers.data.samplers)."""

    def __init__(self, rows: list, sampler):
        self.rows, self.sampler = rows, sampler

    def batch(self, step: int) -> list:
        return [self.rows[i] for i in self.sampler.batch(step)]

    def state(self) -> dict | None:
        return None  # the order is a function of the step: nothing to save

    def restore(self, state: dict | None) -> None:
        pass


class StreamedBatches:
    """Global batches of ``batch_size`` prepared rows, read in order from ``stream`` (module docstring).

    ``prepare(raw_rows, first_index)`` turns a chunk of raw rows (raw row ``first_index`` of the epoch onwards) into
    prepared rows (possibly fewer, or more); it may run in a background thread. ``validate(rows, first_index)``, set
    once the model is known, checks a prepared chunk in the calling thread when it is first used (the chunk read at
    construction is checked when it is set). ``agree(fingerprint)``, given with several processes, raises unless
    every process passed the same fingerprint. Batches are asked for in order: the next one, or the last one again."""

    def __init__(self, stream, prepare: Callable[[list, int], list], batch_size: int, name: str, *,
                 drop_last: bool = False, workers: int = 0, prefetch_factor: int | None = None,
                 agree: Callable[[int], None] | None = None, chunk_rows: int | None = None):
        self.stream, self.prepare, self.batch_size, self.name = stream, prepare, batch_size, name
        self.drop_last, self.workers, self.agree = drop_last, workers, agree
        self.depth = workers * (prefetch_factor or 2)  # chunks prepared ahead (torch's DataLoader default: 2 each)
        self.chunk_rows = chunk_rows or CHUNK_ROWS
        self._validate: Callable[[list, int], None] | None = None
        self._prefetch: _Prefetch | None = None
        self._last: tuple[int, list] | None = None  # the last batch handed out (asked again for each micro-step)
        self.restore(None)  # reads and prepares the first chunk now: a malformed or empty stream fails before training

    # ------------------------------------------------------------------ the interface

    def batch(self, step: int) -> list:
        """The prepared rows of global batch ``step``: the next one, or the last one again."""
        if self._last is not None and self._last[0] == step:
            return self._last[1]
        position = self.position
        if step != position.batches:
            raise RuntimeError(f"{self.name}: batch {step} was asked for, but a stream is read in order and the next "
                               f"batch is {position.batches}.")
        rows: list = []
        while len(rows) < self.batch_size:
            chunk = self._chunk
            if chunk.epoch_end:
                if not self._epoch_rows:
                    raise DatasetFormatError(f"{self.name}: a whole pass over the stream gave no row to train on "
                                             f"(each row was empty or had no token to train on).")
                if self.drop_last:
                    if not self._epoch_batches:
                        raise DatasetFormatError(
                            f"{self.name}: one pass over the stream gives {self._epoch_rows} rows, fewer than one "
                            f"global batch of {self.batch_size}, and dataloader_drop_last=True drops the last "
                            f"incomplete one: nothing would be trained.")
                    rows = []  # the epoch's last incomplete batch
                self._next_chunk()
                continue
            if position.offset >= len(chunk.rows):  # used up: the next one (only now, when rows are needed)
                self._next_chunk()
                continue
            taken = chunk.rows[position.offset: position.offset + self.batch_size - len(rows)]
            rows += taken
            position.offset += len(taken)
            self._epoch_rows += len(taken)
        position.batches += 1
        self._epoch_batches += 1
        if self.agree is not None:  # every process must hold the same batch (e.g. an unseeded shuffle would not)
            self.agree(zlib.crc32(repr(rows).encode()))
        self._last = (step, rows)
        return rows

    def state(self) -> dict:
        """What a checkpoint saves: the position after the last batch handed out."""
        return asdict(self.position)

    def restore(self, state: dict | None) -> None:
        """Continue from a saved position (None: from the start): the raw rows before its chunk are skipped
        unprepared, its chunk is prepared again and its used rows skipped."""
        if self._prefetch is not None:
            self._prefetch.close()
            self._prefetch = None
        saved = StreamPosition(**state) if state else StreamPosition()
        self._raw = self._raw_chunks(saved.epoch, saved.chunk_start)
        self.position = StreamPosition(epoch=saved.epoch, chunk_start=saved.chunk_start, batches=saved.batches)
        self._epoch_rows = self._epoch_batches = int(bool(saved.chunk_start or saved.offset))  # resumed mid-epoch
        self._last = None
        self._next_chunk(start_prefetch=False)
        if saved.offset > len(self._chunk.rows):
            raise DatasetFormatError(
                f"{self.name}: the checkpoint's position (epoch {saved.epoch}, {saved.offset} prepared rows of the "
                f"chunk at raw row {saved.chunk_start}) is past what the stream gives there now; resume with the "
                f"same stream (same data, same shuffle seed and buffer) and the same data options.")
        self.position.offset = saved.offset

    @property
    def validate(self) -> Callable[[list, int], None] | None:
        return self._validate

    @validate.setter
    def validate(self, check: Callable[[list, int], None]) -> None:
        self._validate = check
        if not self._chunk.epoch_end:
            check(self._chunk.rows, self._chunk.start)

    # ------------------------------------------------------------------ reading

    def _raw_chunks(self, epoch: int, start: int) -> Iterator[Chunk]:
        """Chunks of raw rows from raw row ``start`` of ``epoch`` on, pass after pass, each pass ending with an
        ``epoch_end`` marker; the first ``start`` rows are read and dropped, not prepared."""
        while True:
            if hasattr(self.stream, "set_epoch"):
                self.stream.set_epoch(epoch)
            rows = iter(self.stream)
            skipped = sum(1 for _ in itertools.islice(rows, start))
            if skipped < start:
                raise DatasetFormatError(
                    f"{self.name}: the checkpoint's position is raw row {start} of pass {epoch} over the stream, "
                    f"but that pass has only {skipped} rows; resume with the same stream.")
            read = start
            while True:
                raw = list(itertools.islice(rows, self.chunk_rows))
                if not raw:
                    break
                yield Chunk(epoch, read, raw)
                read += len(raw)
            if read == 0:
                raise DatasetFormatError(f"{self.name} is empty: the stream gave no rows.")
            yield Chunk(epoch, read, epoch_end=True)
            epoch, start = epoch + 1, 0

    def _prepared(self, chunk: Chunk) -> Chunk:
        if not chunk.epoch_end:
            chunk.rows = list(self.prepare(chunk.raw, chunk.start))
            chunk.raw = []  # not needed any more
        return chunk

    def _next_chunk(self, start_prefetch: bool = True) -> None:
        """Make the next chunk the current one (prepared, and validated once the model is known)."""
        if self.workers and start_prefetch and self._prefetch is None:
            self._prefetch = _Prefetch(self._raw, self._prepared, self.workers, self.depth)
        chunk = self._prefetch.next() if self._prefetch is not None else self._prepared(next(self._raw))
        if chunk.epoch != self.position.epoch:  # a new pass over the stream
            self._epoch_rows = self._epoch_batches = 0
        self._chunk = chunk
        self.position.epoch, self.position.chunk_start, self.position.offset = chunk.epoch, chunk.start, 0
        if self._validate is not None and not chunk.epoch_end:
            self._validate(chunk.rows, chunk.start)


class _Prefetch:
    """Chunks prepared ahead in background threads, handed out in order: a reader thread takes raw chunks from
    ``chunks`` in order and submits ``prepare`` to a pool of ``workers`` threads; up to ``depth`` prepared (or
    in preparation) chunks wait in a queue. An error in either surfaces at ``next()``."""

    def __init__(self, chunks: Iterator[Chunk], prepare: Callable[[Chunk], Chunk], workers: int, depth: int):
        self.pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="trainers-data")
        self.ready: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self.stopped = threading.Event()
        self.reader = threading.Thread(target=self._read, args=(chunks, prepare), daemon=True,
                                       name="trainers-data-reader")
        self.reader.start()

    def _read(self, chunks: Iterator[Chunk], prepare: Callable[[Chunk], Chunk]) -> None:
        while not self.stopped.is_set():
            try:
                future, failed = self.pool.submit(prepare, next(chunks)), False
            except Exception as error:  # the stream failed: hand the error over in order; nothing follows
                future, failed = concurrent.futures.Future(), True
                future.set_exception(error)
            while not self.stopped.is_set():
                try:
                    self.ready.put(future, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if failed:
                return

    def next(self) -> Chunk:
        return self.ready.get().result()

    def close(self) -> None:
        self.stopped.set()
        while not self.ready.empty():
            self.ready.get_nowait()
        self.reader.join()
        self.pool.shutdown(wait=True, cancel_futures=True)


class PerThread:
    """A copy of ``value`` for each thread but the one that made it (e.g. a fast tokenizer, which one thread at a
    time may use): what a ``prepare`` running in several worker threads needs."""

    def __init__(self, value):
        self.value, self.owner, self.local = value, threading.get_ident(), threading.local()

    def get(self):
        if threading.get_ident() == self.owner:
            return self.value
        if not hasattr(self.local, "value"):
            self.local.value = copy.deepcopy(self.value)
        return self.local.value
