"""Which rows each process trains on at each step: a pure function of (seed, step), so every process agrees
without talking, and a resumed run continues exactly where it stopped (no sampler state to save).

Within an optimizer step the global batch is laid out as [accumulation step][process][row]:
micro-batch ``a`` of process ``p`` is rows ``[(a * P + p) * B, (a * P + p + 1) * B)`` of the global batch.

The last two functions read a config: how many rows each process takes per micro-batch (``per_process_batch_size``),
and the training order its data-order options ask for (``training_sampler``, BaseTrainer.batch_sampler).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from trainers.errors import ConfigError
from trainers.logs import logger

if TYPE_CHECKING:
    from trainers.config.training import TrainingConfig


def local_slice(global_batch: list[int], accumulation_index: int, process_index: int, per_device: int,
                num_processes: int) -> list[int]:
    """The rows of ``global_batch`` that process ``process_index`` uses in micro-step ``accumulation_index``."""
    start = (accumulation_index * num_processes + process_index) * per_device
    return global_batch[start : start + per_device]


class GlobalBatchSampler:
    """Splits each epoch's (shuffled) row order into global batches of ``global_batch`` rows.

    When the row count is not a multiple of the global batch, the last batch of an epoch is topped up with the
    first rows of the same epoch's order, so every row is trained on at least once per epoch and every
    micro-batch has the same size (which DDP and DeepSpeed need). With ``drop_last`` it is dropped instead:
    ``dropped_per_epoch`` rows of each epoch's order go unused (different ones each epoch when shuffled).
    """

    def __init__(self, num_rows: int, global_batch: int, seed: int, shuffle: bool = True, drop_last: bool = False,
                 lengths: Sequence[int] | None = None):
        if num_rows <= 0:
            raise ValueError("cannot sample from an empty dataset")
        self.num_rows, self.global_batch, self.seed, self.shuffle = num_rows, global_batch, seed, shuffle
        self.lengths = lengths  # given: batches of similar lengths (group_by_length)
        self.steps_per_epoch = num_rows // global_batch if drop_last else math.ceil(num_rows / global_batch)
        if self.steps_per_epoch == 0:
            raise ValueError(f"{num_rows} rows are fewer than one global batch of {global_batch}, and the last "
                             f"incomplete batch is dropped: nothing would be trained")
        self.padding_per_epoch = max(0, self.steps_per_epoch * global_batch - num_rows)
        self.dropped_per_epoch = max(0, num_rows - self.steps_per_epoch * global_batch)
        self._cached: tuple[int, list[int]] | None = None

    def epoch_order(self, epoch: int) -> list[int]:
        if self._cached is None or self._cached[0] != epoch:
            if self.shuffle:
                generator = torch.Generator().manual_seed(self.seed + epoch)
                order = torch.randperm(self.num_rows, generator=generator).tolist()
            else:
                order = list(range(self.num_rows))
            if self.lengths is not None:
                order = length_grouped_order(order, self.lengths, self.global_batch)
            needed = self.steps_per_epoch * self.global_batch
            while len(order) < needed:  # top up (possibly several times when rows < one global batch)
                order += order[: needed - len(order)]
            self._cached = (epoch, order)
        return self._cached[1]

    def batch(self, step: int) -> list[int]:
        """Row indices of the global batch of optimizer step ``step`` (0-based)."""
        epoch, offset = divmod(step, self.steps_per_epoch)
        order = self.epoch_order(epoch)
        return order[offset * self.global_batch : (offset + 1) * self.global_batch]


def length_grouped_order(order: list[int], lengths: Sequence[int], batch: int) -> list[int]:
    """transformers' group_by_length (get_length_grouped_indices) on a given order: cut it into mega-batches of
    ``mult x batch`` rows (mult = 50, or fewer to make at least 4 mega-batches), sort each by length, longest
    first, and move the longest row of all to the front, so that running out of memory happens at the first step.
    Consecutive slices of ``batch`` rows, and so the micro-batches within them, then hold rows of similar length
    (less padding)."""
    size = max(1, min(len(order) // (batch * 4), 50)) * batch
    megabatches = [sorted(order[i:i + size], key=lambda row: lengths[row], reverse=True)
                   for i in range(0, len(order), size)]
    longest = max(range(len(megabatches)), key=lambda m: lengths[megabatches[m][0]])
    megabatches[0][0], megabatches[longest][0] = megabatches[longest][0], megabatches[0][0]
    return [row for megabatch in megabatches for row in megabatch]


def group_slots(prompts: list[int], num_generations: int, num_processes: int, process_index: int) -> list[int]:
    """GRPO's layout of one generation round: every prompt repeated ``num_generations`` times (a group is
    contiguous), then split into equal contiguous shares, one per process. A group may straddle two
    processes; its rewards are gathered before advantages are computed, so that changes nothing.

    Returns the prompt (row) index of each completion this process generates.
    """
    slots = [p for p in prompts for _ in range(num_generations)]
    if len(slots) % num_processes:
        raise ValueError(f"{len(slots)} completions cannot be split evenly over {num_processes} processes")
    share = len(slots) // num_processes
    return slots[process_index * share:(process_index + 1) * share]


def per_process_batch_size(args: TrainingConfig, option: str, num_processes: int) -> int:
    """The rows each process takes per micro-batch for the per_device_* batch ``option``: the option itself, or
    with accelerator_config's split_batches (the option counts all processes' rows) its share, which must be whole."""
    size = getattr(args, option)
    if not args.split_batches:
        return size
    if size % num_processes:
        raise ConfigError(f"{type(args).__name__}: `{option}={size}` with accelerator_config's split_batches=True is "
                          f"split among {num_processes} processes, so it must be a multiple of {num_processes}.")
    return size // num_processes


def training_sampler(args: TrainingConfig, lengths: list[int], batch: int, unit: str, log: bool = True
                     ) -> GlobalBatchSampler:
    """The training order of rows of these ``lengths`` in batches of ``batch`` rows (``unit`` names such a batch
    in messages): reshuffled every epoch (train_sampling_strategy="random" with shuffle_dataset), in dataset
    order ("sequential"), or in batches of similar lengths ("group_by_length"); the last incomplete batch
    filled up from the epoch's start or, with dataloader_drop_last, dropped. ``log``: say so when rows are
    repeated or left out (on the main process)."""
    name, num_rows = type(args).__name__, len(lengths)
    if args.dataloader_drop_last and num_rows < batch:
        raise ConfigError(f"{name}: `dataloader_drop_last=True` drops each epoch's last incomplete {unit}, and "
                          f"train_dataset's {num_rows} rows are fewer than one {unit} ({batch} rows): nothing "
                          f"would be trained. Use a smaller batch, or dataloader_drop_last=False.")
    strategy = args.train_sampling_strategy
    sampler = GlobalBatchSampler(num_rows, batch, args.data_order_seed,
                                 shuffle=args.shuffle_dataset and strategy != "sequential",
                                 drop_last=args.dataloader_drop_last,
                                 lengths=lengths if strategy == "group_by_length" else None)
    if log and (sampler.padding_per_epoch or sampler.dropped_per_epoch):
        what = (f"leaves out {sampler.dropped_per_epoch} rows (dataloader_drop_last=True)"
                if args.dataloader_drop_last else f"repeats {sampler.padding_per_epoch} rows to fill its last one")
        logger.info(f"train_dataset's {num_rows} rows are not a multiple of the {unit} ({batch} rows): each "
                    f"epoch {what}.")
    return sampler
