"""Custom rollouts: TRL's ``rollout_func(prompts, trainer) -> dict`` contract, checked, as a generation backend
(``RolloutFuncBackend``).

A rollout function replaces the trainer's sampling: multi-turn episodes, tool calls, another inference engine.
It gets this process's prompts of a round (dataset ``prompt`` values, each repeated ``num_generations`` times,
as TRL passes them) and returns one completion per prompt:

- ``prompt_ids``, ``completion_ids``: token ids per row; the policy is trained on ``prompt + completion``;
- ``logprobs``: the sampler's per-token log-probs of the completion (None for a token it could not score),
  or None;
- ``env_mask`` (optional): per completion token, 1 where the model produced it and 0 where the environment
  did (a tool's answer): only the model's tokens count in the loss;
- any other key: one value per row (or one value for all), passed to the reward functions by that name.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Mapping, Sequence

import torch

from trainers.parallel import distributed as dist
from trainers.errors import RolloutError, TrainersError, VLLMServerError
from trainers.generation.backend import BackendInputs
from trainers.generation.sampling import Samples, SamplingParams, ended
from trainers.model.modeling import context_length, vocabulary_size

REQUIRED = ("prompt_ids", "completion_ids", "logprobs")


def _rows(output: Mapping, key: str, n: int) -> list:
    value = output[key]
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or len(value) != n:
        got = f"{len(value)} rows" if isinstance(value, Sequence) and not isinstance(value, (str, bytes)) \
            else type(value).__name__
        raise RolloutError(f"rollout_func returned '{key}' with {got}; it must hold one entry per prompt it was "
                           f"given ({n}).")
    return list(value)


def _numbers(row, key: str, index: int, kind: type) -> list:
    if isinstance(row, torch.Tensor):
        row = row.tolist()
    if isinstance(row, (str, bytes)) or not isinstance(row, Sequence):
        raise RolloutError(f"rollout_func returned '{key}' row {index} as {type(row).__name__}; it must be a list "
                           f"of {kind.__name__}s.")
    if kind is int and not all(isinstance(v, int) and not isinstance(v, bool) for v in row):
        raise RolloutError(f"rollout_func returned '{key}' row {index} with a value that is not a token id (int).")
    if kind is float:  # None: a token the sampler could not score (vLLM's), kept as NaN as TRL does
        row = [math.nan if v is None else v for v in row]
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in row):
            raise RolloutError(f"rollout_func returned '{key}' row {index} with a value that is not a number "
                               f"(None marks a token the sampler could not score).")
    return [kind(v) for v in row]


def check_rollout(output, n: int, max_completion_length: int, vocab_size: int | None,
                  context: int | None) -> Samples:
    """Check a rollout function's ``output`` for ``n`` prompts; errors name the key and the row."""
    if not isinstance(output, Mapping):
        raise RolloutError(f"rollout_func returned {type(output).__name__}; it must return a dict with the keys "
                           f"{list(REQUIRED)}.")
    missing = sorted(set(REQUIRED) - set(output))
    if missing:
        raise RolloutError(f"rollout_func must return keys {missing} in its output dict (it returned "
                           f"{sorted(output)}); 'logprobs' may be None.")
    prompts = [_numbers(r, "prompt_ids", i, int) for i, r in enumerate(_rows(output, "prompt_ids", n))]
    completions = [_numbers(r, "completion_ids", i, int) for i, r in enumerate(_rows(output, "completion_ids", n))]
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        if not prompt:
            raise RolloutError(f"rollout_func returned an empty 'prompt_ids' row {i}.")
        if len(completion) > max_completion_length:
            raise RolloutError(f"rollout_func returned a completion of {len(completion)} tokens in row {i}; "
                               f"max_completion_length={max_completion_length} bounds every completion (environment "
                               f"tokens included): raise it, or end the episode sooner.")
        if context is not None and len(prompt) + len(completion) > context:
            raise RolloutError(f"rollout_func returned row {i} with {len(prompt)} prompt + {len(completion)} "
                               f"completion tokens, more than the model's context of {context}.")
        if vocab_size is not None and any(not 0 <= t < vocab_size for t in prompt + completion):
            raise RolloutError(f"rollout_func returned a token id outside the model's vocabulary (0..{vocab_size - 1})"
                               f" in row {i}.")

    def per_token(key: str, kind: type) -> list | None:
        if output.get(key) is None:
            return None
        rows = [_numbers(r, key, i, kind) for i, r in enumerate(_rows(output, key, n))]
        for i, (row, completion) in enumerate(zip(rows, completions)):
            if len(row) != len(completion):
                raise RolloutError(f"rollout_func returned '{key}' row {i} with {len(row)} values for a completion "
                                   f"of {len(completion)} tokens; give one per completion token.")
        return rows

    logprobs, env_mask = per_token("logprobs", float), per_token("env_mask", int)
    if env_mask is not None and any(v not in (0, 1) for row in env_mask for v in row):
        raise RolloutError("rollout_func returned an 'env_mask' value other than 0 (environment token) or 1 "
                           "(model token).")
    extra = {}
    for key, value in output.items():
        if key in REQUIRED or key == "env_mask":
            continue
        # TRL's rule: a list holds one value per row; anything else is every row's value
        extra[key] = _rows(output, key, n) if isinstance(value, list) else [value] * n
    return Samples(prompts, completions, logprobs, env_mask, extra)


def call_rollout_func(call, prompts: list, max_completion_length: int, vocab_size: int | None,
                      context: int | None) -> Samples:
    """``call`` (the user's function, bound to its trainer: prompts -> dict) on copies of this process's
    ``prompts``, its output checked; its errors become RolloutErrors."""
    try:
        output = call(copy.deepcopy(prompts))
    except TrainersError:
        raise
    except Exception as error:
        raise RolloutError(f"rollout_func raised {type(error).__name__}: {error}") from error
    return check_rollout(output, len(prompts), max_completion_length, vocab_size, context)


class RolloutFuncBackend:
    """A user's ``rollout_func`` behind the backend interface. ``call``: the function bound to its trainer
    (TRL's contract is ``rollout_func(prompts, trainer)``; the trainer binds it, this class never sees the
    trainer). ``engine``: the vLLM backend the function may sample through (``trainer.vllm_generation`` with
    use_vllm, as in TRL), whose weights and lifetime this backend passes on. Every process calls the function;
    a failure on one stops all (the others would wait in the next collective)."""

    def __init__(self, call, inputs: BackendInputs, engine=None):
        self.call, self.engine = call, engine
        self.accelerator, self.eos_ids = inputs.context.accelerator, set(inputs.context.eos_ids)
        self.limits = (inputs.config.max_completion_length, vocabulary_size(inputs.policy),
                       context_length(inputs.policy))

    def sample(self, prompts: list, prompt_ids: list[list[int]], params: SamplingParams) -> Samples:
        """``params`` are the trainer's own: the function reads ``trainer.args`` or calls ``trainer.generate``
        with its own."""
        try:
            samples, error = call_rollout_func(self.call, prompts, *self.limits), None
        except Exception as caught:
            samples, error = None, caught
        # a vLLM server the function called died: every process stops with a checkpoint (GRPOTrainer.train)
        dist.raise_together(self.accelerator, error, shared=(VLLMServerError,))
        # TRL's rule: a completion with an EOS anywhere ended (a rollout's completions need not be cut at it)
        finished = [ended(c, self.eos_ids, anywhere=True) for c in samples.completion_ids]
        return dataclasses.replace(samples, finished=finished)

    def sync_weights(self, step: int | None = None) -> None:
        if self.engine is not None:  # the engine the function samples from holds this step's policy
            self.engine.sync_weights(step)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
