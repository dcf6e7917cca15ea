"""RLOOTrainer: TRL 1.16's RLOO, a sibling of GRPO on the sampling base. Everything that samples and scores (the
lean engine, HF generate, vLLM colocated or as a server, a rollout_func, tools and environments, reward functions and
models) is the sampling base's (trainers/sampling/trainer.py), the reference model and the policy's forwards the
policy gradient's (sampling/policy_gradient.py); what RLOO adds is the round's advantages (the advantage estimator
"rloo": the penalized reward and the leave-one-out baseline, trainers/rloo/objective.py) and the loss
(``compute_loss``: the clipped sequence ratio, averaged over the step's completions). The trainer's arguments are
TRL's RLOOTrainer's, in its order, then tools, rollout_func and environment_factory."""

from __future__ import annotations

import torch

from trainers.model.losses import BatchCounts
from trainers.rloo.config import RLOOConfig
from trainers.rloo.objective import clipped_sequence_loss
from trainers.sampling.batch import MicroBatch
from trainers.sampling.policy_gradient import PolicyGradientTrainer
from trainers.loop.stats import Extreme, Stats


class RLOOTrainer(PolicyGradientTrainer):
    """Trains a policy with RLOO (REINFORCE Leave-One-Out). The same arguments and reward contract as
    GRPOTrainer."""

    config_class = RLOOConfig
    _tag_names = ("trainers", "rloo")
    advantage_estimator = "rloo"  # the penalized reward and the leave-one-out baseline (trainers/rloo/objective.py)

    def __init__(self, model, reward_funcs=None, args: RLOOConfig | None = None, train_dataset=None,
                 eval_dataset=None, processing_class=None, reward_processing_classes=None, callbacks=None,
                 optimizers=(None, None), quantization_config=None, peft_config=None, tools=None, rollout_func=None,
                 environment_factory=None):
        super().__init__(model, reward_funcs, args, train_dataset, eval_dataset, processing_class,
                         reward_processing_classes, callbacks, optimizers, quantization_config, peft_config, tools,
                         rollout_func, environment_factory)

    def compute_loss(self, model, batch: MicroBatch, counts: BatchCounts) -> tuple[torch.Tensor, Stats]:
        """-min(rho A, clip(rho) A) per completion, rho the ratio of its sequence probabilities over the loss
        tokens; the mean over the step's completions with loss tokens (every micro-batch and process), as TRL's
        per-micro-batch mean is with equal micro-batches. A completion without loss tokens
        (mask_truncated_completions, dynamic_sampling) counts nothing; TRL's mean counts it, as a constant -A.
        The entropy and TRL's clip ratios (of completions) as statistics."""
        args = self.args
        with self.accelerator.autocast():
            out = self.scorer.training_forward(model, batch, with_entropy=True,
                                               with_router_loss=bool(self.router_aux_loss_coef))
        logps, mask = out["logps"], batch.loss_mask  # [B, C]
        old = batch.old_logps if batch.old_logps is not None else logps.detach()
        policy = clipped_sequence_loss(logps.float(), old.float(), batch.advantages, mask, args.epsilon,
                                       args.clip_high)
        counted = mask.sum(-1) > 0  # [B]
        loss = (policy.per_sequence * counted).sum() / max(counts.sequences, 1.0)
        low, high = policy.low_clipped.float(), policy.high_clipped.float()  # [B]
        rows = float(low.shape[0])
        stats: Stats = {
            "entropy": ((out["entropy"] * mask).sum(), mask.sum()),
            "clip_ratio/low_mean": (low.sum(), rows),
            "clip_ratio/high_mean": (high.sum(), rows),
            "clip_ratio/region_mean": ((low + high).sum(), rows),
            # TRL's: the min (max) over every process's completions of whether each was clipped
            "clip_ratio/low_min": Extreme(low.min(), "min"),
            "clip_ratio/high_max": Extreme(high.max(), "max"),
        }
        return self.add_router_loss(loss, out, counts, stats), stats
