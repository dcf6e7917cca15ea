"""GRPO's evaluation: sample ``num_generations_eval`` completions per eval prompt, score them as a training round
is scored, and report the rewards and the GRPO loss on them (transformers' ``eval_loss``).

The loss is TRL's evaluation loss: the objective of ``loss_type`` on the evaluation batch, with the advantages of
its own groups, computed as one micro-batch without accumulation (TRL's ``prediction_step`` calls
``compute_loss`` in eval mode). Sampled from the current policy, every importance ratio is 1, so with
loss_type='grpo' it is about 0 plus the KL term; the entropy bonus (``policy_loss`` beside it) and the clip and
entropy statistics are reported as in training. A sampler other than the policy (vLLM, a rollout_func) gets no
importance-sampling correction here (TRL applies vLLM's in evaluation too).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from trainers.agents.tool_loop import ToolCounts, tool_metrics
from trainers.model.losses import BatchCounts
from trainers.sampling.advantages import combine_rewards
from trainers.sampling.rollout import Scored, logged_names
from trainers.loop.stats import Extreme, Stats


def evaluation_stats(trainer: Any) -> Stats:
    """The mean reward (and each function's), eval_loss and the loss's statistics over the evaluation prompts,
    as (sum, count) pairs of this process (the caller sums them over processes). Every process runs the same
    number of batches: one with no prompts left samples a companion batch that counts nothing."""
    acc, args, device = trainer.accelerator, trainer.args, trainer.accelerator.device
    rows, world = len(trainer.eval_rows), acc.num_processes
    mine, per_process = list(range(acc.process_index, rows, world)), -(-rows // world)
    sums = torch.zeros(len(trainer.rewards) + 1, device=device)
    counts = torch.zeros(len(trainer.rewards) + 1, device=device)
    per_prompt, size = args.num_generations_eval or args.num_generations, trainer.eval_rows_per_batch()
    trainer.backend.sync_weights(trainer.state.global_step)  # the weight sync: evaluation samples this step's policy
    logged: dict[str, list[float]] = {}  # log_metric calls of every batch
    tool_counts = ToolCounts()  # with tools: what the evaluation's tool calls did on this process
    pooled: dict = {}
    for start in range(0, per_process, size):
        chunk = mine[start:start + size]  # empty: this process only keeps the others company in collectives
        indices = [i for i in (chunk or [0]) for _ in range(per_prompt)]  # a prompt's completions stay together
        scored = trainer.stage.sample_and_score([trainer.eval_rows[i] for i in indices],
                                                [trainer.eval_prompt_ids[i] for i in indices], trainer.state,
                                                score=bool(chunk))
        if scored.episode is not None:
            trainer.callback_handler.fire("episode_end", episode=scored.episode)
        for name, pair in loss_stats(trainer, scored, per_prompt, counted=bool(chunk)).items():
            total, count = pooled.get(name, (0.0, 0.0))
            pooled[name] = (total + pair[0], count + pair[1])
        for name, values in scored.logs.metrics.items():
            logged.setdefault(name, []).extend(values)
        if chunk and scored.episode is not None:  # a companion batch's dummy rollouts count nothing
            tool_counts += scored.episode.counts
        trainer.callback_handler.fire("prediction_step")
        if scored.rewards_per_func is None:
            continue
        per_func = scored.rewards_per_func.to(device)
        total = combine_rewards(per_func, trainer.reward_weights.to(device))
        values = torch.cat([total.unsqueeze(1), per_func], dim=1)  # [n, F + 1]
        sums += torch.nan_to_num(values).sum(0)
        counts += (~torch.isnan(values)).sum(0)
    names = (["reward"] if trainer.rewards else []) + [f"rewards/{r.name}/mean" for r in trainer.rewards]
    for i, name in enumerate(names):  # functions of one name pool their values
        total, count = pooled.get(name, (0.0, 0))
        pooled[name] = (total + sums[i], count + counts[i])
    for name, (total, count) in logged_names(acc, logged).items():  # summed over processes by the caller
        pooled[name] = (torch.tensor(total, device=device), torch.tensor(float(count), device=device))
    if trainer.tool_loop is not None:  # a training round's tools/* metrics, already over every process: the
        main = float(acc.is_main_process)  # main process carries each as value / 1 through the caller's sum
        for name, value in tool_metrics(acc, tool_counts).items():
            pooled[name] = (torch.tensor(value * main, device=device), torch.tensor(main, device=device))
    return pooled


def loss_stats(trainer: Any, scored: Scored, per_prompt: int, counted: bool) -> Stats:
    """TRL's evaluation loss of one batch (``loss``, with the objective's statistics), as (value, weight) pairs:
    each batch counts once (transformers averages the batches' losses). ``counted=False``: a companion batch, run
    for the collectives only, weighs nothing. The advantages are those of this batch's groups (each process
    holds whole groups); ``scale_rewards='batch'`` and ``normalize_then_sum`` normalize over this process's batch."""
    args, device = trainer.args, trainer.accelerator.device
    stage, n = trainer.stage, len(scored.samples.completion_ids)
    _, rollout = stage.padded_rollout(scored.samples)
    loss_mask = rollout.loss_mask
    rollout = stage.with_logprobs(rollout, old=False, ref=stage.needs.ref_logps)  # the loss's old ones stay unset
    # this batch's own groups; a companion batch, unscored, gets rewards of 0 (it weighs nothing, and reports the
    # same names as the others, which the caller sums over processes)
    rewards_per_func = scored.rewards_per_func
    if rewards_per_func is None:
        rewards_per_func = torch.zeros(n, len(stage.rewards))
    estimated = rollout  # with the old log-probs where the estimator reads them (RLOO's KL)
    if stage.estimator.needs_old_logps(args):
        estimated = stage.with_logprobs(rollout, old=True, ref=False)
    advantages = stage.advantages(rewards_per_func, estimated, per_prompt, over_processes=False)
    rollout = dataclasses.replace(rollout, advantages=advantages.advantages.to(device))
    batch = rollout.micro_batch(0, n)
    counts = BatchCounts(tokens=float(loss_mask.sum()), sequences=float((loss_mask.sum(-1) > 0).sum()),
                         micro_batches=1)
    loss, stats = trainer.compute_loss(trainer.model_wrapped, batch, counts)
    weight = float(counted)
    out: Stats = {"loss": (loss.detach().float() * weight, torch.tensor(weight, device=device))}
    for name, value in advantages.metrics.items():  # the algorithm's own (RLOO's kl), each batch counting once
        out[name] = (torch.tensor(value * weight, device=device), torch.tensor(weight, device=device))
    for name, entry in stats.items():
        if isinstance(entry, Extreme) or name == "entropy_bonus/entropy":  # per-step controls, not evaluation's
            continue
        value, count = (torch.as_tensor(part, device=device, dtype=torch.float32) for part in entry)
        out[name] = (value * weight, count * weight)
    return out
