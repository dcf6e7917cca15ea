"""The generation backend's interface and its registry: what every trainer that samples draws completions through.

A backend has a lifetime:

    build (once, from ``BackendInputs``: explicit arguments, never a trainer)
      -> sync_weights(step)   after the optimizer step that precedes a round: the engine gets the policy's
                              weights (a no-op for the policy itself, which is the weights)
      -> sample(...)          a round's completions: ``Samples``
      -> ... (sync, sample) ...
      -> close()              the end of train() or trainer.end(); a closed backend used again starts anew

Backends: "policy" (the policy itself: the lean engine or HF ``generate``, generation/sampling.py),
"vllm_colocate" (generation/vllm_colocate.py), "vllm_server" (generation/vllm_remote.py), and a user's
``rollout_func`` (generation/user_rollout.py, which wraps a vLLM backend when both are given, as TRL's does). A
new backend is one class and one ``register_backend`` call; GRPOConfig(generation_backend=name) selects it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from trainers.errors import ConfigError
from trainers.generation.sampling import GenerationContext, PolicySampler, Samples, SamplingParams


class Backend(Protocol):
    """What a trainer samples through. Every process calls each method together (ZeRO-3 gathers, a server's
    requests, vLLM's collectives)."""

    def sample(self, prompts: list, prompt_ids: list[list[int]], params: SamplingParams) -> Samples:
        """One completion per prompt (``prompts``: the dataset's values, for a rollout function; ``prompt_ids``:
        their tokens): ``Samples`` with the completions' token ids, whether each finished (an EOS, not the
        budget), and where the backend has them its log-probs and a mask of the tokens the model wrote."""
        ...

    def sync_weights(self, step: int) -> None:
        """The engine's weights := the policy's after optimizer step ``step`` (nothing when it has them)."""
        ...

    def close(self) -> None:
        """Release the engine (idempotent)."""
        ...


@dataclass(frozen=True)
class BackendInputs:
    """Everything a backend may be built from. ``config``: the trainer's config, for a backend's own options
    (vllm_*, seed, generation_kwargs): read, never written."""

    context: GenerationContext  # the accelerator, pad and EOS ids, the engine choice, ZeRO-3 gathering
    policy: torch.nn.Module  # the policy, unwrapped (its config, its weights to sync)
    wrapped: torch.nn.Module  # what trains it (DDP, a DeepSpeed engine, or the policy itself)
    tokenizer: Any
    config: Any
    completions_per_round: int  # this process's completions per round: an engine's batch size
    longest_prompt: int | None = None  # the longest prompt of the data, in tokens (vLLM's KV cache on CPU)
    sampling: SamplingParams | None = None  # the trainer's sampling parameters (a backend checks what it accepts)


BACKENDS: dict[str, Callable[[BackendInputs], Backend] | str] = {}


def register_backend(name: str, build: Callable[[BackendInputs], Backend] | str) -> None:
    """Make ``build(inputs) -> Backend`` (a class taking ``BackendInputs``, or a function; or its path,
    ``"package.module:name"``, imported when first built) selectable as GRPOConfig(generation_backend=name)."""
    if not name or not isinstance(name, str):
        raise ValueError(f"register_backend: the name must be a non-empty string, got {name!r}")
    BACKENDS[name] = build


def build_backend(name: str, inputs: BackendInputs) -> Backend:
    """The backend registered as ``name``, built from ``inputs``."""
    if name not in BACKENDS:
        raise ConfigError(f"generation_backend={name!r} is not a registered backend; registered: {sorted(BACKENDS)} "
                          f"(trainers.generation.backend.register_backend adds one).")
    build = BACKENDS[name]
    if isinstance(build, str):
        module, attribute = build.split(":")
        build = getattr(importlib.import_module(module), attribute)
    return build(inputs)


class PolicyBackend(PolicySampler):
    """The policy itself as a backend: its weights are the policy's, so there is nothing to sync or close."""

    def __init__(self, inputs: BackendInputs):
        super().__init__(inputs.context, inputs.policy, inputs.wrapped)

    def sync_weights(self, step: int) -> None:
        pass

    def close(self) -> None:
        pass


register_backend("policy", PolicyBackend)
# vLLM is imported only where it is used: these are built from their module's path
register_backend("vllm_colocate", "trainers.generation.vllm_colocate:VLLMColocate")
register_backend("vllm_server", "trainers.generation.vllm_remote:VLLMRemote")
