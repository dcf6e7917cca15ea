"""The typed records a round travels in: ``Rollout`` (one generation round's rows on this process, built by
the rollout stage, trainers/sampling/rollout.py, with ``padded_rollout``) and ``MicroBatch`` (the slice of it one
forward/backward trains on).

A round is sampled and scored once and then serves ``steps_per_generation`` micro-steps, ``num_iterations``
times over; each micro-batch is a contiguous slice with its all-padding columns trimmed, or, with
token_budget, a group of a step's rows of at most that many tokens (``budget_groups``). Rows that share a
prompt are known from the start (``prompt_groups``) and carried on both records, so the shared prompt forward
(trainers/sampling/shared_prompt.py) needs no search for them.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from trainers.parallel import distributed as dist
from trainers.errors import ConfigError
from trainers.generation.rows import prompt_groups, round_up
from trainers.generation.sampling import Samples, ended, left_pad, right_pad
from trainers.logs import logger
from trainers.model.modeling import positions_from_mask
from trainers.data.packing import pack_bfd, split_to_count


@dataclass(frozen=True)
class RowWidths:
    """What slicing a round into micro-batches reads, per row, as host integers: read from the round's masks once
    (one device-to-host copy per round), so that building each micro-batch reads no device tensor (on a GPU, each
    read would stall the host until the device catches up)."""

    prompt_spans: list[int]  # P - the row's first real prompt column; 0 for a row without prompt tokens
    completion_lengths: list[int]  # the row's real completion tokens
    groups: list[int]  # the row's distinct prompt (``prompt_group``)

    @classmethod
    def of(cls, prompt_mask: torch.Tensor, completion_attention: torch.Tensor, prompt_group: torch.Tensor
           ) -> "RowWidths":
        """prompt_mask [N, P], completion_attention [N, C], prompt_group [N] -> their widths, in one host copy."""
        N, P = prompt_mask.shape
        real = prompt_mask != 0  # [N, P]
        # [N]: P - the first real column (argmax takes the first maximum), 0 for a row without prompt tokens
        spans = torch.where(real.any(1), P - real.int().argmax(1), 0) if P else real.new_zeros(N, dtype=torch.long)
        lengths = (completion_attention != 0).sum(1)  # [N]
        table = torch.stack([spans.long(), lengths.long(), prompt_group.to(spans.device).long()]).tolist()  # [3, N]
        return cls(*table)

    def subset(self, index: Sequence[int]) -> "RowWidths":
        return RowWidths(*([values[i] for i in index] for values in
                           (self.prompt_spans, self.completion_lengths, self.groups)))

    def lengths(self) -> list[int]:
        """Each row's real tokens, prompt (a left-padded prompt's are its span) and completion."""
        return [span + length for span, length in zip(self.prompt_spans, self.completion_lengths)]

    def counts(self) -> tuple[int, int]:
        """What a padding-free forward of these rows keeps and scores (trainers/sampling/packed_forward.py): (real
        tokens, completion tokens predicted from a real position: all but the first of a row without prompt
        tokens)."""
        unpredicted = sum(1 for span, length in zip(self.prompt_spans, self.completion_lengths) if not span and length)
        return sum(self.lengths()), sum(self.completion_lengths) - unpredicted

    def columns(self, P: int, C: int, multiple: int | None = None) -> tuple[int, int]:
        """The first prompt column that is not padding in every row, and the completion width that is (at least
        1), of [., P] left-padded prompts and [., C] right-padded completions. With ``multiple``
        (pad_to_multiple_of; P and C are multiples of it), as few padding columns are kept as make both kept
        widths multiples of it too."""
        span = max(self.prompt_spans, default=0)
        first = P - span if span else P - 1
        width = max(max(self.completion_lengths, default=0), 1)
        if multiple:
            first = P - min(P, round_up(P - first, multiple))
            width = min(C, round_up(width, multiple))
        return first, width


class RowRole(enum.IntEnum):
    """A row's part in a training forward with skip_zero_gradient_rows (``LogProbScorer.training_forward``)."""

    NO_LOSS = 0  # no loss tokens: not forwarded at all
    NO_GRADIENT = 1  # its loss has no gradient (advantage 0, ...): forwarded without one, for its logged entropy
    TRAINED = 2


@dataclass(frozen=True)
class Rollout:
    """One generation round's rows on this process (N = per_device_train_batch_size x steps_per_generation)."""

    prompt_ids: torch.Tensor  # [N, P] left-padded
    prompt_mask: torch.Tensor  # [N, P]
    completion_ids: torch.Tensor  # [N, C] right-padded
    completion_attention: torch.Tensor  # [N, C] 1 on real completion tokens
    prompt_group: torch.Tensor  # [N] long: the row's distinct prompt, 0..U-1 (``prompt_groups``)
    loss_mask: torch.Tensor  # [N, C] float: tokens that count in the loss
    advantages: torch.Tensor  # [N]
    old_logps: torch.Tensor | None = None  # [N, C] under the policy that sampled (None: equal to the current ones)
    ref_logps: torch.Tensor | None = None  # [N, C] under the reference model (beta > 0)
    # a rollout function's log-probs: [N, C], NaN where it gave none; and the loss's importance weights
    # pi_old / pi_sampler for them (vllm_importance_sampling_correction): [N, C] per token, [N, 1] per completion
    sampler_logps: torch.Tensor | None = None
    sampler_weights: torch.Tensor | None = None
    # pad_to_multiple_of: P and C are multiples of it, and so are the widths of the rows' slices (``rows``)
    pad_to_multiple_of: int | None = None
    # the rows' widths as host integers: read from the masks when the round is built, passed on to its slices
    widths: RowWidths | None = field(default=None, compare=False, repr=False)
    # skip_zero_gradient_rows: each row's RowRole as host integers, read once when the round is built
    # (``with_roles``). Not copied by dataclasses.replace, whose copy may have other advantages or masks: None
    # there, read from the micro-batch when it is trained.
    roles: list[int] | None = field(default=None, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.widths is None:  # a new round (or one restored from a checkpoint): its one device-to-host copy
            object.__setattr__(self, "widths", RowWidths.of(self.prompt_mask, self.completion_attention,
                                                            self.prompt_group))

    def rows(self, index: torch.Tensor, host_index: Sequence[int] | None = None):
        """Some of the rows (``index``: [b] indices; ``host_index``: the same as host integers, else read from
        ``index``), as the same type, all-padding columns trimmed and prompt groups renumbered: from ``widths``,
        without reading the masks."""
        host_index = index.tolist() if host_index is None else list(host_index)
        widths = self.widths.subset(host_index)
        first, width = widths.columns(self.prompt_mask.shape[1], self.completion_attention.shape[1],
                                      self.pad_to_multiple_of)
        fields = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not f.init:  # roles: below
                continue
            if not isinstance(value, torch.Tensor) or value.dim() == 0:
                fields[f.name] = value
            elif f.name in ("prompt_ids", "prompt_mask"):
                fields[f.name] = value[index, first:]
            elif value.dim() == 2 and value.shape[1] > 1:  # per completion token
                fields[f.name] = value[index, :width]
            else:  # per row
                fields[f.name] = value[index]
        groups = prompt_groups([[g] for g in widths.groups])  # renumbered 0..U-1 in order of first appearance
        fields["prompt_group"] = torch.tensor(groups, dtype=torch.long, device=self.prompt_group.device)
        # the trimmed prompt columns change no span: the spans fit in the kept P - first columns
        fields["widths"] = RowWidths(widths.prompt_spans, widths.completion_lengths, groups)
        return type(self)(**fields).with_roles(None if self.roles is None else [self.roles[i] for i in host_index])

    def with_roles(self, roles: list[int] | None) -> "Rollout":
        """A copy whose rows have these ``RowRole``s (as host integers, in row order)."""
        copy = dataclasses.replace(self)
        object.__setattr__(copy, "roles", roles)
        return copy

    def init_fields(self) -> dict:
        """The fields a constructor takes (all but ``roles``), by name."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}

    def micro_batch(self, start: int, end: int, count_tokens: bool = True) -> "MicroBatch":
        """Rows [start, end), all-padding columns trimmed. ``count_tokens=False``: a round trained on again
        (num_iterations > 1), whose tokens were counted the first time."""
        return self.micro_batch_of(range(start, end), count_tokens)

    def micro_batch_of(self, index: Sequence[int], count_tokens: bool = True) -> "MicroBatch":
        """The rows ``index`` (ascending) as a micro-batch, as ``micro_batch``."""
        rows = self.rows(torch.tensor(list(index), dtype=torch.long, device=self.advantages.device), index)
        tokens = float(sum(rows.widths.lengths())) if count_tokens else 0.0  # from the host widths
        batch = MicroBatch(**rows.init_fields(), num_input_tokens=tokens, num_padded_tokens=tokens)
        return batch.with_roles(rows.roles)

    def row_lengths(self) -> list[int]:
        """Each row's real tokens, prompt and completion: what it costs a padding-free forward. [N] ints."""
        return self.widths.lengths()

    def model_inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """prompt + completion -> (input_ids, attention_mask, position_ids), each [N, P + C]; positions count
        real tokens only (``positions_from_mask``)."""
        input_ids = torch.cat([self.prompt_ids, self.completion_ids], dim=1)
        attention_mask = torch.cat([self.prompt_mask, self.completion_attention], dim=1)
        return input_ids, attention_mask, positions_from_mask(attention_mask)

    def to(self, device):
        moved = type(self)(**{k: v.to(device) if isinstance(v, torch.Tensor) else v
                              for k, v in self.init_fields().items()})
        return moved.with_roles(self.roles)


def padded_rollout(samples: Samples, pad_id: int, multiple: int | None, eos_ids: set[int],
                   mask_truncated: bool) -> tuple[Rollout, torch.Tensor, torch.Tensor]:
    """The one way samples become a ``Rollout`` (training rounds, evaluation batches and distillation's dataset
    rounds alike): padded (P and C multiples of ``multiple``, pad_to_multiple_of: TRL's padding; the extra columns
    are masked), the loss mask of the tokens the model wrote (less truncated completions with
    ``mask_truncated``: mask_truncated_completions), advantages 0 until they are computed. Returns it with
    ``truncated`` ([n] bool: the completion did not end) and ``model_tokens`` ([n, C]: 1 on the tokens the model
    wrote, which a sampler's ``model_mask`` says; tool outputs are not), which the round's metrics read."""
    prompt_ids, prompt_mask = left_pad(samples.prompt_ids, pad_id, multiple)  # [n, P]
    completion_ids, attention = right_pad(samples.completion_ids, pad_id, multiple=multiple)  # [n, C]
    # [n]: as the backend (or the tool loop) says; else TRL's rule, a completion with an EOS anywhere ended
    finished = samples.finished or [ended(c, eos_ids, anywhere=True) for c in samples.completion_ids]
    truncated = ~torch.tensor(finished, dtype=torch.bool)
    model_tokens = attention
    if samples.model_mask is not None:
        model_tokens = right_pad(samples.model_mask, 0, width=completion_ids.shape[1])[0]
    loss_mask = model_tokens.float()  # [n, C]
    if mask_truncated:
        loss_mask[truncated] = 0.0
    groups = torch.tensor(prompt_groups(samples.prompt_ids), dtype=torch.long)  # [n]
    rollout = Rollout(prompt_ids, prompt_mask, completion_ids, attention, groups, loss_mask,
                      torch.zeros(len(completion_ids)), pad_to_multiple_of=multiple)
    return rollout, truncated, model_tokens


@dataclass(frozen=True)
class MicroBatch(Rollout):
    """What one forward/backward of GRPO reads: B rows of a round (the fields above, with B for N), and the tokens
    they count. include_num_input_tokens_seen: TRL's GRPO counts the real prompt and completion tokens; a round
    trained on again (num_iterations > 1) counts them once, as in TRL."""

    num_input_tokens: torch.Tensor | float = 0.0  # 0-d, or a host number (a round's slices: from its widths)
    num_padded_tokens: torch.Tensor | float = 0.0  # the same (GRPO's forward has no padding it counts)


@dataclass(frozen=True)
class RoundPart:
    """Rows of one round that one optimizer step trains on (or that one scoring pass reads): rows ``rows`` of
    ``rollout``; ``count_tokens`` as in ``Rollout.micro_batch``."""

    rollout: Rollout
    rows: range
    count_tokens: bool = True


def budget_groups(accelerator, parts: list[RoundPart], budget: int) -> list[tuple[RoundPart, list[int]]]:
    """GRPOConfig.token_budget: the rows of ``parts`` regrouped into groups of at most ``budget`` real tokens
    each (best-fit decreasing, never across parts; a row longer than the budget alone, with a warning), then cut
    (``split_to_count``) until every process has as many as the process with the most: a forward is a
    collective under ZeRO-3 and FSDP, and each process makes the same number of backward calls. Returns each
    group's part and its rows of the part's round (ascending)."""
    items = [(part, row) for part in parts for row in part.rows]  # item i: (its part, its row of the round)
    lengths = [length for part in parts for length in part.rollout.row_lengths()[part.rows.start:part.rows.stop]]
    bins, first = [], 0
    for part in parts:
        n = len(part.rows)
        bins += [[first + i for i in sorted(b)] for b in pack_bfd(lengths[first:first + n], budget)]
        first += n
    if any(length > budget for length in lengths):
        logger.warning(f"token_budget={budget}: a completion with its prompt has {max(lengths)} tokens, more than "
                       f"the budget; it is forwarded alone. Raise token_budget to keep every forward within it.")
    count = int(dist.all_reduce_max(accelerator, torch.tensor(len(bins), device=accelerator.device)))
    return [(items[b[0]][0], [items[i][1] for i in b]) for b in split_to_count(bins, lengths, count)]


def budget_micro_batches(accelerator, parts: list[RoundPart], budget: int) -> list[MicroBatch]:
    """``budget_groups`` as micro-batches."""
    groups = budget_groups(accelerator, parts, budget)
    return [part.rollout.micro_batch_of(rows, part.count_tokens) for part, rows in groups]


def round_shape(args, per_device: int, world: int) -> tuple[int, int]:
    """(steps_per_generation, generation_batch_size): the micro-steps a generation round serves and its
    completions over every process, from GRPOConfig's generation_batch_size or steps_per_generation (TRL's
    rules). ``per_device``: completions per process per micro-step."""
    per_step = per_device * world  # completions per micro-step, all processes
    if args.generation_batch_size is not None:
        if args.generation_batch_size % per_step:
            raise ConfigError(
                f"generation_batch_size={args.generation_batch_size} must be a multiple of "
                f"per_device_train_batch_size x processes = {per_device} x {world} = {per_step}.")
        steps = args.generation_batch_size // per_step
    else:
        steps = args.steps_per_generation or args.gradient_accumulation_steps
    size = per_step * steps
    if size % args.num_generations:
        raise ConfigError(
            f"generation_batch_size = per_device_train_batch_size x processes x steps_per_generation = "
            f"{per_device} x {world} x {steps} = {size} completions per round is not a multiple of num_generations="
            f"{args.num_generations}; each prompt needs all its {args.num_generations} completions in one round.")
    return steps, size

