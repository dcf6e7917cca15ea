"""Sampling from the policy itself, and what every backend shares: the sampling parameters (``SamplingParams``),
a backend's answer (``Samples``), padding, cutting at EOS, HF ``generate``, the lean engine's dispatch, and
``PolicySampler`` (the policy being trained, eval mode, under the training forward's autocast, ZeRO-3 gathered).
The backend interface with its lifetime and the registry are in trainers/generation/backend.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from trainers.parallel import distributed as dist
from trainers.generation.rows import round_up


@dataclass(frozen=True)
class SamplingParams:
    """How completions are drawn. ``do_sample=False`` is greedy decoding (evaluation)."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: disabled
    min_p: float | None = None
    repetition_penalty: float = 1.0
    do_sample: bool = True
    extra: dict = field(default_factory=dict)  # GRPOConfig.generation_kwargs


@dataclass(frozen=True)
class Samples:
    """A sampler's answer for N prompts: one completion each."""

    prompt_ids: list[list[int]]  # the prompts as trained on (a rollout function may return its own)
    completion_ids: list[list[int]]  # each cut after its first EOS (or max_completion_length long)
    logprobs: list[list[float]] | None = None  # the sampler's, per completion token (NaN: a token it did not score)
    model_mask: list[list[int]] | None = None  # per completion token: 1 the model wrote it, 0 an environment did
    extra: dict[str, list] = field(default_factory=dict)  # per-row values for the reward functions
    # per completion: it ended (an EOS) rather than being cut by the token budget, as the backend knows it; None:
    # the rollout stage applies TRL's rule (an EOS anywhere)
    finished: list[bool] | None = None
    # per completion token: the weight version (optimizer step) that sampled it, None for a token the model did not
    # write (a tool result); None: the backend does not say (asynchronous GRPO's in-flight weight updates need it)
    versions: list[list[int | None]] | None = None


def left_pad(sequences: list[list[int]], pad_id: int, multiple: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (ids [N, P], mask [N, P]) with padding on the left, as generation wants; P a multiple of ``multiple``
    (pad_to_multiple_of) when given."""
    width = round_up(max(len(s) for s in sequences), multiple)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        if seq:
            ids[row, width - len(seq):] = torch.tensor(seq)
            mask[row, width - len(seq):] = 1
    return ids, mask


def right_pad(sequences: list[list[int]], pad_id: int, width: int | None = None,
              multiple: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (ids [N, C], mask [N, C]) with padding on the right; C is ``width``, else the longest sequence's length
    rounded up to a multiple of ``multiple`` (pad_to_multiple_of) when given."""
    width = width if width is not None else round_up(max([len(s) for s in sequences] + [1]), multiple)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        mask[row, : len(seq)] = 1
    return ids, mask


def ended(completion: list[int], eos_ids: set[int], anywhere: bool = False) -> bool:
    """Whether a completion (or a turn) ended with an EOS rather than being cut by its token budget: its last
    token is one (every backend here cuts after the first, ``cut_at_eos``); ``anywhere``: any token is (TRL's rule
    for a rollout function's completions, which need not be cut)."""
    if anywhere:
        return any(token in eos_ids for token in completion)
    return bool(completion) and completion[-1] in eos_ids


def cut_at_eos(tokens: list[int], eos_ids: set[int], pad_id: int) -> list[int]:
    """Keep tokens up to and including the first EOS; drop trailing padding when there is no EOS."""
    for i, token in enumerate(tokens):
        if token in eos_ids:
            return tokens[: i + 1]
    while tokens and tokens[-1] == pad_id and pad_id not in eos_ids:
        tokens = tokens[:-1]
    return tokens


@torch.no_grad()
def hf_generate(model, prompt_ids: list[list[int]], params: SamplingParams, pad_id: int, eos_ids: set[int],
                synced_gpus: bool = False, pad_to_multiple_of: int | None = None) -> list[list[int]]:
    """Sample one completion per prompt with ``model.generate`` (the prompts left-padded to a multiple of
    ``pad_to_multiple_of`` columns, as TRL pads them); returns completion token ids, each cut after its first
    EOS (a completion without EOS was truncated at ``max_new_tokens``)."""
    device = next(model.parameters()).device
    input_ids, attention_mask = left_pad(prompt_ids, pad_id, pad_to_multiple_of)
    kwargs = dict(
        max_new_tokens=params.max_new_tokens, do_sample=params.do_sample, pad_token_id=pad_id,
        eos_token_id=sorted(eos_ids), use_cache=True, synced_gpus=synced_gpus,
        repetition_penalty=params.repetition_penalty,
    )
    if params.do_sample:
        kwargs.update(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k)
        if params.min_p is not None:
            kwargs["min_p"] = params.min_p
    else:
        kwargs.update(temperature=None, top_p=None, top_k=None)
    kwargs.update(params.extra)
    out = model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), **kwargs)
    completions = out[:, input_ids.shape[1]:].tolist()  # [N, <= max_new_tokens]
    return [cut_at_eos(c, eos_ids, pad_id) for c in completions]


def generate(model, prompt_ids: list[list[int]], params: SamplingParams, pad_id: int, eos_ids: set[int],
             engine: str = "auto", synced_gpus: bool = False, pad_to_multiple_of: int | None = None
             ) -> list[list[int]]:
    """Completions from ``model``: the lean engine (trainers/generation/engine.py) where it supports the model and the
    options, else HF ``generate``. ``engine``: "auto", "lean" (error if unsupported) or "hf". "auto" takes the
    lean engine on CPU only: it has not been measured on a GPU, where HF ``generate`` is the default."""
    from trainers.generation import engine as lean

    usable = not synced_gpus and lean.supports(model, params.extra)
    if engine == "lean" and not usable:
        raise ValueError("generation_engine='lean' supports Llama/Mistral/Qwen2/Qwen3 models, generation_kwargs "
                         f"{sorted(lean.SUPPORTED_EXTRA)}, and ZeRO-3 only with ds3_gather_for_generation=True.")
    on_cpu = next(model.parameters()).device.type == "cpu"
    if engine == "lean" or (engine == "auto" and usable and on_cpu):
        return lean.generate(model, prompt_ids, params, pad_id, eos_ids)
    return hf_generate(model, prompt_ids, params, pad_id, eos_ids, synced_gpus=synced_gpus,
                       pad_to_multiple_of=pad_to_multiple_of)


@dataclass(frozen=True)
class GenerationContext:
    """What sampling needs to know of the training set-up, given explicitly (a backend never reads a trainer)."""

    accelerator: Any  # accelerate.Accelerator: the device, autocast, and ZeRO-3's stage
    pad_id: int
    eos_ids: frozenset[int]  # a completion ends at the first of these
    engine: str = "auto"  # generation_engine: "auto", "lean" or "hf"
    gather_for_generation: bool = True  # ZeRO-3: gather the weights once for a round (ds3_gather_for_generation)
    pad_to_multiple_of: int | None = None  # HF generate's prompt padding, as TRL pads


class PolicySampler:
    """Samples from the policy being trained: eval mode, no gradients, under the training forward's autocast
    (bf16 mixed precision samples from the bf16 policy it trains); under ZeRO-3 the weights are gathered for
    the round (``gather_for_generation``) or generation runs with synced_gpus. ``model`` is the policy, ``wrapped``
    what trains it (DDP, a DeepSpeed engine, or the model itself)."""

    def __init__(self, context: GenerationContext, model: torch.nn.Module, wrapped: torch.nn.Module):
        self.context, self.model, self.wrapped = context, model, wrapped

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> list[list[int]]:
        context, model = self.context, self.model
        acc = context.accelerator
        was_training = model.training
        model.eval()
        gather = dist.zero_stage(acc) == 3 and context.gather_for_generation
        synced = dist.zero_stage(acc) == 3 and not gather
        with dist.gathered_for_generation(acc, self.wrapped, enabled=gather), acc.autocast():
            completions = generate(model, prompt_ids, params, context.pad_id, set(context.eos_ids),
                                   engine=context.engine, synced_gpus=synced,
                                   pad_to_multiple_of=context.pad_to_multiple_of)
        model.train(was_training)
        return completions

    def sample(self, prompts: list, prompt_ids: list[list[int]], params: SamplingParams) -> Samples:
        completions = self.generate(prompt_ids, params)
        eos_ids = set(self.context.eos_ids)
        return Samples(prompt_ids, completions, finished=[ended(c, eos_ids) for c in completions])
