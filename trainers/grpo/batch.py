"""The typed records a GRPO round travels in: ``Rollout`` (one generation round's rows on this process, built by
the rollout stage, trainers/grpo/rollout.py) and ``MicroBatch`` (the slice of it one forward/backward trains on).

A round is sampled and scored once and then serves ``steps_per_generation`` micro-steps, ``num_iterations``
times over; each micro-batch is a contiguous slice with its all-padding columns trimmed. Rows that share a
prompt are known from the start (``prompt_groups``) and carried on both records, so the shared prompt forward
(trainers/grpo/shared_prompt.py) needs no search for them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from trainers.errors import ConfigError
from trainers.generation.rows import prompt_groups, round_up
from trainers.modeling import positions_from_mask


def renumbered(groups: torch.Tensor) -> torch.Tensor:
    """Group ids of a subset of rows, renumbered 0..U-1 in order of first appearance. groups: [B] -> [B]."""
    values = groups.tolist()
    return torch.tensor(prompt_groups([[v] for v in values]), dtype=torch.long, device=groups.device)


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

    def rows(self, index: torch.Tensor):
        """Some of the rows (``index``: [b] indices), as the same type, all-padding columns trimmed and prompt
        groups renumbered."""
        first, width = unpadded_columns(self.prompt_mask[index], self.completion_attention[index],
                                        self.pad_to_multiple_of)
        fields = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, torch.Tensor) or value.dim() == 0:
                fields[f.name] = value
            elif f.name in ("prompt_ids", "prompt_mask"):
                fields[f.name] = value[index, first:]
            elif value.dim() == 2 and value.shape[1] > 1:  # per completion token
                fields[f.name] = value[index, :width]
            else:  # per row
                fields[f.name] = value[index]
        fields["prompt_group"] = renumbered(self.prompt_group[index])
        return type(self)(**fields)

    def micro_batch(self, start: int, end: int, count_tokens: bool = True) -> "MicroBatch":
        """Rows [start, end), all-padding columns trimmed. ``count_tokens=False``: a round trained on again
        (num_iterations > 1), whose tokens were counted the first time."""
        rows = self.rows(torch.arange(start, end, device=self.advantages.device))
        tokens = rows.prompt_mask.sum() + rows.completion_attention.sum()
        tokens = tokens if count_tokens else tokens * 0
        return MicroBatch(**rows.__dict__, num_input_tokens=tokens, num_padded_tokens=tokens)

    def model_inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """prompt + completion -> (input_ids, attention_mask, position_ids), each [N, P + C]; positions count
        real tokens only (``positions_from_mask``)."""
        input_ids = torch.cat([self.prompt_ids, self.completion_ids], dim=1)
        attention_mask = torch.cat([self.prompt_mask, self.completion_attention], dim=1)
        return input_ids, attention_mask, positions_from_mask(attention_mask)

    def to(self, device):
        return type(self)(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in self.__dict__.items()})


@dataclass(frozen=True)
class MicroBatch(Rollout):
    """What one forward/backward of GRPO reads: B rows of a round (the fields above, with B for N), and the tokens
    they count. include_num_input_tokens_seen: TRL's GRPO counts the real prompt and completion tokens; a round
    trained on again (num_iterations > 1) counts them once, as in TRL."""

    num_input_tokens: torch.Tensor | float = 0.0  # 0-d
    num_padded_tokens: torch.Tensor | float = 0.0  # 0-d: the same (GRPO's forward has no padding it counts)


def unpadded_columns(prompt_mask: torch.Tensor, completion_attention: torch.Tensor,
                     multiple: int | None = None) -> tuple[int, int]:
    """The first prompt column that is not padding in every row, and the completion width that is (at least 1).
    prompt_mask: [B, P] left-padded; completion_attention: [B, C] right-padded. With ``multiple``
    (pad_to_multiple_of; P and C are multiples of it), as few padding columns are kept as make both kept widths
    multiples of it too."""
    P, C = prompt_mask.shape[1], completion_attention.shape[1]
    first = int((prompt_mask.sum(0) > 0).nonzero()[0]) if prompt_mask.any() else P - 1
    width = max(int(completion_attention.sum(1).max()), 1)
    if multiple:
        first = P - min(P, round_up(P - first, multiple))
        width = min(C, round_up(width, multiple))
    return first, width


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

