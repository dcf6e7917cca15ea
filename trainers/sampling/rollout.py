"""The rollout stage of the sampling trainers (GRPO, RLOO, distillation): one generation round, built forward
from the round's dataset rows to a ``Rollout``.

    rows -> sample (the generation backend: the policy,       RolloutStage.sample_and_score
            vLLM, a rollout_func or a registered one; with tools,
            the tool loop over it: trainers/agents/tool_loop.py;
            or completions given: async, a dataset's)
         -> decode -> score (the reward functions)               RolloutStage.sample_and_score
         -> gather the rewards of every process
         -> pad -> loss masks -> Rollout                         RolloutStage.padded_rollout
         -> old and reference log-probs (as ``RoundNeeds``       RolloutStage.with_logprobs
            says: LogProbScorer, trainers/sampling/scoring.py)
         -> advantages (the trainer's estimator,                 RolloutStage.advantages
            ADVANTAGE_ESTIMATORS, trainers/sampling/advantages.py)
         -> dynamic sampling's dropped groups out of the loss masks
         -> the sampler's log-probs against the trainer's (importance weights)
         -> metrics and the completions table
         -> Rollout (trainers/sampling/batch.py), which the micro-batches are cut from

``RolloutStage`` is built once, from what it uses (never the trainer), and calls nothing back in the trainer: the
trainer passes what changes per round (the TrainerState for the reward functions) and fires its own events with
what the round returns (``Round.episode``). Every process runs it together: sampling
may gather weights (ZeRO-3), rewards are gathered, and a failure in user code on one process stops all
(``dist.raise_together``). The backend's weights are synced before the stage runs (SamplingTrainer.prepare_step).
Evaluation samples and scores through the same ``sample_and_score``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from trainers.parallel import distributed as dist
from trainers.agents.tool_loop import Episode, ToolLoop, tool_metrics
from trainers.data.formats import is_conversational
from trainers.generation.backend import Backend, PolicyBackend
from trainers.generation.sampling import Samples, SamplingParams, ended, left_pad, right_pad
from trainers.generation.user_rollout import logprob_gap, padded_logprobs
from trainers.sampling.advantages import AdvantageEstimator, AdvantageInputs, RoundAdvantages
from trainers.sampling.batch import Rollout, prompt_groups
from trainers.sampling.importance import ImportanceCorrection
from trainers.sampling.metrics import round_metrics, sample_records
from trainers.sampling.rewards import Reward, RewardLogs, call_rewards
from trainers.sampling.scoring import LogProbScorer
from trainers.loop.stats import Extreme, reduce_extremes, reduce_pairs


@dataclass(frozen=True)
class Sampled:
    """This process's completions of a round, before scoring: what the backend (or the tool loop) returned, the
    rows' dataset prompts, the completions decoded (or the tool loop's messages), and the tool loop's episode."""

    samples: Samples
    prompts: list
    completions: list  # text, or [{"role": "assistant", "content": text}] for a conversational prompt
    episode: Episode | None = None
    version: int | None = None  # asynchronous GRPO: the optimizer step whose weights sampled the round


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
class Scored:
    """This process's completions of a round (or an evaluation batch), decoded and scored."""

    samples: Samples
    prompts: list  # the rows' dataset prompts
    completions: list  # text, or [{"role": "assistant", "content": text}] for a conversational prompt
    rewards_per_func: torch.Tensor | None  # [n, F] float32, NaN where a function returned None; None: not scored
    logs: RewardLogs  # what the reward functions passed to log_metric / log_extra
    episode: Episode | None = None  # with tools: the tool loop's episode (its counts: what the tool calls did)
    version: int | None = None  # asynchronous GRPO: the optimizer step whose weights sampled them


@dataclass(frozen=True)
class RoundNeeds:
    """What a round computes beyond its samples and rewards, as the trainer's loss and advantage estimator ask:
    the old log-probs (the policy before the round's optimizer steps), the reference's (a KL), dynamic_sampling's
    groups without reward variance out of the loss, and the importance weights of another sampler's completions
    (None: not weighted; the sampler's log-probs are still compared with the policy's, as metrics)."""

    old_logps: bool = False
    ref_logps: bool = False
    dynamic_sampling: bool = False
    importance: ImportanceCorrection | None = None


@dataclass(frozen=True)
class Round:
    """What building a round gives the trainer: the rows to train on, and what it logs about them."""

    rollout: Rollout
    metrics: dict[str, float]  # TRL's round metrics, over every process
    completions: list[dict] | None  # log_completions: every process's records (main process writes them)
    samples: Samples  # what the backend (and the tool loop) returned, before padding
    episode: Episode | None = None  # with tools: the tool loop's episode (the trainer's on_episode_end)


class RolloutStage:
    """The rollout stage, built once the policy is prepared, from what it uses (never the trainer): the generation
    ``backend``, the ``tool_loop`` strategy (None: one turn, the backend's own ``sample``), the reward functions
    and their weights, the log-prob ``scorer`` (old and reference log-probs, the rows skip_zero_gradient_rows
    skips), the config, the processes' ``accelerator``, the tokenizer (decoding), the EOS ids, the default
    sampling parameters, what the round computes (``needs``) and the trainer's advantage ``estimator`` (an entry
    of ADVANTAGE_ESTIMATORS). Every process calls its methods together."""

    def __init__(self, backend: Backend, tool_loop: ToolLoop | None, rewards: list[Reward],
                 reward_weights: torch.Tensor, scorer: LogProbScorer | None, args: Any, accelerator, tokenizer,
                 eos_ids: set[int], sampling: SamplingParams, needs: RoundNeeds, estimator: AdvantageEstimator):
        self.backend, self.tool_loop, self.rewards, self.reward_weights = backend, tool_loop, rewards, reward_weights
        self.scorer, self.args, self.accelerator, self.tokenizer = scorer, args, accelerator, tokenizer
        self.eos_ids, self.sampling, self.needs, self.estimator = eos_ids, sampling, needs, estimator
        # a backend other than the policy itself: its log-probs are compared with the policy's (importance weights)
        self.other_sampler = not isinstance(backend, PolicyBackend)

    def sample_and_score(self, rows: list[dict], prompt_ids: list[list[int]], trainer_state: Any,
                         params: SamplingParams | None = None, score: bool = True,
                         sampled: Sampled | None = None) -> Scored:
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
        episode, samples = sampled.episode, sampled.samples
        logs, rewards, error = RewardLogs(), None, None
        if score:
            try:  # user code: a failure on one process must stop all of them
                environments = episode.environments if episode is not None else None
                rewards = self.score_completions(rows, sampled.prompts, sampled.completions, samples, logs,
                                                 trainer_state, environments)
            except Exception as caught:
                error = caught
        if episode is not None and self.tool_loop is not None:
            self.tool_loop.give_back(episode)  # scored: its environments may serve another round
        dist.raise_together(acc, error)
        return Scored(samples, sampled.prompts, sampled.completions, rewards, logs, episode, sampled.version)

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

    def padded_rollout(self, samples: Samples, start: int = 0) -> tuple[PaddedSamples, Rollout]:
        """The one way samples become a ``Rollout``: padded (``pad_samples``), the loss mask of the model's tokens
        (``loss_mask_of``: truncated completions out; dynamic sampling's groups come later, from the advantages),
        advantages 0 until they are computed, on the device. ``start``: this process's first row in the round.
        Training rounds, evaluation batches and distillation's dataset rounds all build theirs here."""
        padded = pad_samples(samples, self.tokenizer.pad_token_id, self.args.pad_to_multiple_of, self.eos_ids)
        loss_mask, _ = loss_mask_of(padded.model_tokens, padded.truncated, None, start, self.args)
        n = len(samples.completion_ids)
        return padded, padded.rollout(loss_mask, torch.zeros(n)).to(self.accelerator.device)

    def with_logprobs(self, rollout: Rollout, old: bool, ref: bool) -> Rollout:
        """``rollout`` with the policy's log-probs now (``old``: before the round's optimizer steps) and the
        reference's (``ref``), where asked (the others as they were)."""
        return dataclasses.replace(rollout, old_logps=self.scorer.old_logprobs(rollout) if old else rollout.old_logps,
                                   ref_logps=self.scorer.reference_logprobs(rollout) if ref else rollout.ref_logps)

    def advantages(self, rewards_per_func: torch.Tensor, rollout: Rollout, num_generations: int,
                   over_processes: bool = True) -> RoundAdvantages:
        """The estimator's advantages: of a round (``over_processes``: ``rewards_per_func`` [G, F] holds every
        process's rows; every process calls this together) or of this process's evaluation batch (its own rows,
        whole groups; no collectives). ``rollout``: this process's rows, with the log-probs the estimator reads."""
        inputs = AdvantageInputs(rewards_per_func, self.reward_weights, num_generations, rollout, self.accelerator,
                                 over_processes)
        return self.estimator.estimate(inputs, self.args)

    @torch.no_grad()
    def build(self, rows: list[dict], prompt_ids: list[list[int]], trainer_state: Any,
              sampled: Sampled | None = None) -> Round:
        """The rollout stage for this process's ``rows`` of one round (module docstring); ``trainer_state``: what
        the reward functions get; ``sampled``: its completions sampled already (the asynchronous producer,
        trainers/sampling/async_rounds.py; a dataset's completions, distillation's off-policy rounds)."""
        args, acc = self.args, self.accelerator
        scored = self.sample_and_score(rows, prompt_ids, trainer_state, sampled=sampled)
        samples = scored.samples
        rewards_per_func = acc.gather(scored.rewards_per_func.to(acc.device)).cpu()  # [G, F], every process's rows
        n, start = len(rows), acc.process_index * len(rows)

        padded, rollout = self.padded_rollout(samples, start)  # its advantages: below
        truncated, model_tokens = padded.truncated, padded.model_tokens
        rollout = self.with_logprobs(rollout, self.needs.old_logps, self.needs.ref_logps)
        adv = self.advantages(rewards_per_func, rollout, args.num_generations)
        loss_mask, dropped_groups = loss_mask_of(model_tokens, truncated, adv.zero_std if self.needs.dynamic_sampling
                                                 else None, start, args)
        local_advantages = adv.advantages[start:start + n]  # [n]
        rollout = dataclasses.replace(rollout, loss_mask=loss_mask.to(acc.device),
                                      advantages=local_advantages.to(acc.device))
        sampler_metrics = {}
        if self.other_sampler:
            width = rollout.completion_ids.shape[1]
            sampler = None if samples.logprobs is None else padded_logprobs(samples.logprobs, width)
            rollout, sampler_metrics = self.with_sampler_logps(rollout, sampler, model_tokens.to(acc.device))
        # which rows skip_zero_gradient_rows leaves out of the backward, read once here, not per micro-batch
        if self.scorer is not None:
            rollout = rollout.with_roles(self.scorer.row_roles(rollout))

        lengths = acc.gather(model_tokens.sum(1).to(acc.device)).float().cpu()  # TRL: the model's tokens only
        all_truncated = acc.gather(truncated.float().to(acc.device)).cpu()
        names = [r.name for r in self.rewards]
        metrics = round_metrics(adv.rewards, rewards_per_func, names, adv.std_in_use, lengths, all_truncated)
        metrics.update(adv.metrics)
        if self.needs.dynamic_sampling:
            metrics["dynamic_sampling/dropped_groups"] = dropped_groups
        metrics.update(sampler_metrics)
        if scored.episode is not None:
            metrics.update(tool_metrics(acc, scored.episode.counts))
        metrics.update(logged_metric_means(acc, scored.logs))
        completions = None
        if args.log_completions:
            # asynchronous GRPO: which weights sampled each completion (TRL's trace field); a reward function's
            # own log_extra column of that name is kept instead
            version = {} if scored.version is None else {"model_version": [scored.version] * n}
            local = sample_records(scored.prompts, scored.completions, names, rewards_per_func[start:start + n],
                                   adv.rewards[start:start + n], local_advantages, {**version, **scored.logs.extra})
            completions = dist.gather_objects(acc, local)
        return Round(rollout, metrics, completions, scored.samples, scored.episode)

    def with_sampler_logps(self, rollout: Rollout, sampler: torch.Tensor | None, mask: torch.Tensor
                           ) -> tuple[Rollout, dict]:
        """A backend's own log-probs (``sampler``: [n, C], NaN where it gave none) against the trainer's own for
        the model's tokens (``mask``), computed once per round (the old log-probs when it needs them anyway): TRL's
        sampling/sampling_logp_difference/{mean,max}, about 0 when the rollout sampled from this policy; and, with
        vllm_importance_sampling_correction, the importance weights pi_old / pi_sampler the loss is multiplied by,
        with TRL's sampling/importance_sampling_ratio/{min,mean,max}. All over every process; processes without
        sampler log-probs take part in the collectives and count nothing."""
        acc = self.accelerator
        given = dist.all_reduce_sum(acc, torch.tensor([float(sampler is not None)], device=acc.device))
        if given.item() == 0:
            return rollout, {}
        current = rollout.old_logps if rollout.old_logps is not None else self.scorer.old_logprobs(rollout)
        current = current.float()
        mine = sampler is not None  # this process's rollout gave log-probs
        sampler = sampler.to(current.device) if mine else torch.full_like(current, math.nan)  # NaN: counts nothing
        total, count, peak = logprob_gap(current, sampler, mask)
        total, count = dist.all_reduce_sum(acc, torch.stack([total, count])).tolist()
        metrics = {"sampling/sampling_logp_difference/mean": total / max(count, 1.0),
                   "sampling/sampling_logp_difference/max": dist.all_reduce_max(acc, peak.reshape(1)).item()}
        weights, correction = None, self.needs.importance
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


def decode(tokenizer, rows: list[dict], completion_ids: list[list[int]]) -> tuple[list, list]:
    """(prompts, completions): completions as text, or as one assistant message for a conversational prompt."""
    texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    prompts = [row["prompt"] for row in rows]
    completions = [[{"role": "assistant", "content": t}] if is_conversational(p) else t
                   for p, t in zip(prompts, texts)]
    return prompts, completions



@dataclass(frozen=True)
class PaddedSamples:
    """A batch's samples as padded tensors, and which completions were cut and which tokens the model wrote."""

    prompt_ids: torch.Tensor  # [n, P] left-padded
    prompt_mask: torch.Tensor  # [n, P]
    completion_ids: torch.Tensor  # [n, C] right-padded
    attention: torch.Tensor  # [n, C] 1 on real completion tokens
    truncated: torch.Tensor  # [n] bool: the completion did not end
    model_tokens: torch.Tensor  # [n, C]: 1 on the tokens the model wrote (a rollout's model_mask leaves out the rest)
    groups: torch.Tensor  # [n] long: each row's distinct prompt (``prompt_groups``)
    pad_to_multiple_of: int | None

    def rollout(self, loss_mask: torch.Tensor, advantages: torch.Tensor) -> Rollout:
        return Rollout(self.prompt_ids, self.prompt_mask, self.completion_ids, self.attention, self.groups, loss_mask,
                       advantages, pad_to_multiple_of=self.pad_to_multiple_of)



def pad_samples(samples: Samples, pad_id: int, multiple: int | None, eos_ids: set[int]) -> PaddedSamples:
    """``samples`` padded (P and C multiples of ``multiple``, pad_to_multiple_of: TRL's padding; the extra columns
    are masked), with which completions were cut and which tokens the model wrote."""
    prompt_ids, prompt_mask = left_pad(samples.prompt_ids, pad_id, multiple)  # [n, P]
    completion_ids, attention = right_pad(samples.completion_ids, pad_id, multiple=multiple)  # [n, C]
    # [n]: as the backend (or the tool loop) says; else TRL's rule, a completion with an EOS anywhere ended
    finished = samples.finished or [ended(c, eos_ids, anywhere=True) for c in samples.completion_ids]
    truncated = ~torch.tensor(finished, dtype=torch.bool)
    model_tokens = attention
    if samples.model_mask is not None:
        model_tokens = right_pad(samples.model_mask, 0, width=completion_ids.shape[1])[0]
    groups = torch.tensor(prompt_groups(samples.prompt_ids), dtype=torch.long)
    return PaddedSamples(prompt_ids, prompt_mask, completion_ids, attention, truncated, model_tokens, groups,
                         multiple)


def loss_mask_of(model_tokens: torch.Tensor, truncated: torch.Tensor, zero_std: torch.Tensor | None, start: int,
                 args: Any) -> tuple[torch.Tensor, int]:
    """The tokens the loss counts ([n, C] float): the model's own, less truncated completions
    (mask_truncated_completions) and the groups ``zero_std`` marks (dynamic_sampling: [G/num_generations] over the
    round, this process's rows starting at row ``start``; None: no groups dropped, as in evaluation).
    Returns it and the number of groups dropped."""
    loss_mask = model_tokens.float()
    if args.mask_truncated_completions:
        loss_mask[truncated] = 0.0
    if zero_std is None:
        return loss_mask, 0
    group_of_row = torch.arange(start, start + len(loss_mask)) // args.num_generations
    loss_mask[zero_std[group_of_row]] = 0.0
    return loss_mask, int(zero_std.sum())


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
