"""Evaluation of the sampling trainers: ``num_generations_eval`` completions per eval prompt, each batch built by
the rollout stage as a round is (``RolloutStage.evaluation_round``), then the trainer's loss on it; reported are
the rewards and the loss (transformers' ``eval_loss``) with its statistics.

The loss is TRL's evaluation loss: the trainer's loss on the evaluation batch, with the advantages of its own
groups, computed as one micro-batch without accumulation (TRL's ``prediction_step`` calls ``compute_loss`` in eval
mode). Sampled from the current policy, every importance ratio is 1, so with loss_type='grpo' it is about 0 plus
the KL term; the entropy bonus (``policy_loss`` beside it) and the clip and entropy statistics are reported as in
training. A sampler other than the policy (vLLM, a rollout_func) gets no importance-sampling correction here (TRL
applies vLLM's in evaluation too).

The trainer runs the batches (``SamplingTrainer.evaluation_stats``); what is here is pure bookkeeping: which
prompts each batch holds, the micro-batch the loss sees, and the sums the batches add to.
"""

from __future__ import annotations

import torch

from trainers.agents.tool_loop import ToolCounts, tool_metrics
from trainers.loop.stats import Extreme, Stats
from trainers.model.losses import BatchCounts
from trainers.sampling.advantages import combine_rewards
from trainers.sampling.batch import MicroBatch, Rollout
from trainers.sampling.rollout import Round, logged_names
from trainers.sampling.rewards import Reward


def evaluation_batches(num_prompts: int, prompts_per_batch: int, accelerator) -> list[list[int]]:
    """This process's eval prompts (indices), batch by batch, as many batches on every process: its share is every
    ``num_processes``-th prompt; an empty batch keeps the others company in the collectives and counts nothing."""
    world, rank = accelerator.num_processes, accelerator.process_index
    mine, per_process = list(range(rank, num_prompts, world)), -(-num_prompts // world)
    return [mine[start:start + prompts_per_batch] for start in range(0, per_process, prompts_per_batch)]


def loss_batch(rollout: Rollout) -> tuple[MicroBatch, BatchCounts]:
    """The whole evaluation batch as one micro-batch, and its loss counts (no accumulation, as TRL's
    ``prediction_step``)."""
    loss_mask = rollout.loss_mask  # [n, C]
    counts = BatchCounts(tokens=float(loss_mask.sum()), sequences=float((loss_mask.sum(-1) > 0).sum()),
                         micro_batches=1)
    return rollout.micro_batch(0, len(loss_mask)), counts


class EvaluationTotals:
    """The sums of an evaluation's batches on this process, as (sum, count) pairs the caller sums over processes:
    the mean reward (and each function's, functions of one name pooled), the loss and its statistics (each batch
    counting once: transformers averages the batches' losses), what reward functions passed to log_metric, and
    with tools, the tool calls' metrics."""

    def __init__(self, rewards: list[Reward], reward_weights: torch.Tensor, accelerator, tools: bool):
        self.rewards, self.weights, self.accelerator, self.tools = rewards, reward_weights, accelerator, tools
        device = accelerator.device
        self.sums = torch.zeros(len(rewards) + 1, device=device)  # [F + 1]: the total, then each function
        self.counts = torch.zeros(len(rewards) + 1, device=device)
        self.pooled: Stats = {}
        self.logged: dict[str, list[float]] = {}  # log_metric calls of every batch
        self.tool_counts = ToolCounts()  # with tools: what the evaluation's tool calls did on this process

    def add(self, built: Round, loss: torch.Tensor, stats: Stats, counted: bool) -> None:
        """One batch: the stage's ``built`` round, the trainer's ``loss`` and ``stats`` on it. ``counted=False``:
        a companion batch, which weighs nothing (and reports the same names as the others)."""
        device, weight, sampled = self.accelerator.device, float(counted), built.sampled
        batch_stats: Stats = {"loss": (loss.detach().float() * weight, torch.tensor(weight, device=device))}
        for name, value in built.metrics.items():  # the estimator's own (RLOO's kl), each batch counting once
            batch_stats[name] = (torch.tensor(value * weight, device=device), torch.tensor(weight, device=device))
        for name, entry in stats.items():
            if isinstance(entry, Extreme) or name == "entropy_bonus/entropy":  # per-step controls, not evaluation's
                continue
            value, count = (torch.as_tensor(part, device=device, dtype=torch.float32) for part in entry)
            batch_stats[name] = (value * weight, count * weight)
        for name, (value, count) in batch_stats.items():
            total, counted_so_far = self.pooled.get(name, (0.0, 0.0))
            self.pooled[name] = (total + value, counted_so_far + count)
        for name, values in sampled.logs.metrics.items():
            self.logged.setdefault(name, []).extend(values)
        if counted and sampled.episode is not None:  # a companion batch's dummy rollouts count nothing
            self.tool_counts += sampled.episode.counts
        if sampled.rewards_per_func is None:  # not scored: a companion batch
            return
        per_func = sampled.rewards_per_func.to(device)  # [n, F]
        total = combine_rewards(per_func, self.weights.to(device))  # [n]
        values = torch.cat([total.unsqueeze(1), per_func], dim=1)  # [n, F + 1]
        self.sums += torch.nan_to_num(values).sum(0)
        self.counts += (~torch.isnan(values)).sum(0)

    def stats(self) -> Stats:
        """Every sum as a (sum, count) pair of this process. Every process calls it together (the names reward
        functions logged are gathered)."""
        acc, device, pooled = self.accelerator, self.accelerator.device, dict(self.pooled)
        names = (["reward"] if self.rewards else []) + [f"rewards/{r.name}/mean" for r in self.rewards]
        for i, name in enumerate(names):  # functions of one name pool their values
            total, count = pooled.get(name, (0.0, 0))
            pooled[name] = (total + self.sums[i], count + self.counts[i])
        for name, (total, count) in logged_names(acc, self.logged).items():  # summed over processes by the caller
            pooled[name] = (torch.tensor(total, device=device), torch.tensor(float(count), device=device))
        if self.tools:  # a training round's tools/* metrics, already over every process: the main process
            main = float(acc.is_main_process)  # carries each as value / 1 through the caller's sum
            for name, value in tool_metrics(acc, self.tool_counts).items():
                pooled[name] = (torch.tensor(value * main, device=device), torch.tensor(main, device=device))
        return pooled
