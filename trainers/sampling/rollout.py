"""The rollout stage of the sampling trainers (GRPO, RLOO, distillation): one generation round, built forward
from the round's dataset rows to a ``Rollout``. Followed from here to the loss, a round crosses these files:

    rows -> sample: the generation backend (the policy,       RolloutStage.sample_and_score
            vLLM, a rollout_func or a registered one,          generation/backend.py
            returning Samples; with tools, the tool loop
            over it: agents/tool_loop.py), or completions
            given (async, a dataset's), then decoded
         -> score: the reward functions                       sampling/rewards.py
         -> gather the rewards of every process
         -> pad -> loss mask -> Rollout                        sampling/batch.py (padded_rollout)
         -> old and reference log-probs, as ``RoundNeeds``     sampling/scoring.py (LogProbScorer)
            says
         -> advantages: the trainer's estimator, if it has     sampling/advantages.py (ADVANTAGE_ESTIMATORS)
            one; dynamic sampling's groups out of the mask
         -> another sampler's log-probs against the policy's   sampling/scoring.py (compare_sampler)
            (importance weights)
         -> metrics and the completions table                  here (round_metrics, sample_records)
         -> Round: the Rollout, which the trainer's            sampling/batch.py (Rollout.micro_batch)
            micro-batches are cut from, for its loss           grpo/trainer.py and grpo/objectives.py (or
                                                               rloo/, distillation/)

``RolloutStage`` is built once, from what it uses (never the trainer), and calls nothing back in the trainer: the
trainer passes what changes per round (the TrainerState for the reward functions) and fires its own events with
what the round returns. Every process runs it together: sampling may gather weights (ZeRO-3), rewards are
gathered, and a failure in user code on one process stops all (``dist.raise_together``). The backend's weights are
synced before the stage runs (SamplingTrainer.prepare_step). Evaluation builds its batches with the same steps
(``evaluation_round``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from trainers.agents.tool_loop import Episode, ToolLoop, tool_metrics
from trainers.data.formats import is_conversational
from trainers.errors import RemoteServiceError
from trainers.generation.backend import Backend, PolicyBackend
from trainers.generation.sampling import Samples, SamplingParams
from trainers.parallel import distributed as dist
from trainers.sampling.advantages import (
    AdvantageEstimator,
    AdvantageInputs,
    RoundAdvantages,
    combine_rewards,
    nanstd,
)
from trainers.sampling.batch import Rollout, padded_rollout
from trainers.sampling.reward_functions import completion_text
from trainers.sampling.rewards import Reward, RewardLogs, call_rewards
from trainers.sampling.scoring import ImportanceCorrection, LogProbScorer, compare_sampler, padded_logprobs


@dataclass(frozen=True)
class Sampled:
    """This process's completions of a round (or an evaluation batch): what the backend (or the tool loop)
    returned, the rows' dataset prompts, the completions decoded (or the tool loop's messages), the tool loop's
    episode; once scored, the rewards and what the reward functions logged."""

    samples: Samples
    prompts: list
    completions: list  # text, or [{"role": "assistant", "content": text}] for a conversational prompt
    episode: Episode | None = None  # with tools: the tool loop's episode (its counts: what the tool calls did)
    version: int | None = None  # asynchronous GRPO: the optimizer step whose weights sampled the round
    rewards_per_func: torch.Tensor | None = None  # [n, F] float32, NaN where a function returned None; None: unscored
    logs: RewardLogs = field(default_factory=RewardLogs)  # what the reward functions passed to log_metric / log_extra


def sample_rows(backend: Backend, tool_loop: ToolLoop | None, tokenizer, rows: list[dict],
                prompt_ids: list[list[int]], params: SamplingParams, eos_ids: set[int], accelerator) -> Sampled:
    """One completion per row through ``backend`` (with tools, ``tool_loop`` over it), decoded. Every process of
    ``accelerator`` calls it together (``dist.ThisProcess``: this process alone, GRPO's asynchronous producer)."""
    if tool_loop is not None:  # several turns, tool calls between them (trainers/agents/tool_loop.py)
        episode = tool_loop.run(backend, rows, prompt_ids, params, eos_ids=eos_ids, accelerator=accelerator)
        return Sampled(episode.samples, episode.prompts, episode.messages, episode)
    samples = backend.sample([row["prompt"] for row in rows], prompt_ids, params)
    prompts, completions = decode(tokenizer, rows, samples.completion_ids)
    return Sampled(samples, prompts, completions)


@dataclass(frozen=True)
class RoundNeeds:
    """What a round computes beyond its samples and rewards, as the trainer's loss and advantage estimator ask:
    the old log-probs (the policy before the round's optimizer steps), the reference's (a KL), dynamic_sampling's
    groups without reward variance out of the loss, and the importance weights of another sampler's completions
    (None: not weighted; the sampler's log-probs are still compared with the policy's, as metrics, where the
    trainer has a log-prob scorer)."""

    old_logps: bool = False
    ref_logps: bool = False
    dynamic_sampling: bool = False
    importance: ImportanceCorrection | None = None


@dataclass(frozen=True)
class Round:
    """What building a round gives the trainer: the rows to train on, and what it logs about them."""

    rollout: Rollout
    metrics: dict[str, float]  # TRL's round metrics over every process (evaluation: the estimator's own)
    completions: list[dict] | None  # log_completions: every process's records (main process writes them)
    sampled: Sampled  # this process's samples as the backend (and the tool loop) returned them, and their rewards


class RolloutStage:
    """The rollout stage, built once the policy is prepared, from what it uses (never the trainer): the generation
    ``backend``, the ``tool_loop`` strategy (None: one turn, the backend's own ``sample``), the reward functions
    and their weights, the log-prob ``scorer`` (old and reference log-probs, the rows skip_zero_gradient_rows
    skips; None: a trainer whose loss reads none, distillation's), the config, the processes' ``accelerator``, the
    tokenizer (decoding), the EOS ids, the default sampling parameters, what the round computes (``needs``) and
    the trainer's advantage ``estimator`` (an entry of ADVANTAGE_ESTIMATORS; None: no advantages). Every process
    calls its methods together."""

    def __init__(self, backend: Backend, tool_loop: ToolLoop | None, rewards: list[Reward],
                 reward_weights: torch.Tensor, scorer: LogProbScorer | None, args: Any, accelerator, tokenizer,
                 eos_ids: set[int], sampling: SamplingParams, needs: RoundNeeds,
                 estimator: AdvantageEstimator | None):
        self.backend, self.tool_loop, self.rewards, self.reward_weights = backend, tool_loop, rewards, reward_weights
        self.scorer, self.args, self.accelerator, self.tokenizer = scorer, args, accelerator, tokenizer
        self.eos_ids, self.sampling, self.needs, self.estimator = eos_ids, sampling, needs, estimator
        # a backend other than the policy itself: its log-probs are compared with the policy's (importance weights)
        self.other_sampler = scorer is not None and not isinstance(backend, PolicyBackend)

    def sample_and_score(self, rows: list[dict], prompt_ids: list[list[int]], trainer_state: Any,
                         params: SamplingParams | None = None, score: bool = True,
                         sampled: Sampled | None = None) -> Sampled:
        """Sample one completion per row through the backend (with tools, the tool loop over it), decode it,
        and (with ``score``) call the reward functions, which get ``trainer_state`` (TRL's contract).
        ``score=False`` on a process that only keeps the others company in the collectives (evaluation's last
        batch). ``sampled``: the rows sampled already (the asynchronous producer, a dataset's completions),
        scored here. The backend holds this step's weights already (``Backend.sync_weights``, called by the
        trainer before a round)."""
        acc = self.accelerator
        if sampled is None:
            sampled = sample_rows(self.backend, self.tool_loop, self.tokenizer, rows, prompt_ids,
                                  params or self.sampling, self.eos_ids, acc)
        episode, logs, rewards, error = sampled.episode, RewardLogs(), None, None
        if score:
            try:  # user code: a failure on one process must stop all of them
                environments = episode.environments if episode is not None else None
                rewards = self.score_completions(rows, sampled.prompts, sampled.completions, sampled.samples, logs,
                                                 trainer_state, environments)
            except Exception as caught:
                error = caught
        if episode is not None and self.tool_loop is not None:
            self.tool_loop.give_back(episode)  # scored: its environments may serve another round
        # a reward server's or sandbox server's failure is answered like the vLLM server's: a checkpoint, together
        dist.raise_together(acc, error, shared=(RemoteServiceError,))
        return dataclasses.replace(sampled, rewards_per_func=rewards, logs=logs)

    def score_completions(self, rows: list[dict], prompts: list, completions: list, samples: Samples,
                          logs: RewardLogs, trainer_state: Any, environments: list | None = None) -> torch.Tensor:
        """[n, F] rewards of this process's completions (NaN where a function returned None). The dataset's other
        columns are passed by name; a rollout function's extra fields replace columns of the same name (as TRL);
        with an environment_factory, ``environments`` (each rollout's instance) too."""
        columns = {key: [row[key] for row in rows] for key in rows[0]}
        columns.update(samples.extra)
        if environments is not None:
            columns["environments"] = environments
        # as in TRL, columns named like the call's own arguments are not passed on
        columns = {key: values for key, values in columns.items()
                   if key not in ("prompt", "completion", "completion_ids")}
        return call_rewards(self.rewards, prompts, completions, samples.completion_ids, columns,
                            {"trainer_state": trainer_state}, logs)

    def padded_rollout(self, samples: Samples) -> tuple[Rollout, torch.Tensor, torch.Tensor]:
        """``padded_rollout`` (sampling/batch.py) on the device: (the Rollout, truncated [n], model_tokens
        [n, C])."""
        rollout, truncated, model_tokens = padded_rollout(samples, self.tokenizer.pad_token_id,
                                                          self.args.pad_to_multiple_of, self.eos_ids,
                                                          self.args.mask_truncated_completions)
        return rollout.to(self.accelerator.device), truncated, model_tokens

    def with_logprobs(self, rollout: Rollout, old: bool, ref: bool) -> Rollout:
        """``rollout`` with the policy's log-probs now (``old``: before the round's optimizer steps) and the
        reference's (``ref``), where asked (the others as they were)."""
        if not (old or ref):
            return rollout
        return dataclasses.replace(rollout, old_logps=self.scorer.old_logprobs(rollout) if old else rollout.old_logps,
                                   ref_logps=self.scorer.reference_logprobs(rollout) if ref else rollout.ref_logps)

    def advantages(self, rewards_per_func: torch.Tensor, rollout: Rollout, num_generations: int,
                   over_processes: bool = True) -> RoundAdvantages:
        """The estimator's advantages: of a round (``over_processes``: ``rewards_per_func`` [G, F] holds every
        process's rows; every process calls this together) or of this process's evaluation batch (its own rows,
        whole groups; no collectives). ``rollout``: this process's rows, with the log-probs the estimator reads.
        Without an estimator (distillation): the rewards alone, for the metrics, and no advantages."""
        if self.estimator is None:
            rewards = combine_rewards(rewards_per_func, self.reward_weights)  # [G]
            groups = rewards.view(-1, num_generations)  # [G / num_generations, num_generations]
            return RoundAdvantages(rewards, torch.zeros_like(rewards), torch.zeros(len(groups), dtype=torch.bool),
                                   nanstd(groups, dim=1))
        inputs = AdvantageInputs(rewards_per_func, self.reward_weights, num_generations, rollout, self.accelerator,
                                 over_processes)
        return self.estimator.estimate(inputs, self.args)

    @torch.no_grad()
    def build(self, rows: list[dict], prompt_ids: list[list[int]], trainer_state: Any,
              sampled: Sampled | None = None) -> Round:
        """The rollout stage for this process's ``rows`` of one round (module docstring); ``trainer_state``: what
        the reward functions get; ``sampled``: its completions sampled already (the asynchronous producer,
        trainers/sampling/async_rounds.py; a dataset's completions, distillation's off-policy rounds)."""
        args, acc, needs = self.args, self.accelerator, self.needs
        scored = self.sample_and_score(rows, prompt_ids, trainer_state, sampled=sampled)
        rewards_per_func = acc.gather(scored.rewards_per_func.to(acc.device)).cpu()  # [G, F], every process's rows
        n, start = len(rows), acc.process_index * len(rows)

        rollout, truncated, model_tokens = self.padded_rollout(scored.samples)
        rollout = self.with_logprobs(rollout, needs.old_logps, needs.ref_logps)
        adv = self.advantages(rewards_per_func, rollout, args.num_generations)
        advantages, loss_mask = adv.advantages[start:start + n], rollout.loss_mask  # [n], [n, C]
        if needs.dynamic_sampling:  # the groups whose rewards are all equal leave the loss
            group_of_row = torch.arange(start, start + n) // args.num_generations  # [n]
            loss_mask = loss_mask.masked_fill(adv.zero_std[group_of_row].to(loss_mask.device).unsqueeze(1), 0.0)
        rollout = dataclasses.replace(rollout, loss_mask=loss_mask, advantages=advantages.to(acc.device))
        sampler_metrics = {}
        if self.other_sampler:
            width = rollout.completion_ids.shape[1]
            logprobs = scored.samples.logprobs
            sampler = None if logprobs is None else padded_logprobs(logprobs, width)  # [n, C]
            rollout, sampler_metrics = compare_sampler(acc, self.scorer, rollout, sampler, model_tokens.to(acc.device),
                                                       needs.importance)
        # which rows skip_zero_gradient_rows leaves out of the backward, read once here, not per micro-batch
        if self.scorer is not None:
            rollout = rollout.with_roles(self.scorer.row_roles(rollout))

        lengths = acc.gather(model_tokens.sum(1).to(acc.device)).float().cpu()  # TRL: the model's tokens only
        all_truncated = acc.gather(truncated.float().to(acc.device)).cpu()
        names = [r.name for r in self.rewards]
        metrics = round_metrics(adv.rewards, rewards_per_func, names, adv.std_in_use, lengths, all_truncated)
        metrics.update(adv.metrics)
        if needs.dynamic_sampling:
            metrics["dynamic_sampling/dropped_groups"] = int(adv.zero_std.sum())
        metrics.update(sampler_metrics)
        if scored.episode is not None:
            metrics.update(tool_metrics(acc, scored.episode.counts))
        metrics.update(logged_metric_means(acc, scored.logs))
        completions = None
        if args.log_completions:
            # asynchronous GRPO: which weights sampled each completion (TRL's trace field: its oldest token's) and,
            # with in-flight weight updates, each token's; a reward function's own log_extra column of that name
            # is kept instead
            version = {} if scored.version is None else {"model_version": [scored.version] * n}
            if scored.samples.versions is not None:
                version["version_spans"] = [version_spans(row) for row in scored.samples.versions]
            local = sample_records(scored.prompts, scored.completions, names, rewards_per_func[start:start + n],
                                   adv.rewards[start:start + n], advantages, {**version, **scored.logs.extra})
            completions = dist.gather_objects(acc, local)
        return Round(rollout, metrics, completions, scored)

    @torch.no_grad()
    def evaluation_round(self, rows: list[dict], prompt_ids: list[list[int]], trainer_state: Any,
                         num_generations: int, score: bool = True) -> Round:
        """One evaluation batch, built as a round is (sample, score, pad, log-probs, advantages), over this
        process's rows alone: whole groups of ``num_generations``, their advantages from their own rewards (no
        collectives beyond the backend's and the reward functions'). ``score=False``: a companion batch, run for
        the collectives only, whose rewards are 0. Its Rollout has no old log-probs (sampled from the current
        policy, every importance ratio is 1) and no sampler correction; its metrics are the estimator's own."""
        scored = self.sample_and_score(rows, prompt_ids, trainer_state, score=score)
        rewards_per_func = scored.rewards_per_func
        if rewards_per_func is None:
            rewards_per_func = torch.zeros(len(rows), len(self.rewards))
        rollout, _, _ = self.padded_rollout(scored.samples)
        old = self.estimator is not None and self.estimator.needs_old_logps(self.args)  # RLOO's KL reads them
        rollout = self.with_logprobs(rollout, old=old, ref=self.needs.ref_logps)
        adv = self.advantages(rewards_per_func, rollout, num_generations, over_processes=False)
        rollout = dataclasses.replace(rollout, advantages=adv.advantages.to(self.accelerator.device), old_logps=None)
        return Round(rollout, dict(adv.metrics), None, scored)


def decode(tokenizer, rows: list[dict], completion_ids: list[list[int]]) -> tuple[list, list]:
    """(prompts, completions): completions as text, or as one assistant message for a conversational prompt."""
    texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    prompts = [row["prompt"] for row in rows]
    completions = [[{"role": "assistant", "content": t}] if is_conversational(p) else t
                   for p, t in zip(prompts, texts)]
    return prompts, completions


def round_metrics(rewards: torch.Tensor, rewards_per_func: torch.Tensor, reward_names: list[str],
                  std_in_use: torch.Tensor, lengths: torch.Tensor, truncated: torch.Tensor) -> dict[str, float]:
    """TRL's metrics of one round, over every process's completions.

    rewards: [N] weighted sums; rewards_per_func: [N, F] (NaN where a function returned None); std_in_use: the
    std the advantages were scaled by (per group, or the batch's); lengths, truncated: [N] completion lengths
    and whether each hit max_completion_length. No reward functions: the completion metrics only."""
    metrics = {}
    if reward_names:  # without reward functions (distillation), no reward metrics
        zero = torch.isclose(std_in_use, torch.zeros_like(std_in_use))  # a NaN std (one scored completion): not 0
        metrics = {"reward": float(torch.nanmean(rewards)), "reward_std": float(nanstd(rewards)),
                   "frac_reward_zero_std": float(zero.float().mean())}
    metrics.update({"completions/mean_length": float(lengths.mean()), "completions/min_length": float(lengths.min()),
                    "completions/max_length": float(lengths.max()),
                    "completions/clipped_ratio": float(truncated.mean())})
    terminated = lengths[truncated == 0]  # the completions that ended with EOS; TRL logs 0 when none did
    terminated = terminated if len(terminated) else torch.zeros(1)
    metrics.update({"completions/mean_terminated_length": float(terminated.mean()),
                    "completions/min_terminated_length": float(terminated.min()),
                    "completions/max_terminated_length": float(terminated.max())})
    for name in dict.fromkeys(reward_names):  # functions of one name: their mean, as in TRL
        columns = [rewards_per_func[:, i] for i, n in enumerate(reward_names) if n == name]
        metrics[f"rewards/{name}/mean"] = sum(float(torch.nanmean(c)) for c in columns) / len(columns)
        metrics[f"rewards/{name}/std"] = sum(float(nanstd(c)) for c in columns) / len(columns)
    return metrics


def version_spans(versions: list[int | None]) -> list[list[int | None]]:
    """One completion's per-token weight versions as [version, first token, end] runs, e.g. [[3, 0, 5], [4, 5, 8]]:
    tokens 0-4 sampled with step 3's weights, 5-7 with step 4's (None: tokens the model did not write)."""
    spans: list[list[int | None]] = []
    for i, version in enumerate(versions):
        if spans and spans[-1][0] == version:
            spans[-1][2] = i + 1
        else:
            spans.append([version, i, i + 1])
    return spans


def sample_records(prompts: list, completions: list, reward_names: list[str], rewards_per_func: torch.Tensor,
                   rewards: torch.Tensor, advantages: torch.Tensor, extra: dict) -> list[dict]:
    """One record per completion for ``log_completions``: the total and each function's reward (None where it
    returned None), the advantage, and the columns reward functions added with log_extra."""
    records = []
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        per_func = {name: None if math.isnan(v) else v for name, v in zip(reward_names, rewards_per_func[i].tolist())}
        records.append({"prompt": prompt, "completion": completion_text(completion), "reward": float(rewards[i]),
                        "rewards": per_func, "advantage": float(advantages[i]),
                        **{column: values[i] for column, values in extra.items()}})
    return records


def logged_names(accelerator, logged: dict[str, list[float]]) -> dict[str, tuple[float, int]]:
    """(sum, count) per name of what reward functions passed to log_metric on this process (``logged``: name ->
    values), for every name any process logged (every process takes part, whether or not it logged a name)."""
    local = {name: (sum(values), len(values)) for name, values in logged.items()}
    names = sorted({name for part in dist.gather_objects(accelerator, [list(local)]) for name in part})
    return {name: local.get(name, (0.0, 0)) for name in names}


def logged_metric_means(accelerator, logs: RewardLogs) -> dict[str, float]:
    """The mean over every process of each name reward functions passed to log_metric."""
    logged = logged_names(accelerator, logs.metrics)
    if not logged:
        return {}
    totals = dist.all_reduce_sum(accelerator, torch.tensor(list(logged.values()), device=accelerator.device))
    return {name: total / count for name, (total, count) in zip(logged, totals.tolist())}
