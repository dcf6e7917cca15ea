"""GRPO's training forward with each distinct prompt run once: its completions share the prompt's KV cache.

A GRPO micro-batch holds up to ``num_generations`` completions of the same prompt. Instead of one forward over
prompt + completion per row, the distinct prompts run once (caching their keys and values), and the
completions run on top of that cache, each row reading its own prompt's entries. Gradients flow back through
the cache and add up per prompt, so loss and gradients equal the one-forward path
(tests/unit/test_shared_prompts.py) while the forward and backward skip (rows - distinct prompts) × prompt
length tokens.

The cache works under gradient checkpointing too. There, backward replays each checkpointed decoder layer's
forward, cache update included, so the two cache layers below give the replay exactly what the forward got:
the prompt pass's layer stores once and hands later calls their own keys back; the completion pass's layer
stores nothing.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from trainers.model.cpu_attention import float32_attention_on_cpu
from trainers.model.modeling import positions_from_mask, split_scores, token_scores
from trainers.model.output_head import plan_head, scoring_head


class _PromptLayer(DynamicLayer):
    """The prompt pass's cache layer: the first update stores the prompts' keys and values ([U, KV, P, D]);
    any later one is a checkpointed layer's replay in backward, which gets its recomputed states back as they
    are (storing them again would double the cache)."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.keys, self.values = key_states, value_states
        return key_states, value_states


class _CompletionLayer(DynamicLayer):
    """The completion pass's cache layer: each row's prompt entries followed by its new ones, stored nowhere, so
    a replay computes the same. keys/values [U, KV, P, D] from the prompt pass; rows [B]: row -> its prompt."""

    def __init__(self, prompt: _PromptLayer, rows: torch.Tensor):
        super().__init__()
        self.lazy_initialization(prompt.keys, prompt.values)
        self.keys, self.values, self.rows = prompt.keys, prompt.values, rows

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # [B, KV, P, D] + [B, KV, C, D] -> [B, KV, P + C, D]
        return (torch.cat([self.keys[self.rows], key_states], dim=-2),
                torch.cat([self.values[self.rows], value_states], dim=-2))


def _prompt_cache() -> DynamicCache:
    """An empty cache that gives each decoder layer a _PromptLayer on its first update."""
    cache = DynamicCache()
    cache.layer_class_to_replicate = _PromptLayer
    return cache


def _completion_cache(prompt_cache: DynamicCache, rows: torch.Tensor) -> DynamicCache:
    cache = DynamicCache()
    cache.layers = [_CompletionLayer(layer, rows) for layer in prompt_cache.layers]
    return cache


def _replayed_layers(model: torch.nn.Module) -> list[torch.nn.Module] | None:
    """The decoder layers that gradient checkpointing will replay in backward ([] without checkpointing), or
    None where the prompt's cache cannot survive their checkpoints: transformers must let a checkpointed layer
    keep a cache (``_can_checkpoint_with_cache``, recent 5.x; older ones drop it), and the checkpoints must be
    non-reentrant (transformers' default): a reentrant one runs the forward without autograd, so the
    completions' gradients would never reach the prompt's keys and values."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing
              and m.training]
    for layer in layers:
        checkpoint = getattr(layer, "_gradient_checkpointing_func", None)
        if (not hasattr(layer, "_can_checkpoint_with_cache") or not isinstance(checkpoint, functools.partial)
                or checkpoint.keywords.get("use_reentrant") is not False):
            return None
    return layers


@contextlib.contextmanager
def _cache_kept(layers: list[torch.nn.Module]):
    """Tell checkpointed decoder layers to keep the cache, for this forward only (the replay in backward runs
    with the arguments the forward got, cache included). Safe with our cache layers, which give a replay what
    the forward got; transformers' own would store the replay's keys and values a second time."""
    saved = [vars(layer).get("_can_checkpoint_with_cache") for layer in layers]
    for layer in layers:
        layer._can_checkpoint_with_cache = True
    try:
        yield
    finally:
        for layer, value in zip(layers, saved):
            if value is None:
                del layer._can_checkpoint_with_cache
            else:
                layer._can_checkpoint_with_cache = value


def shared_prompt_logprobs(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_attention: torch.Tensor,
    prompt_group: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    groups: list[int] | None = None,
) -> dict[str, torch.Tensor] | None:
    """Per-token log-probs (and entropy, with a gradient if ``entropy_grad``) of completions, running each
    distinct prompt once (module docstring).

    Needs an HF decoder-only model that takes ``past_key_values`` and a tensor ``logits_to_keep``, with full
    attention in every layer. Under ZeRO-3 the second forward would all-gather the weights again. The caller
    decides.

    prompt_ids, prompt_mask: [B, P] left-padded. completion_ids, completion_attention: [B, C] right-padded.
    prompt_group: [B], each row's distinct prompt numbered 0..U-1 (trainers/sampling/batch.py ``prompt_groups``):
    rows of one group hold the same prompt; ``groups``: the same as host integers (a micro-batch's
    ``widths.groups``), else read from ``prompt_group``. Returns tensors of shape [B, C], or None when no two rows
    share a prompt or the model's gradient checkpoints would lose the cache (``_replayed_layers``): use
    ``token_logprobs`` then.
    """
    B, P = prompt_ids.shape
    C = completion_ids.shape[1]
    row_prompt = prompt_group.to(prompt_ids.device)  # [B]: row -> its prompt
    groups = row_prompt.tolist() if groups is None else list(groups)  # host ints: no device read when given
    distinct = max(groups) + 1
    if distinct == B:
        return None
    replayed = _replayed_layers(model)
    if replayed is None:
        return None
    first = torch.tensor([groups.index(g) for g in range(distinct)], device=prompt_ids.device)  # [U]
    ids_u, mask_u = prompt_ids[first], prompt_mask[first]  # [U, P] each
    plan = plan_head(model)  # None: full logits, scored after the forward

    def scored(targets: torch.Tensor, rows: torch.Tensor | None = None, **inputs) -> dict[str, torch.Tensor]:
        """The model's forward on ``inputs`` with the scores of ``targets`` [B, K] at the positions it keeps."""
        if plan is None:
            logits = model(**inputs).logits
            return token_scores(logits if rows is None else logits[rows], targets, temperature, with_entropy,
                                entropy_grad=entropy_grad)
        # every target is a completion token (>= 0): the head keeps them all, without reading them
        with scoring_head(plan, targets, temperature, with_entropy, entropy_grad, rows=rows, kept=targets.numel()):
            return split_scores(model(**inputs).logits, with_entropy)

    with float32_attention_on_cpu(model, prompt_ids.device), _cache_kept(replayed):
        # use_cache=False: the layers update the cache they are given either way, and True would make a
        # checkpointed layer warn that it turns caching off.
        prompt_cache = _prompt_cache()
        # the prompts' last positions ([U, 1]), each read by its completions' rows, predict the first tokens
        parts = [scored(completion_ids[:, :1], row_prompt, input_ids=ids_u, attention_mask=mask_u,
                        position_ids=positions_from_mask(mask_u), past_key_values=prompt_cache, use_cache=False,
                        logits_to_keep=1)]
        if C > 1:
            attention_mask = torch.cat([prompt_mask, completion_attention], dim=1)  # [B, P + C]
            positions = positions_from_mask(attention_mask)[:, P:]  # [B, C], as in the one-forward path
            # Positions 0 .. C-2 predict completion tokens 1 .. C-1; the last position predicts beyond.
            parts.append(scored(completion_ids[:, 1:], input_ids=completion_ids, attention_mask=attention_mask,
                                position_ids=positions, past_key_values=_completion_cache(prompt_cache, row_prompt),
                                use_cache=False, logits_to_keep=torch.arange(C - 1, device=completion_ids.device)))
    return {key: torch.cat([part[key] for part in parts], dim=1) for key in parts[0]}
