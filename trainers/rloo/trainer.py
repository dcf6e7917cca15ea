"""RLOOTrainer: TRL 1.16's RLOO on GRPO's rollout stage. Everything that samples and scores (the lean engine, HF
generate, vLLM colocated or as a server, a rollout_func, tools and environments, reward functions and models) is
GRPOTrainer's; what RLOO changes is the round's advantages (``round_advantages``: the penalized reward and the
leave-one-out baseline, trainers/rloo/objective.py) and the loss (``compute_loss``: the clipped sequence ratio,
averaged over the step's completions). The trainer's arguments are TRL's RLOOTrainer's, in its order, then
GRPOTrainer's tools, rollout_func and environment_factory."""

from __future__ import annotations

import torch

from trainers import distributed as dist
from trainers.grpo.advantages import RoundAdvantages, combine_rewards, nanstd
from trainers.grpo.batch import MicroBatch, Rollout
from trainers.grpo.trainer import GRPOTrainer
from trainers.losses import BatchCounts
from trainers.rloo.config import RLOOConfig
from trainers.rloo.objective import clipped_sequence_loss, leave_one_out_advantages, penalized_rewards, sequence_kl
from trainers.stats import Extreme, Stats


class RLOOTrainer(GRPOTrainer):
    """Trains a policy with RLOO (REINFORCE Leave-One-Out). The same arguments and reward contract as
    GRPOTrainer."""

    config_class = RLOOConfig
    _tag_names = ("trainers", "rloo")

    def prepare_data(self, train_dataset, eval_dataset) -> None:
        super().prepare_data(train_dataset, eval_dataset)
        # the KL penalty is on the policy that sampled (log pi_old - log pi_ref), so with beta it is always needed
        self.need_old_logps = self.need_old_logps or self.args.beta > 0

    def round_advantages(self, rewards_per_func: torch.Tensor, rollout: Rollout, num_generations: int,
                         over_processes: bool = True) -> RoundAdvantages:
        """RLOO's advantages (GRPOTrainer.round_advantages' contract): each completion's weighted reward, clipped
        to reward_clip_range, less beta x its KL to the reference (summed over its loss tokens, from the old
        log-probs: the policy that sampled), minus the mean of the other scorable completions of its prompt;
        normalized over the round with normalize_advantages. Also the round's kl: the per-token mean over every
        process of log pi_old - log pi_ref."""
        args, acc = self.args, self.accelerator
        metrics, kl = {}, None
        if args.beta > 0:
            old = rollout.old_logps if rollout.old_logps is not None else self.scorer.old_logprobs(rollout)
            mask = rollout.loss_mask
            kl = sequence_kl(old.float(), rollout.ref_logps.float(), mask)  # [n]
            totals = torch.stack([kl.sum(), mask.sum()])
            if over_processes:
                kl, totals = acc.gather(kl), dist.all_reduce_sum(acc, totals)
            metrics["kl"] = float(totals[0] / totals[1].clamp(min=1.0))
            kl = kl.cpu()
        weights = self.reward_weights
        rewards = penalized_rewards(rewards_per_func, weights, args.reward_clip_range, kl, args.beta)  # [G]
        advantages = leave_one_out_advantages(rewards, num_generations, args.normalize_advantages)
        std = nanstd(rewards.view(-1, num_generations), dim=1)  # frac_reward_zero_std, over the penalized rewards
        zero_std = torch.isclose(torch.nan_to_num(std, nan=0.0), torch.zeros_like(std))
        # the logged reward is the functions' weighted sum, without the penalty (as TRL logs it)
        return RoundAdvantages(combine_rewards(rewards_per_func, weights), advantages, zero_std, std, metrics)

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
