"""GRPOTrainer: group-relative policy optimization with verifiable rewards (arXiv:2402.03300).

The sampling base (trainers/sampling/trainer.py) builds each generation round: ``generation_batch_size /
num_generations`` prompts (identically on every process), each repeated ``num_generations`` times, this process's
contiguous share sampled, scored, its advantages computed from every process's rewards, kept as a typed
``Rollout`` (trainers/sampling/batch.py); PolicyGradientTrainer (sampling/policy_gradient.py) adds the reference
model and the policy's forward options. What GRPO adds:

- the advantage estimator "grpo" (group-relative normalization or GDPO, ``ADVANTAGE_ESTIMATORS``,
  trainers/sampling/advantages.py), and the correction for another sampler (vllm_importance_sampling_*);
- ``compute_loss``: the policy's log-probs (``LogProbScorer``, trainers/sampling/scoring.py), the objective of
  ``loss_type`` (``OBJECTIVES``, trainers/grpo/objectives.py), its masks, the KL term, averaged as
  ``AGGREGATIONS`` says, and the entropy bonus (fixed or adaptive, grpo/entropy_control.py).

docs/grpo.md has the formulas; docs/design.md walks the step with file names.
"""

from __future__ import annotations

import dataclasses

import torch

from trainers.parallel import distributed as dist
from trainers.grpo.config import GRPOConfig
from trainers.grpo.entropy_control import EntropyControl, load_entropy_control, save_entropy_control
from trainers.grpo.objectives import (
    AGGREGATIONS,
    FOLDS_SAMPLER_WEIGHTS,
    OBJECTIVES,
    GRPOCounts,
    PolicyInputs,
    check_loss_options,
    entropy_bonus,
    high_entropy_mask,
    importance_log_weights,
    k3_kl,
    off_policy_sequence_mask,
    policy_loss_stats,
)
from trainers.logs import logger
from trainers.model.losses import BatchCounts
from trainers.sampling.batch import MicroBatch
from trainers.sampling.policy_gradient import PolicyGradientTrainer
from trainers.sampling.rollout import RoundNeeds
from trainers.sampling.scoring import LogProbScorer
from trainers.loop.stats import Stats


class GRPOTrainer(PolicyGradientTrainer):
    """Trains a policy with GRPO. ``reward_funcs``: callables, built-in names ("accuracy", "format",
    "overlong"), ``module:function`` strings, or reward models (folders, Hub ids or instances). ``rollout_func``
    replaces the trainer's sampling (trainers/generation/user_rollout.py). Arguments in TRL's order. The trainer's
    TRL attributes are in sampling/trl_attributes.py, its prompt datasets in sampling/prompts.py."""

    config_class = GRPOConfig
    _tag_names = ("trainers", "grpo")  # the model card tags added to the model (TRL: ["trl", "grpo"])
    advantage_estimator = "grpo"  # the round's advantages: an entry of ADVANTAGE_ESTIMATORS (sampling/advantages.py)

    def __init__(self, model, reward_funcs=None, args: GRPOConfig | None = None, train_dataset=None, eval_dataset=None,
                 processing_class=None, reward_processing_classes=None, callbacks=None, optimizers=(None, None),
                 quantization_config=None, peft_config=None, tools=None, rollout_func=None, environment_factory=None):
        self.entropy_control: EntropyControl | None = None  # the entropy bonus's coefficient (after_prepare)
        super().__init__(model, reward_funcs, args, train_dataset, eval_dataset, processing_class,
                         reward_processing_classes, callbacks, optimizers, quantization_config, peft_config, tools,
                         rollout_func, environment_factory)

    def round_needs(self) -> RoundNeeds:
        """The base's, and the importance weights of another sampler's completions (vllm_importance_sampling_*)."""
        return dataclasses.replace(super().round_needs(), importance=self.args.importance_correction)

    def prepare_data(self, train_dataset, eval_dataset) -> None:
        args = self.args
        other_sampler = "a rollout_func" if self.rollout_func is not None else "use_vllm" if args.use_vllm else None
        warn = logger.warning if self.accelerator.is_main_process else (lambda message: None)
        check_loss_options(args, other_sampler, warn)
        super().prepare_data(train_dataset, eval_dataset)

    def build_scorer(self) -> LogProbScorer:
        return super().build_scorer(entropy_bonus=self.entropy_control is not None,
                                    folds_sampler_weights=self.args.loss_type in FOLDS_SAMPLER_WEIGHTS)

    def after_prepare(self) -> None:
        args = self.args
        self.entropy_control = EntropyControl(
            args.entropy_coef, args.use_adaptive_entropy, args.entropy_target, args.entropy_coef_delta,
            args.entropy_coef_min, args.entropy_coef_max) if args.entropy_coef or args.use_adaptive_entropy else None
        super().after_prepare()

    # ------------------------------------------------------------------ loss

    def compute_loss(self, model, batch: MicroBatch, counts: BatchCounts) -> tuple[torch.Tensor, Stats]:
        args, bonus = self.args, self.entropy_control
        # dr_grpo normalizes by the longest possible completion (the base loop's counts do not know GRPO)
        counts = GRPOCounts(**dataclasses.asdict(counts), max_completion_length=args.max_completion_length)
        # One autocast (bf16 mixed precision) around the micro-batch's forwards (the shared prompt's two, the rows
        # without a gradient): inside it autocast casts each weight to bf16 once for all of them. Each forward's
        # own would cast anew, and backward would keep a copy per forward (+2 bytes per parameter at the peak).
        with self.accelerator.autocast():
            out = self.scorer.training_forward(model, batch, with_entropy=True,
                                               with_router_loss=bool(self.router_aux_loss_coef),
                                               entropy_grad=bonus is not None)
        logps, mask, advantages = out["logps"], batch.loss_mask, batch.advantages  # [B, C], [B, C], [B]
        old = batch.old_logps if batch.old_logps is not None else logps.detach()
        policy = OBJECTIVES[args.loss_type](PolicyInputs(logps, old, advantages, mask, batch.sampler_weights), args)
        per_token = policy.per_token  # [B, C] or [B, 1]
        if args.off_policy_mask_threshold is not None:  # [B, 1]: whole completions
            # as TRL, measured from the sampler's log-probs when a rollout function gave them (both sources of
            # off-policyness: optimizer steps and the sampler's own numerics)
            behaviour = batch.sampler_logps if batch.sampler_logps is not None else old
            per_token = per_token * self.off_policy_kept(logps, behaviour, advantages, mask)
        kept = mask  # [B, C]: the tokens the policy loss (and an entropy bonus) acts on
        if args.top_entropy_quantile < 1.0:  # the high-entropy tokens only
            kept = mask * self.high_entropy_tokens(out["entropy"], mask)
            per_token = per_token * kept
        stats: Stats = {"entropy": ((out["entropy"] * mask).sum(), mask.sum())}
        if args.beta > 0:
            kl = k3_kl(logps, batch.ref_logps)
            if args.use_bias_correction_kl:
                # importance-weighted, so it estimates KL(pi || ref) under the current policy (TRL's default); the
                # ratio is differentiable, so the gradient changes even where its value is 1
                kl = kl * torch.exp(importance_log_weights(logps, old, mask, args.importance_sampling_level))
            per_token = per_token + args.beta * kl
            stats["kl"] = ((kl.detach() * mask).sum(), mask.sum())
        loss = self.add_router_loss(AGGREGATIONS[args.loss_type](per_token, mask, counts), out, counts, stats)
        if bonus is not None:  # TRL's entropy regularization
            stats["policy_loss"] = (loss.detach(), 1.0 / counts.micro_batches)  # summed over the step, as "loss"
            loss = loss - bonus.applied * entropy_bonus(out["entropy"], kept, counts)
            # the step's entropy over those tokens, for the adaptive coefficient (after_optimizer_step reads it)
            stats["entropy_bonus/entropy"] = ((out["entropy"].detach() * kept).sum(), kept.sum())
        stats |= policy_loss_stats(policy, mask, per_completion=args.importance_sampling_level == "sequence")
        return loss, stats

    def off_policy_kept(self, logps: torch.Tensor, behaviour: torch.Tensor, advantages: torch.Tensor,
                        mask: torch.Tensor) -> torch.Tensor:
        """off_policy_mask_threshold: [B, 1], 0 for a completion with a negative advantage whose mean
        log pi_behaviour - log pi over ``mask`` exceeds the threshold (DeepSeek-V3.2's sequence mask), else 1."""
        return off_policy_sequence_mask(logps, behaviour, advantages, mask, self.args.off_policy_mask_threshold)

    def high_entropy_tokens(self, entropy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """top_entropy_quantile: [B, C], 1 on the loss tokens at or above the (1 - top_entropy_quantile) quantile
        of the entropy of every process's loss tokens in this micro-batch (none when there are none), as TRL."""
        values = dist.gather_varlen(self.accelerator, entropy.detach()[mask.bool()].float())
        threshold = (torch.tensor(float("inf"), device=entropy.device) if values.numel() == 0
                     else torch.quantile(values, 1.0 - self.args.top_entropy_quantile))
        return high_entropy_mask(entropy, mask, threshold)

    def after_optimizer_step(self, metrics: dict) -> None:
        """The base's (round metrics, the reference's sync); then the entropy bonus's coefficient adapted to the
        step's entropy (and logged)."""
        super().after_optimizer_step(metrics)
        if self.entropy_control is not None:
            self.entropy_control.update(metrics.pop("entropy_bonus/entropy"))
            metrics["entropy_coef"] = self.entropy_control.coef

    @property
    def entropy_coef(self) -> float:
        """TRL's attribute: the entropy bonus's coefficient now (with use_adaptive_entropy it moves every step)."""
        control = self.entropy_control  # set once training is set up (after_prepare)
        return control.coef if control is not None else self.args.entropy_coef

    @staticmethod
    def get_off_policy_mask(advantages: torch.Tensor, per_token_logps: torch.Tensor,
                            sampling_per_token_logps: torch.Tensor, mask: torch.Tensor,
                            off_policy_threshold: float) -> torch.Tensor:
        """TRL's public helper: DeepSeek-V3.2's off-policy sequence mask, [B, 1] (1 keep, 0 drop), for
        advantages [B, 1] or [B] and log-probs and mask [B, T] (padding: mask 0). A completion is dropped when its
        advantage is negative and its mean KL(sampler || policy) over the mask exceeds the threshold; tokens the
        sampler did not score (NaN) count 0. The loss uses the same function (``off_policy_sequence_mask``)."""
        return off_policy_sequence_mask(per_token_logps, sampling_per_token_logps, advantages.reshape(-1), mask,
                                        off_policy_threshold)

    # ------------------------------------------------------------------ resume

    def save_extra_state(self, folder: str) -> None:
        super().save_extra_state(folder)
        if self.entropy_control is not None:
            save_entropy_control(folder, self.accelerator.process_index, self.entropy_control)

    def load_extra_state(self, folder: str) -> None:
        super().load_extra_state(folder)
        if self.entropy_control is not None:
            load_entropy_control(folder, self.accelerator.process_index, self.entropy_control)
