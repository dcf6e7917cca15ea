"""The sampling trainers' log-prob scorer: the policy's, the old and the reference log-probs of a round's
completions, in one place (``LogProbScorer``). The rollout stage asks it for old and reference log-probs; the loss
for the policy's, with the rows that cannot have a gradient left out of the backward (``training_forward``). And a
sampler other than the policy (vLLM, a rollout_func, a registered backend) against it: its log-probs compared with
the policy's, and TRL's vllm_importance_sampling_* weights (``ImportanceCorrection``, ``compare_sampler``)."""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch

from trainers.parallel import distributed as dist
from trainers.generation import engine
from trainers.model.modeling import token_logprobs
from trainers.loop.stats import Extreme, reduce_extremes, reduce_pairs
from trainers.model.output_head import plan_head
from trainers.sampling.batch import MicroBatch, Rollout, RoundPart, RowRole, budget_groups
from trainers.sampling.packed_forward import packed_logprobs
from trainers.sampling.shared_prompt import shared_prompt_logprobs


class LogProbScorer:
    """Per-token log-probs of completions under the policy (``wrapped``: what trains it; ``policy``: unwrapped)
    or the reference (``reference``: a prepared copy; None with PEFT, where it is the policy with its adapters
    off). ``batch_size``: rows per forward (per_device_train_batch_size); ``temperature``: the logits' divisor.
    The policy-gradient trainers' forward options: ``padding_free`` (one packed row per forward), ``token_budget``
    (scoring forwards of at most that many tokens), ``skip_zero_gradient_rows``; and what their loss has, which
    decides which rows have no gradient: ``kl_in_loss`` (beta > 0), ``entropy_bonus``, ``folds_sampler_weights``
    (an objective whose loss is not a multiple of the sampler's importance weights, GRPO's vespo);
    ``router_aux_loss_coef``: an MoE router loss's weight (0: none)."""

    def __init__(self, accelerator, policy: torch.nn.Module, wrapped: torch.nn.Module,
                 reference: torch.nn.Module | None, batch_size: int, *, temperature: float,
                 router_aux_loss_coef: float = 0.0, padding_free: bool = False, token_budget: int | None = None,
                 skip_zero_gradient_rows: bool = False, kl_in_loss: bool = False, entropy_bonus: bool = False,
                 folds_sampler_weights: bool = False):
        self.accelerator = accelerator
        self.policy, self.wrapped, self.reference = policy, wrapped, reference
        self.batch_size, self.temperature = batch_size, temperature
        self.router_aux_loss_coef = router_aux_loss_coef
        self.padding_free, self.token_budget, self.skip_rows = padding_free, token_budget, skip_zero_gradient_rows
        self.kl_in_loss, self.entropy_bonus, self.folds_sampler_weights = kl_in_loss, entropy_bonus, folds_sampler_weights

    @functools.cached_property
    def shares_prompt_forward(self) -> bool:
        """Whether a micro-batch's completions of one prompt share its forward (``shared_prompt_logprobs``):
        for the model families the lean engine knows, and not where a forward is collective: whether a
        micro-batch shares a prompt differs between processes. That also leaves out ZeRO-3, where a second
        forward per micro-batch would cost a second all-gather of every layer's weights (it computes correctly
        there: checked on CPU, not enabled). Under gradient checkpointing the function itself falls back where
        the checkpoints would lose the prompt's cache (reentrant ones, an older transformers)."""
        return (engine.supports(self.policy)
                and not dist.forwards_are_collective(self.accelerator, self.wrapped)
                and not self.router_aux_loss_coef)  # the router loss wants every token's routing in one forward

    @functools.cached_property
    def skips_zero_gradient_rows(self) -> bool:
        """skip_zero_gradient_rows where it holds: not where forwards are collective (ZeRO-3, FSDP, DDP with
        ddp_broadcast_buffers=True: the extra forward runs on some processes only), nor with an MoE router loss
        (every row's routing counts in it)."""
        return (self.skip_rows and not dist.forwards_are_collective(self.accelerator, self.wrapped)
                and not self.router_aux_loss_coef)

    def policy_logprobs(self, model, batch: MicroBatch, with_entropy: bool = False, with_router_loss: bool = False,
                        entropy_grad: bool = False) -> dict:
        """The one entry point for log-probs of a micro-batch's completions under ``model`` (the policy, or the
        reference): {"logps": [B, C], "entropy": [B, C] with ``with_entropy``, "aux_loss" with
        ``with_router_loss``}. With padding_free one packed row without padding is forwarded; else rows of one
        prompt share its forward where that holds (``shares_prompt_forward``)."""
        # padding_free packs every forward. plan_head is None only where the trainer could not check the head
        # before training (a LoRA head sharded by ZeRO-3); the padded forward below gives the same log-probs.
        plan = plan_head(model) if self.padding_free else None
        widths = getattr(batch, "widths", None)  # host integers read once per round (RowWidths), if it has them
        if plan is not None:
            return packed_logprobs(model, plan, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                   batch.completion_attention, self.temperature, with_entropy, entropy_grad,
                                   with_router_loss, counts=None if widths is None else widths.counts())
        if self.shares_prompt_forward:
            out = self.shared_forward(model, batch, with_entropy, entropy_grad)
            if out is not None:  # None: no two rows of this micro-batch share a prompt
                return out
        input_ids, attention_mask, position_ids = batch.model_inputs()
        # every target is a completion token (>= 0, padding included): the head keeps them all, without reading
        return token_logprobs(model, input_ids, batch.completion_ids, attention_mask, position_ids,
                              temperature=self.temperature, logits_to_keep=batch.completion_ids.shape[1],
                              with_entropy=with_entropy, with_router_loss=with_router_loss, entropy_grad=entropy_grad,
                              kept=batch.completion_ids.numel())

    def shared_forward(self, model, batch: MicroBatch, with_entropy: bool, entropy_grad: bool) -> dict | None:
        """``policy_logprobs`` with each distinct prompt of the micro-batch run once (sampling/shared_prompt.py);
        None where no two rows share a prompt (or the checkpoints would lose the prompt's cache)."""
        widths = getattr(batch, "widths", None)
        return shared_prompt_logprobs(model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                      batch.completion_attention, batch.prompt_group, self.temperature, with_entropy,
                                      entropy_grad, groups=None if widths is None else widths.groups)

    def round_logprobs(self, model, rollout: Rollout) -> torch.Tensor:
        """Per-token log-probs of every completion of a round, in micro-batches of ``batch_size`` rows (with
        token_budget, of at most that many tokens: ``budget_groups``): [N, C]."""
        out = torch.zeros_like(rollout.loss_mask)
        rows = range(rollout.loss_mask.shape[0])
        if self.token_budget is None:
            groups = [list(rows[start:start + self.batch_size]) for start in range(0, len(rows), self.batch_size)]
        else:
            groups = [group for _, group in budget_groups(self.accelerator, [RoundPart(rollout, rows)],
                                                          self.token_budget)]
        for group in groups:
            logps = self.policy_logprobs(model, rollout.micro_batch_of(group))["logps"]  # [b, c]
            out[group, : logps.shape[1]] = logps
        return out

    def old_logprobs(self, rollout: Rollout) -> torch.Tensor:
        """The policy's log-probs of a round now, before its optimizer steps: [N, C]."""
        return self.round_logprobs(self.wrapped, rollout)

    def reference_logprobs(self, rollout: Rollout) -> torch.Tensor:
        """The reference model's log-probs of a round: [N, C]. With PEFT, the base model (adapters off)."""
        if self.reference is not None:
            return self.round_logprobs(self.reference, rollout)
        with self.policy.disable_adapter():
            return self.round_logprobs(self.wrapped, rollout)

    def training_forward(self, model, batch: MicroBatch, **options) -> dict:
        """``policy_logprobs`` for the loss, with only the rows whose loss has a gradient in the backward.

        A row without loss tokens adds nothing to the loss; with beta=0 and no entropy bonus neither does a row
        with advantage 0, since every policy loss is a multiple of the advantage, nor one whose sampler weights
        (vllm_importance_sampling_*) are 0 on all its loss tokens. Such rows are forwarded without gradients (the
        logged entropy needs them; on the unwrapped model, as a forward with no backward needs none of DDP's
        bookkeeping), or, without loss tokens, not at all: their log-probs are set to the old ones (every ratio
        1, every term finite) and their entropy to 0 (masked). The result covers the whole micro-batch
        ({"logps", "entropy"}, [B, C]), so the loss and every statistic are computed as without skipping. Which
        rows are which comes from host integers (``row_roles``, read once per round), so that choosing them reads
        nothing from the device."""
        if not self.skips_zero_gradient_rows:
            return self.policy_logprobs(model, batch, **options)
        roles = batch.roles if batch.roles is not None else self.row_roles(batch)  # host integers
        trained = [i for i, role in enumerate(roles) if role == RowRole.TRAINED]
        if len(trained) == len(roles):
            return self.policy_logprobs(model, batch, **options)
        # one row keeps a backward, so DDP's and DeepSpeed's gradient hooks fire on every process
        trained = trained or [0]
        frozen = [i for i, role in enumerate(roles) if role == RowRole.NO_GRADIENT and i not in trained]
        trained_at = torch.tensor(trained, device=batch.advantages.device)  # [b]
        parts = [(trained_at, self.policy_logprobs(model, batch.rows(trained_at, trained), **options))]
        if frozen:
            frozen_at = torch.tensor(frozen, device=batch.advantages.device)
            with torch.no_grad():
                parts.append((frozen_at, self.policy_logprobs(dist.unwrap(self.accelerator, model),
                                                              batch.rows(frozen_at, frozen), with_entropy=True)))
        mask = batch.loss_mask  # [B, C]
        width = mask.shape[1]
        logps = batch.old_logps if batch.old_logps is not None else torch.zeros_like(mask)
        entropy = torch.zeros_like(mask)
        for rows, out in parts:  # [b, c] -> their rows of [B, C]; index_copy keeps the trained rows' gradient
            pad = (0, width - out["logps"].shape[1])
            logps = logps.index_copy(0, rows, torch.nn.functional.pad(out["logps"], pad))
            entropy = entropy.index_copy(0, rows, torch.nn.functional.pad(out["entropy"], pad))
        return {"logps": logps, "entropy": entropy}

    def row_roles(self, batch: Rollout) -> list[int] | None:
        """Each row's ``RowRole`` in ``training_forward`` (``skip_zero_gradient_rows``), as host integers read in
        one copy: for a round when it is built, so that its micro-batches read none. None where no row is
        skipped. A row's loss has no gradient without loss tokens, or, with beta=0 and no entropy bonus, with
        advantage 0 (every policy loss is a multiple of it) or sampler weights (vllm_importance_sampling_*) 0 on
        all its loss tokens."""
        if not self.skips_zero_gradient_rows:
            return None
        mask = batch.loss_mask  # [B, C]
        silent = mask.sum(-1) == 0  # [B]: no loss tokens
        idle = silent.clone()  # [B]: rows whose loss gradient is zero
        if not self.kl_in_loss and not self.entropy_bonus:
            idle |= batch.advantages == 0
            if batch.sampler_weights is not None and not self.folds_sampler_weights:
                idle |= (batch.sampler_weights * mask).sum(-1) == 0  # masked out by the sampler correction
        roles = torch.full_like(silent, RowRole.TRAINED, dtype=torch.long)  # [B]
        return roles.masked_fill(idle, RowRole.NO_GRADIENT).masked_fill(silent, RowRole.NO_LOSS).tolist()


@dataclass(frozen=True)
class ImportanceCorrection:
    """How the round weighs a completion sampled by another engine: ``mode`` (per 'token_*' or 'sequence_*';
    '*_truncate' clips the ratio, '*_mask' drops what falls outside) and the bounds (None: no bound)."""

    mode: str
    clip_min: float | None
    clip_max: float | None

    def weights(self, logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return sampler_importance_weights(logps, sampler_logps, mask, self.mode, self.clip_min, self.clip_max)


def sampler_importance_weights(logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor, mode: str,
                               clip_min: float | None, clip_max: float | None) -> torch.Tensor:
    """Importance weights π_old / π_sampler that correct for completions sampled by another engine than the
    policy (TRL's vLLM importance sampling: truncated or masked IS): per token ([B, T]) for
    'token_*' modes, per completion ([B, 1], the product over its masked tokens) for 'sequence_*'. '*_truncate'
    clips them to [clip_min, clip_max]; '*_mask' sets them to 0 outside it (None: no bound on that side).

    logps (the trainer's, π_old), sampler_logps (NaN where the sampler gave none: a difference of 0, so no
    correction), mask: [B, T]. Padding columns get weight 1.
    """
    diff = torch.nan_to_num((logps - sampler_logps) * mask, nan=0.0)  # [B, T]
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)  # [B, 1]
    weights = torch.exp(diff)
    if mode.endswith("truncate"):
        return weights if clip_min is None and clip_max is None else weights.clamp(min=clip_min, max=clip_max)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return weights.masked_fill((weights < low) | (weights > high), 0.0)


def padded_logprobs(sampler_logps: list[list[float]], width: int) -> torch.Tensor:
    """The sampler's log-probs as [N, width] float32, NaN beyond each completion's end (and where the sampler
    gave none)."""
    sampler = torch.full((len(sampler_logps), width), math.nan)
    for row, values in enumerate(sampler_logps):
        sampler[row, :len(values)] = torch.tensor(values, dtype=sampler.dtype)
    return sampler


def logprob_gap(trainer_logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """|trainer - sampler| log-probs over ``mask``'s tokens -> (sum, count, max), each a 0-d tensor.

    trainer_logps, sampler_logps (``padded_logprobs``), mask: [N, C]. NaN sampler values (tokens the sampler
    could not score) are left out, as TRL does."""
    delta = (trainer_logps - sampler_logps).abs()
    counted = mask.bool() & ~torch.isnan(delta)
    delta = torch.where(counted, delta, torch.zeros_like(delta))
    return delta.sum(), counted.sum().to(delta.dtype), delta.max() if delta.numel() else delta.new_zeros(())


def compare_sampler(accelerator, scorer: LogProbScorer, rollout: Rollout, sampler: torch.Tensor | None,
                    mask: torch.Tensor, correction: ImportanceCorrection | None) -> tuple[Rollout, dict]:
    """A backend's own log-probs (``sampler``: [n, C], NaN where it gave none) against the policy's for the
    model's tokens (``mask``), computed once per round (the round's old log-probs when it has them): TRL's
    sampling/sampling_logp_difference/{mean,max}, about 0 when the rollout sampled from this policy; and, with a
    ``correction`` (vllm_importance_sampling_correction), the importance weights pi_old / pi_sampler the loss is
    multiplied by, with TRL's sampling/importance_sampling_ratio/{min,mean,max}. Returns ``rollout`` with both,
    and the metrics. All over every process; processes without sampler log-probs take part in the collectives
    and count nothing."""
    acc = accelerator
    given = dist.all_reduce_sum(acc, torch.tensor([float(sampler is not None)], device=acc.device))
    if given.item() == 0:
        return rollout, {}
    current = rollout.old_logps if rollout.old_logps is not None else scorer.old_logprobs(rollout)
    current = current.float()
    mine = sampler is not None  # this process's rollout gave log-probs
    sampler = sampler.to(current.device) if mine else torch.full_like(current, math.nan)  # NaN: counts nothing
    total, count, peak = logprob_gap(current, sampler, mask)
    total, count = dist.all_reduce_sum(acc, torch.stack([total, count])).tolist()
    metrics = {"sampling/sampling_logp_difference/mean": total / max(count, 1.0),
               "sampling/sampling_logp_difference/max": dist.all_reduce_max(acc, peak.reshape(1)).item()}
    weights = None
    if correction is not None:
        weights = correction.weights(current, sampler, mask)  # [n, C] or [n, 1]
        # as TRL: per token over the model's tokens, per completion over every row; rows without any sampler
        # log-prob (a process whose rollout gave none) count nothing
        counted = mask.bool() if weights.shape[1] > 1 else torch.ones_like(weights, dtype=torch.bool)
        metrics.update(pooled_extremes(acc, "sampling/importance_sampling_ratio",
                                       weights[counted & ~sampler.isnan().all(1, keepdim=True)]))
    if not mine:
        return rollout, metrics
    return dataclasses.replace(rollout, sampler_logps=sampler, sampler_weights=weights), metrics


def pooled_extremes(accelerator, name: str, values: torch.Tensor) -> dict:
    """{name}/min, /mean and /max of this process's ``values`` and every other's (nothing when none has any)."""
    pooled = reduce_pairs(accelerator, {f"{name}/mean": (values.sum(), values.numel())})  # NaN when none has any
    if math.isnan(pooled[f"{name}/mean"]):
        return {}
    nothing = values.new_tensor(math.nan)  # a process without values is left out of the min and max
    pooled.update(reduce_extremes(accelerator, {
        f"{name}/min": [Extreme(values.min() if values.numel() else nothing, "min")],
        f"{name}/max": [Extreme(values.max() if values.numel() else nothing, "max")]}))
    return pooled
