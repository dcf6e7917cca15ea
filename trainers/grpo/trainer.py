"""GRPOTrainer: group-relative policy optimization with verifiable rewards (arXiv:2402.03300).

Each generation round: sample ``generation_batch_size / num_generations`` prompts (identically on every
process), repeat each ``num_generations`` times, give each process its contiguous share, generate, score,
gather the rewards of the whole round, compute group-relative advantages, and keep this process's rows as a
``Rollout``. The round then serves ``steps_per_generation`` micro-steps, ``num_iterations`` times over.
docs/grpo.md has the formulas.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import math
import os

import torch

from trainers import distributed as dist
from trainers.base import BaseTrainer
from trainers.configs import ConfigError
from trainers.data import DatasetFormatError, as_dataset, check_messages, is_conversational, render_chat
from trainers.grpo import engine
from trainers.grpo.advantages import combine_rewards, decoupled_advantages, group_advantages, nanstd
from trainers.grpo.batch import Rollout, policy_inputs, policy_rows
from trainers.grpo.config import GRPOConfig
from trainers.grpo.entropy_control import EntropyControl
from trainers.grpo.metrics import round_metrics, sample_records, write_completions
from trainers.grpo.objectives import (
    cispo_policy_loss,
    clipped_policy_loss,
    entropy_bonus,
    high_entropy_mask,
    importance_log_weights,
    k3_kl,
    off_policy_sequence_mask,
    sampler_importance_weights,
    sapo_policy_loss,
    vespo_policy_loss,
)
from trainers.grpo.rewards import (
    Reward,
    RewardLogs,
    accuracy_reward,
    call_rewards,
    check_accuracy_references,
    resolve_reward,
)
from trainers.grpo.sampling import SamplingParams, generate, left_pad, right_pad
from trainers.grpo.shared_prompt import shared_prompt_logprobs
from trainers.grpo.user_rollout import UserRollout, call_rollout_func, logprob_gap, padded_logprobs
from trainers.logs import logger
from trainers.losses import AGGREGATIONS, BatchCounts
from trainers.modeling import context_length, generation_eos_ids, load_causal_lm, token_logprobs
from trainers.samplers import group_slots
from trainers.stats import Extreme, Stats, reduce_extremes, reduce_pairs


class GRPOTrainer(BaseTrainer):
    """Trains a policy with GRPO. ``reward_funcs``: callables, built-in names ("accuracy", "format",
    "overlong"), ``module:function`` strings, or reward models (folders or instances). ``rollout_func``
    replaces the trainer's sampling (trainers/rollout_func.py). Arguments in TRL's order."""

    config_class = GRPOConfig
    # A causal LM's buffers (the rotary frequencies) are constants; broadcasting them would make every DDP forward
    # a collective, and the number of forwards per micro-batch differs between processes here (a shared prompt
    # forward, rows out of the backward). ddp_broadcast_buffers=True restores DDP's default and turns both off.
    ddp_defaults = {"broadcast_buffers": False}
    EVAL_STATE = ("eval_rows", "eval_prompt_ids")

    def __init__(self, model, reward_funcs, args: GRPOConfig | None = None, train_dataset=None, eval_dataset=None,
                 processing_class=None, reward_processing_classes=None, callbacks=None, optimizers=(None, None),
                 quantization_config=None, peft_config=None, tools=None, rollout_func=None, environment_factory=None):
        for name, value in (("tools", tools), ("environment_factory", environment_factory)):
            if value:  # TRL's tool-calling loop; a rollout_func can run one (docs/grpo.md, "Custom rollouts")
                raise ConfigError(f"GRPOTrainer({name}=...) is not supported; write a rollout_func that runs the "
                                  f"tool calls and marks their tokens with env_mask (docs/grpo.md, 'Custom rollouts').")
        if rollout_func is not None and not callable(rollout_func):
            raise ConfigError(f"rollout_func must be a function (prompts, trainer) -> dict, got "
                              f"{type(rollout_func).__name__}.")
        self.rollout_func = rollout_func
        self._reward_specs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        if not self._reward_specs:
            raise ConfigError("reward_funcs is empty; give at least one reward function.")
        self._reward_tokenizers = (list(reward_processing_classes) if isinstance(reward_processing_classes, (list, tuple))
                                   else [reward_processing_classes] * len(self._reward_specs))
        self._model_source = model
        self._rollout: Rollout | None = None
        self._rollout_round = -1
        self._round_metrics: list[dict] = []  # one per round generated since the last step_metrics()
        self._samples: list[dict] = []
        if peft_config is not None and getattr(args, "sync_ref_model", False):
            raise ConfigError("GRPOConfig: `sync_ref_model=True` does not work with a PEFT model (as in TRL): its "
                              "reference is the base model with the adapters off, not a copy to move.")
        super().__init__(model, args, train_dataset, eval_dataset, processing_class, peft_config, quantization_config,
                         callbacks, optimizers)

    # ------------------------------------------------------------------ batches and data

    def prepare_data(self, train_dataset, eval_dataset) -> None:
        args, world = self.args, self.accelerator.num_processes
        per_step = args.per_device_train_batch_size * world  # completions per micro-step, all processes
        if args.generation_batch_size is not None:
            if args.generation_batch_size % per_step:
                raise ConfigError(
                    f"generation_batch_size={args.generation_batch_size} must be a multiple of "
                    f"per_device_train_batch_size x processes = {args.per_device_train_batch_size} x {world} = {per_step}.")
            self.steps_per_generation = args.generation_batch_size // per_step
        else:
            self.steps_per_generation = args.steps_per_generation or args.gradient_accumulation_steps
        self.generation_batch_size = per_step * self.steps_per_generation
        if self.generation_batch_size % args.num_generations:
            raise ConfigError(
                f"generation_batch_size = per_device_train_batch_size x processes x steps_per_generation = "
                f"{args.per_device_train_batch_size} x {world} x {self.steps_per_generation} = "
                f"{self.generation_batch_size} completions per round is not a multiple of num_generations="
                f"{args.num_generations}; each prompt needs all its {args.num_generations} completions in one round.")
        self.prompts_per_round = self.generation_batch_size // args.num_generations
        luspo_per_token = args.loss_type == "luspo" and args.importance_sampling_level != "sequence"
        if luspo_per_token and self.accelerator.is_main_process:
            logger.warning("loss_type='luspo' is GSPO's sequence-level loss scaled by length; with "
                           "importance_sampling_level='token' it is a token sum per sequence. Set "
                           "importance_sampling_level='sequence' for the paper's setting (TRL warns the same).")
        gdpo_with_scaling = args.multi_objective_aggregation == "normalize_then_sum" and args.scale_rewards != "group"
        if gdpo_with_scaling and self.accelerator.is_main_process:
            logger.warning(f"scale_rewards={args.scale_rewards!r} is not used with multi_objective_aggregation="
                           "'normalize_then_sum', which normalizes each function per group and the sum over the batch.")
        sequence_correction = args.vllm_importance_sampling_mode.startswith("sequence")
        if args.loss_type == "vespo" and self.rollout_func is not None and args.vllm_importance_sampling_correction \
                and sequence_correction:
            raise ConfigError(f"loss_type='vespo' with a rollout_func needs vllm_importance_sampling_mode "
                              f"'token_truncate' or 'token_mask' (got {args.vllm_importance_sampling_mode!r}): VESPO "
                              f"folds per-token sampler weights into its own sequence weight, as in TRL. Or set "
                              f"vllm_importance_sampling_correction=False.")
        if args.loss_type == "vespo" and args.importance_sampling_level != "token" and self.accelerator.is_main_process:
            logger.warning("loss_type='vespo' computes its sequence-level weight itself, from token log-ratios; "
                           "importance_sampling_level is not used (TRL warns the same).")
        # Old log-probs differ from the current ones once an optimizer step falls inside a round.
        self.need_old_logps = args.num_iterations > 1 or args.gradient_accumulation_steps % self.steps_per_generation != 0

        self.rewards: list[Reward] = [resolve_reward(spec, args.max_completion_length, tok, args.chat_template_kwargs)
                                      for spec, tok in zip(self._reward_specs, self._reward_tokenizers)]
        weights = args.reward_weights or [1.0] * len(self.rewards)
        if len(weights) != len(self.rewards):
            raise ConfigError(f"reward_weights has {len(weights)} entries but reward_funcs has {len(self.rewards)}; "
                              f"give one weight per reward function.")
        self.reward_weights = torch.tensor(weights, dtype=torch.float32)

        if train_dataset is None:
            raise DatasetFormatError("GRPOTrainer needs a train_dataset with a 'prompt' column.")
        self.train_rows, self.train_prompt_ids = self._prompts(train_dataset, "train_dataset")
        if any(r.func is accuracy_reward for r in self.rewards):
            check_accuracy_references(self.train_rows, "train_dataset")
        self.eval_rows = self.eval_prompt_ids = None
        if eval_dataset is not None:
            self.tokenize_eval(eval_dataset, "eval_dataset")  # its context check waits for the model (after_load)
        self.prompt_sampler = self.batch_sampler([len(ids) for ids in self.train_prompt_ids], self.prompts_per_round,
                                                 "generation round")
        eos = {self.processing_class.eos_token_id}
        self.eos_ids = {i for i in eos if i is not None}
        self.sampling = SamplingParams(
            max_new_tokens=args.max_completion_length, temperature=args.temperature, top_p=args.top_p,
            top_k=args.top_k or 0, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
            extra=dict(args.generation_kwargs or {}))

    def _prompts(self, dataset, name: str) -> tuple[list[dict], list[list[int]]]:
        """Validate a prompt dataset and tokenize its prompts (chat template + generation prompt if conversational)."""
        dataset = as_dataset(dataset, name)
        if "prompt" not in dataset.column_names:
            raise DatasetFormatError(f"{name} has columns {dataset.column_names}; GRPO needs a 'prompt' column "
                                     f"(a string, or a list of {{'role', 'content'}} messages).")
        rows = dataset.to_list()
        tokenizer, kwargs = self.processing_class, dict(self.args.chat_template_kwargs or {})
        ids = []
        for index, row in enumerate(rows):
            prompt = row["prompt"]
            if isinstance(prompt, list):
                check_messages(prompt, f"{name} row {index}: 'prompt'")
                text = render_chat(tokenizer, prompt, add_generation_prompt=True, **kwargs)
                ids.append(tokenizer(text, add_special_tokens=False)["input_ids"])
            elif isinstance(prompt, str):
                ids.append(tokenizer(prompt)["input_ids"])
            else:
                raise DatasetFormatError(f"{name} row {index}: 'prompt' must be a string or a list of messages, "
                                         f"got {type(prompt).__name__}.")
            if not ids[-1]:
                raise DatasetFormatError(f"{name} row {index}: the prompt is empty.")
        return rows, ids

    def optimizer_steps_per_epoch(self) -> int:
        micro_steps = self.prompt_sampler.steps_per_epoch * self.steps_per_generation * self.args.num_iterations
        return max(1, math.ceil(micro_steps / self.args.gradient_accumulation_steps))

    # ------------------------------------------------------------------ models

    def after_load(self, model) -> None:
        args = self.args
        # Generation also ends on the model's own end ids (as in TRL): Qwen3's generation config adds
        # <|endoftext|> to the tokenizer's <|im_end|>, Llama 3 Instruct <|eom_id|>.
        self.eos_ids |= set(generation_eos_ids(model))
        self._check_context(model, "train_dataset", self.train_prompt_ids)  # the eval datasets: check_eval_fit
        if args.disable_dropout:
            for module in model.modules():
                if isinstance(module, torch.nn.Dropout):
                    module.p = 0.0
        self._ref_model = None
        if args.beta > 0 and not self.is_peft:  # with PEFT the reference is the base model, adapters disabled
            source = self._model_source
            self._ref_model = (load_causal_lm(source, args.model_init_kwargs, args.trust_remote_code)
                               if isinstance(source, str) else copy.deepcopy(model))

    def _check_context(self, model, name: str, prompt_ids: list[list[int]]) -> None:
        context = context_length(model)
        for index, ids in enumerate(prompt_ids if context else []):
            if len(ids) + self.args.max_completion_length > context:
                raise DatasetFormatError(
                    f"{name} row {index}: the prompt has {len(ids)} tokens; with max_completion_length="
                    f"{self.args.max_completion_length} that exceeds the model's context of {context} tokens. "
                    f"Shorten the prompt or lower max_completion_length.")

    def tokenize_eval(self, dataset, name: str) -> None:
        """Validate and tokenize ``dataset`` as the evaluation prompts (all but the model's context check)."""
        self.eval_rows, self.eval_prompt_ids = self._prompts(dataset, name)
        if any(r.func is accuracy_reward for r in self.rewards):
            check_accuracy_references(self.eval_rows, name)

    def check_eval_fit(self, model, name: str) -> None:
        self._check_context(model, name, self.eval_prompt_ids)

    def after_prepare(self) -> None:
        args = self.args
        self.entropy_control = EntropyControl(
            args.entropy_coef, args.use_adaptive_entropy, args.entropy_target, args.entropy_coef_delta,
            args.entropy_coef_min, args.entropy_coef_max) if args.entropy_coef or args.use_adaptive_entropy else None
        if self._ref_model is not None:
            self._ref_model = dist.prepare_frozen(self.accelerator, self._ref_model)
        from trainers.grpo.rewards import RewardModel

        for reward in self.rewards:
            if isinstance(reward.func, RewardModel):
                reward.func.model = dist.prepare_frozen(self.accelerator, reward.func.model)

    # ------------------------------------------------------------------ generation rounds

    def micro_batch(self, step: int, accumulation_index: int) -> dict:
        args = self.args
        micro_step = step * args.gradient_accumulation_steps + accumulation_index
        round_index, within = divmod(micro_step, self.steps_per_generation * args.num_iterations)
        if self._rollout_round != round_index:
            self._rollout = self._generate_round(round_index)
            self._rollout_round = round_index
        iteration, j = divmod(within, self.steps_per_generation)
        size = args.per_device_train_batch_size
        batch = self._rollout.micro_batch(j * size, (j + 1) * size)
        if iteration:  # a rollout trained on again (num_iterations > 1): its tokens were counted once, as in TRL
            batch["num_input_tokens"] = batch["num_padded_tokens"] = batch["num_input_tokens"] * 0
        return batch

    def step_metrics(self) -> dict:
        """The mean over the rounds generated during this step, per metric (as TRL averages what it appended);
        empty when the step trained on a round generated earlier."""
        rounds, self._round_metrics = self._round_metrics, []
        names = dict.fromkeys(name for metrics in rounds for name in metrics)
        return {name: sum(m[name] for m in rounds if name in m) / sum(name in m for m in rounds) for name in names}

    def _local_slots(self, round_index: int) -> list[int]:
        """Dataset rows of this process's completions in a round (see samplers.group_slots)."""
        return group_slots(self.prompt_sampler.batch(round_index), self.args.num_generations,
                           self.accelerator.num_processes, self.accelerator.process_index)

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams | None = None) -> list[list[int]]:
        """Completions from the policy (eval mode, no gradients). Every process must call this together."""
        acc, args = self.accelerator, self.args
        model = self.unwrapped_model
        was_training = model.training
        model.eval()
        gather = dist.zero_stage(acc) == 3 and args.ds3_gather_for_generation
        synced = dist.zero_stage(acc) == 3 and not gather
        # autocast as in the training forward (bf16 mixed precision samples from the bf16 policy it trains)
        with dist.gathered_parameters(acc, self.model, enabled=gather), acc.autocast():
            completions = generate(model, prompt_ids, params or self.sampling, self.processing_class.pad_token_id,
                                   self.eos_ids, engine=args.generation_engine, synced_gpus=synced)
        model.train(was_training)
        return completions

    def _decode(self, rows: list[dict], completion_ids: list[list[int]]) -> tuple[list, list]:
        texts = self.processing_class.batch_decode(completion_ids, skip_special_tokens=True)
        prompts = [row["prompt"] for row in rows]
        completions = [[{"role": "assistant", "content": t}] if is_conversational(p) else t
                       for p, t in zip(prompts, texts)]
        return prompts, completions

    def _score(self, rows: list[dict], prompts: list, completions: list, completion_ids: list,
               logs: RewardLogs | None = None, extra: dict | None = None) -> torch.Tensor:
        """[N, F] rewards of this process's completions (NaN where a function returned None). ``extra``: a
        rollout function's per-row fields, which replace dataset columns of the same name (as in TRL)."""
        columns = {key: [row[key] for row in rows] for key in rows[0]}
        columns.update(extra or {})
        # as in TRL, columns named like the call's own arguments are not passed on
        columns = {key: values for key, values in columns.items()
                   if key not in ("prompt", "completion", "completion_ids")}
        return call_rewards(self.rewards, prompts, completions, completion_ids, columns,
                            {"trainer_state": self.state}, logs)

    def _logged_metrics(self, logs: RewardLogs | None) -> dict:
        """(sum, count) per name of what reward functions passed to log_metric, summed over processes (every
        process takes part, whether or not it logged a name)."""
        local = {name: (sum(values), len(values)) for name, values in (logs.metrics if logs else {}).items()}
        names = sorted({name for part in dist.gather_objects(self.accelerator, [list(local)]) for name in part})
        return {name: local.get(name, (0.0, 0)) for name in names}

    def _sample(self, rows: list[dict], prompt_ids: list[list[int]]) -> UserRollout:
        """This process's completion of each row: from the rollout function when there is one (every process
        calls it; a failure on one stops all), else sampled from the policy."""
        if self.rollout_func is None:
            return UserRollout(prompt_ids, self.generate(prompt_ids), None, None, {})
        try:
            sampled, error = call_rollout_func(self.rollout_func, [row["prompt"] for row in rows], self), None
        except Exception as caught:
            sampled, error = None, caught
        dist.raise_together(self.accelerator, error)
        return sampled

    @torch.no_grad()
    def _generate_round(self, round_index: int) -> Rollout:
        args, acc = self.args, self.accelerator
        slots = self._local_slots(round_index)
        rows = [self.train_rows[i] for i in slots]
        sampled = self._sample(rows, [self.train_prompt_ids[i] for i in slots])
        completion_ids = sampled.completion_ids
        prompts, completions = self._decode(rows, completion_ids)

        logs = RewardLogs()
        try:  # user code: a failure on one process must stop all of them (see dist.raise_together)
            local_rewards, error = self._score(rows, prompts, completions, completion_ids, logs,
                                               sampled.extra), None  # [n, F]
        except Exception as caught:
            local_rewards, error = None, caught
        dist.raise_together(acc, error)
        rewards_per_func = acc.gather(local_rewards.to(acc.device)).cpu()  # [generation_batch_size, F]
        rewards = combine_rewards(rewards_per_func, self.reward_weights)  # [generation_batch_size]
        # the std the advantages are scaled by (the batch's under scale_rewards="batch" or GDPO) counts for
        # frac_reward_zero_std, as in TRL; a NaN std (a group with fewer than two scored completions) is not zero
        if args.multi_objective_aggregation == "normalize_then_sum":
            advantages, scaled, zero_std = decoupled_advantages(rewards_per_func, self.reward_weights,
                                                                args.num_generations)
            std_in_use = nanstd(scaled)
        else:
            advantages, zero_std = group_advantages(rewards, args.num_generations, args.scale_rewards)
            std_in_use = nanstd(rewards) if args.scale_rewards == "batch" else \
                nanstd(rewards.view(-1, args.num_generations), dim=1)
        n, start = len(slots), acc.process_index * len(slots)
        local_advantages = advantages[start:start + n]

        prompt_ids, prompt_mask = left_pad(sampled.prompt_ids, self.processing_class.pad_token_id)
        ids, attention = right_pad(completion_ids, self.processing_class.pad_token_id)
        # [n]; TRL's rule: a completion with an EOS anywhere ended (ours are cut at the first; a rollout's need not be)
        truncated = torch.tensor([not any(t in self.eos_ids for t in c) for c in completion_ids])
        model_tokens = attention  # [n, C]: 1 on the tokens the model produced (env_mask leaves out the rest)
        if sampled.env_mask is not None:
            model_tokens = right_pad(sampled.env_mask, 0, width=ids.shape[1])[0]
        loss_mask = model_tokens.float()
        if args.mask_truncated_completions:
            loss_mask[truncated] = 0.0
        dropped_groups = 0
        if args.dynamic_sampling:
            group_of_row = torch.arange(start, start + n) // args.num_generations
            loss_mask[zero_std[group_of_row]] = 0.0
            dropped_groups = int(zero_std.sum())
        rollout = Rollout(prompt_ids, prompt_mask, ids, attention, loss_mask, local_advantages, None, None).to(acc.device)
        old = self._batched_logps(self.model, rollout) if self.need_old_logps else None
        ref = self._reference_logps(rollout) if args.beta > 0 else None
        rollout = dataclasses.replace(rollout, old_logps=old, ref_logps=ref)
        sampler_metrics = {}
        if self.rollout_func is not None:
            sampler = None if sampled.logprobs is None else padded_logprobs(sampled.logprobs, ids.shape[1])
            rollout, sampler_metrics = self._with_sampler_logps(rollout, sampler, model_tokens.to(acc.device))

        lengths = acc.gather(model_tokens.sum(1).to(acc.device)).float().cpu()  # TRL: the model's tokens only
        all_truncated = acc.gather(truncated.float().to(acc.device)).cpu()
        names = [r.name for r in self.rewards]
        metrics = round_metrics(rewards, rewards_per_func, names, std_in_use, lengths, all_truncated)
        if args.dynamic_sampling:
            metrics["dynamic_sampling/dropped_groups"] = dropped_groups
        metrics.update(sampler_metrics)
        logged = self._logged_metrics(logs)  # what reward functions passed to log_metric, by name
        if logged:
            totals = dist.all_reduce_sum(acc, torch.tensor(list(logged.values()), device=acc.device))  # [names, 2]
            for name, (total, count) in zip(logged, totals.tolist()):
                metrics[name] = total / count
        self._round_metrics.append(metrics)
        if args.log_completions:  # as in TRL, the last round of a step is what gets logged
            local = sample_records(prompts, completions, names, rewards_per_func[start:start + n],
                                   rewards[start:start + n], local_advantages, logs.extra)
            self._samples = dist.gather_objects(acc, local)
        return rollout

    def _with_sampler_logps(self, rollout: Rollout, sampler: torch.Tensor | None, mask: torch.Tensor
                            ) -> tuple[Rollout, dict]:
        """A rollout function's log-probs (``sampler``: [n, C], NaN where it gave none) against the trainer's own
        for the model's tokens (``mask``), computed once per round (the old log-probs when it needs them anyway):
        TRL's sampling/sampling_logp_difference/{mean,max}, about 0 when the rollout sampled from this policy;
        and, with vllm_importance_sampling_correction, the importance weights pi_old / pi_sampler the loss is
        multiplied by, with TRL's sampling/importance_sampling_ratio/{min,mean,max}. All over every process;
        processes without sampler log-probs take part in the collectives and count nothing."""
        acc, args = self.accelerator, self.args
        given = dist.all_reduce_sum(acc, torch.tensor([float(sampler is not None)], device=acc.device))
        if given.item() == 0:
            return rollout, {}
        current = rollout.old_logps if rollout.old_logps is not None else self._batched_logps(self.model, rollout)
        current = current.float()
        mine = sampler is not None  # this process's rollout gave log-probs
        sampler = sampler.to(current.device) if mine else torch.full_like(current, math.nan)  # NaN: counts nothing
        total, count, peak = logprob_gap(current, sampler, mask)
        total, count = dist.all_reduce_sum(acc, torch.stack([total, count])).tolist()
        metrics = {"sampling/sampling_logp_difference/mean": total / max(count, 1.0),
                   "sampling/sampling_logp_difference/max": dist.all_reduce_max(acc, peak.reshape(1)).item()}
        weights = None
        if args.vllm_importance_sampling_correction:
            weights = sampler_importance_weights(current, sampler, mask, args.vllm_importance_sampling_mode,
                                                 args.vllm_importance_sampling_clip_min,
                                                 args.vllm_importance_sampling_clip_max)  # [n, C] or [n, 1]
            # as TRL: per token over the model's tokens, per completion over every row; rows without any
            # sampler log-prob (a process whose rollout gave none) count nothing
            counted = mask.bool() if weights.shape[1] > 1 else torch.ones_like(weights, dtype=torch.bool)
            metrics.update(self._pooled_extremes("sampling/importance_sampling_ratio",
                                                 weights[counted & ~sampler.isnan().all(1, keepdim=True)]))
        if not mine:
            return rollout, metrics
        return dataclasses.replace(rollout, sampler_logps=sampler, sampler_weights=weights), metrics

    def _pooled_extremes(self, name: str, values: torch.Tensor) -> dict:
        """{name}/min, /mean and /max of this process's ``values`` and every other's (nothing when none has any)."""
        acc = self.accelerator
        pooled = reduce_pairs(acc, {f"{name}/mean": (values.sum(), values.numel())})  # NaN when no process has any
        if math.isnan(pooled[f"{name}/mean"]):
            return {}
        nothing = values.new_tensor(math.nan)  # a process without values is left out of the min and max
        pooled.update(reduce_extremes(acc, {
            f"{name}/min": [Extreme(values.min() if values.numel() else nothing, "min")],
            f"{name}/max": [Extreme(values.max() if values.numel() else nothing, "max")]}))
        return pooled

    def _batched_logps(self, model, rollout: Rollout) -> torch.Tensor:
        """Per-token log-probs of every completion of the round, in micro-batches: [N, C]."""
        out = torch.zeros_like(rollout.loss_mask)
        size = self.args.per_device_train_batch_size
        for start in range(0, rollout.loss_mask.shape[0], size):
            batch = rollout.micro_batch(start, start + size)
            logps = self._policy_forward(model, batch)["logps"]
            out[start:start + size, : logps.shape[1]] = logps
        return out

    def _reference_logps(self, rollout: Rollout) -> torch.Tensor:
        if self._ref_model is not None:
            return self._batched_logps(self._ref_model, rollout)
        with self.unwrapped_model.disable_adapter():  # PEFT: the base model is the reference
            return self._batched_logps(self.model, rollout)

    # ------------------------------------------------------------------ loss

    @functools.cached_property
    def shares_prompt_forward(self) -> bool:
        """Whether a micro-batch's completions of one prompt share its forward (``shared_prompt_logprobs``):
        for the model families the lean engine knows, and not where a forward is collective: whether a
        micro-batch shares a prompt differs between processes. That also leaves out ZeRO-3, where a second
        forward per micro-batch would cost a second all-gather of every layer's weights (it computes correctly
        there: checked on CPU, not enabled). Under gradient checkpointing the function itself falls back where
        the checkpoints would lose the prompt's cache (reentrant ones, an older transformers)."""
        return (engine.supports(self.unwrapped_model)
                and not dist.forwards_are_collective(self.accelerator, self.model)
                and not self.router_aux_loss_coef)  # the router loss wants every token's routing in one forward

    @functools.cached_property
    def skips_zero_gradient_rows(self) -> bool:
        """skip_zero_gradient_rows where it holds: not where forwards are collective (ZeRO-3, FSDP, DDP with
        ddp_broadcast_buffers=True: the extra forward runs on some processes only), nor with an MoE router loss
        (every row's routing counts in it)."""
        return (self.args.skip_zero_gradient_rows and not dist.forwards_are_collective(self.accelerator, self.model)
                and not self.router_aux_loss_coef)

    def _training_forward(self, model, batch: dict, **options) -> dict:
        """``_policy_forward`` for the loss, with only the rows whose loss has a gradient in the backward.

        A row without loss tokens adds nothing to the loss; with beta=0 and no entropy bonus neither does a row
        with advantage 0, since every policy loss is a multiple of the advantage, nor one whose sampler weights
        (vllm_importance_sampling_*) are 0 on all its loss tokens. Such rows are forwarded
        without gradients (the logged entropy needs them; on the unwrapped model, as a forward with no backward
        needs none of DDP's bookkeeping), or, without loss tokens, not at all: their log-probs are set to the
        old ones (every ratio 1, every term finite) and their entropy to 0 (masked).
        The result covers the whole micro-batch ({"logps", "entropy"}, [B, C]), so the loss and every statistic
        are computed as without skipping."""
        if not self.skips_zero_gradient_rows:
            return self._policy_forward(model, batch, **options)
        mask = batch["loss_mask"]  # [B, C]
        silent = mask.sum(-1) == 0  # [B]: no loss tokens
        idle = silent.clone()  # [B]: rows whose loss gradient is zero
        if self.args.beta == 0 and self.entropy_control is None:
            idle |= batch["advantages"] == 0
            weights = batch["sampler_weights"]  # 0 on every loss token: masked out by the sampler correction
            if weights is not None and self.args.loss_type != "vespo":
                idle |= (weights * mask).sum(-1) == 0
        if not idle.any():
            return self._policy_forward(model, batch, **options)
        if idle.all():  # one row keeps a backward, so DDP's and DeepSpeed's gradient hooks fire on every process
            idle[0] = False
        trained, frozen = (~idle).nonzero().squeeze(1), (idle & ~silent).nonzero().squeeze(1)
        parts = [(trained, self._policy_forward(model, policy_rows(batch, trained), **options))]
        if frozen.numel():
            with torch.no_grad():
                parts.append((frozen, self._policy_forward(dist.unwrap(self.accelerator, model),
                                                           policy_rows(batch, frozen), with_entropy=True)))
        width = mask.shape[1]
        logps = batch["old_logps"] if batch["old_logps"] is not None else torch.zeros_like(mask)
        entropy = torch.zeros_like(mask)
        for rows, out in parts:  # [b, c] -> their rows of [B, C]; index_copy keeps the trained rows' gradient
            pad = (0, width - out["logps"].shape[1])
            logps = logps.index_copy(0, rows, torch.nn.functional.pad(out["logps"], pad))
            entropy = entropy.index_copy(0, rows, torch.nn.functional.pad(out["entropy"], pad))
        return {"logps": logps, "entropy": entropy}

    def _policy_forward(self, model, batch: dict, with_entropy: bool = False, with_router_loss: bool = False,
                        entropy_grad: bool = False) -> dict:
        if self.shares_prompt_forward:
            out = shared_prompt_logprobs(model, batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"],
                                         batch["completion_attention"], self.args.temperature, with_entropy,
                                         entropy_grad)
            if out is not None:  # None: no two rows of this micro-batch share a prompt
                return out
        input_ids, attention_mask, position_ids = policy_inputs(batch)
        return token_logprobs(model, input_ids, batch["completion_ids"], attention_mask, position_ids,
                              temperature=self.args.temperature, logits_to_keep=batch["completion_ids"].shape[1],
                              with_entropy=with_entropy, with_router_loss=with_router_loss, entropy_grad=entropy_grad)

    def compute_loss(self, model, batch: dict, counts: BatchCounts) -> tuple[torch.Tensor, Stats]:
        args = self.args
        bonus = self.entropy_control
        # One autocast (bf16 mixed precision) around the micro-batch's forwards (the shared prompt's two, the rows
        # without a gradient): inside it autocast casts each weight to bf16 once for all of them. Each forward's
        # own would cast anew, and backward would keep a copy per forward (+2 bytes per parameter at the peak).
        with self.accelerator.autocast():
            out = self._training_forward(model, batch, with_entropy=True,
                                         with_router_loss=bool(self.router_aux_loss_coef), entropy_grad=bonus is not None)
        logps, mask = out["logps"], batch["loss_mask"]  # [B, C]
        old = batch["old_logps"] if batch["old_logps"] is not None else logps.detach()
        log_weights = importance_log_weights(logps, old, mask, args.importance_sampling_level)
        advantages = batch["advantages"]  # [B]
        low = high = cispo_clipped = phi = None  # clip masks, [B, T or 1]; VESPO's weight, [B, 1]
        if args.loss_type == "cispo":
            per_token, cispo_clipped = cispo_policy_loss(logps, log_weights, advantages, args.clip_high)
        elif args.loss_type == "vespo":
            per_token, phi = vespo_policy_loss(logps, logps - old, advantages, mask, args.vespo_k_pos,
                                               args.vespo_lambda_pos, args.vespo_k_neg, args.vespo_lambda_neg,
                                               batch["sampler_weights"])
        elif args.loss_type == "sapo":
            per_token = sapo_policy_loss(log_weights, advantages, args.sapo_temperature_pos, args.sapo_temperature_neg)
        else:
            per_token, low, high = clipped_policy_loss(log_weights, advantages, args.epsilon, args.clip_high, args.delta)
        if args.off_policy_mask_threshold is not None:  # [B, 1]: whole completions
            # as TRL, measured from the sampler's log-probs when a rollout function gave them (both sources of
            # off-policyness: optimizer steps and the sampler's own numerics)
            behaviour = batch["sampler_logps"] if batch["sampler_logps"] is not None else old
            threshold = args.off_policy_mask_threshold
            per_token = per_token * off_policy_sequence_mask(logps, behaviour, advantages, mask, threshold)
        kept = mask  # [B, T]: the tokens the policy loss (and an entropy bonus) acts on
        if args.top_entropy_quantile < 1.0:  # the high-entropy tokens only
            threshold = self._entropy_threshold(out["entropy"], mask)
            kept = mask * high_entropy_mask(out["entropy"], mask, threshold)
            per_token = per_token * kept
        if batch["sampler_weights"] is not None and args.loss_type != "vespo":  # VESPO folds them into its weight
            per_token = per_token * batch["sampler_weights"]  # [B, T] or [B, 1]: pi_old / pi_sampler
        stats: Stats = {"entropy": ((out["entropy"] * mask).sum(), mask.sum())}
        if args.beta > 0:
            kl = k3_kl(logps, batch["ref_logps"])
            if args.use_bias_correction_kl:
                # importance-weighted, so it estimates KL(pi || ref) under the current policy (TRL's default); the
                # ratio is differentiable, so the gradient changes even where its value is 1
                kl = kl * torch.exp(log_weights)
            per_token = per_token + args.beta * kl
            stats["kl"] = ((kl.detach() * mask).sum(), mask.sum())
        loss = self.add_router_loss(AGGREGATIONS[args.loss_type](per_token, mask, counts), out, counts, stats)
        if bonus is not None:  # TRL's entropy regularization
            stats["policy_loss"] = (loss.detach(), 1.0 / counts.micro_batches)  # summed over the step, as "loss"
            loss = loss - bonus.applied * entropy_bonus(out["entropy"], kept, counts)
            # the step's entropy over those tokens, for the adaptive coefficient (_optimizer_step pops it)
            stats["_bonus_entropy"] = ((out["entropy"].detach() * kept).sum(), kept.sum())
        # the share of clipped tokens; at importance_sampling_level="sequence", of clipped completions (as TRL)
        per_completion = args.importance_sampling_level == "sequence"  # clip masks: [B, 1]; else [B, T]
        weight = torch.ones((mask.shape[0], 1), dtype=mask.dtype, device=mask.device) if per_completion else mask
        if low is not None:
            low_clipped, high_clipped = (low.float() * weight).sum(), (high.float() * weight).sum()
            counted = weight.sum()
            stats["clip_ratio/low_mean"] = (low_clipped, counted)
            stats["clip_ratio/high_mean"] = (high_clipped, counted)
            stats["clip_ratio/region_mean"] = (low_clipped + high_clipped, counted)
            # TRL's: this micro-batch's ratio, its min (low) or max (high) over processes
            stats["clip_ratio/low_min"] = Extreme(low_clipped / counted, "min")
            stats["clip_ratio/high_max"] = Extreme(high_clipped / counted, "max")
        if cispo_clipped is not None:  # TRL's name; SAPO has no clip to count
            stats["cispo_clip_ratio"] = ((cispo_clipped.float() * weight).sum(), weight.sum())
        if phi is not None:  # TRL's name: the mean weight over every completion row
            stats["vespo/phi_seq_mean"] = (phi.sum(), phi.shape[0])
        return loss, stats

    def _optimizer_step(self, batches: list[dict], stop_requested: bool = False) -> dict:
        """The base step; then the entropy bonus's coefficient adapted to the step's entropy (and logged), and
        with sync_ref_model, every ref_model_sync_steps steps, the reference moved toward the policy (TRL's
        SyncRefModelCallback), so later rounds' KL is to the moved reference."""
        metrics = super()._optimizer_step(batches, stop_requested)
        if self.entropy_control is not None:
            self.entropy_control.update(metrics.pop("_bonus_entropy"))
            metrics["entropy_coef"] = self.entropy_control.coef
        args = self.args
        if args.sync_ref_model and (self.state.global_step + 1) % args.ref_model_sync_steps == 0:  # the step just done
            dist.mix_parameters(self.accelerator, self.unwrapped_model, self._ref_model, args.ref_model_mixup_alpha)
        return metrics

    def _entropy_threshold(self, entropy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The (1 - top_entropy_quantile) quantile of the entropy of every process's loss tokens in this
        micro-batch (inf when there are none: nothing is kept), as TRL computes it."""
        values = dist.gather_varlen(self.accelerator, entropy.detach()[mask.bool()].float())
        if values.numel() == 0:
            return torch.tensor(float("inf"), device=entropy.device)
        return torch.quantile(values, 1.0 - self.args.top_entropy_quantile)

    # ------------------------------------------------------------------ evaluation and logging

    def eval_rows_per_batch(self) -> int:
        """Prompts per evaluation batch: per_device_eval_batch_size counts completions."""
        per_prompt = self.args.num_generations_eval or self.args.num_generations
        return max(1, self.args.per_device_eval_batch_size // per_prompt)

    def evaluation_stats(self) -> Stats:
        """Mean reward (and each function's) of num_generations_eval (default num_generations) sampled
        completions per eval prompt."""
        acc, args = self.accelerator, self.args
        n, world = len(self.eval_rows), acc.num_processes
        mine = [i for i in range(acc.process_index, n, world)]
        per_process = -(-n // world)
        device = acc.device
        sums = torch.zeros(len(self.rewards) + 1, device=device)
        counts = torch.zeros(len(self.rewards) + 1, device=device)
        per_prompt = args.num_generations_eval or args.num_generations
        size = self.eval_rows_per_batch()
        logged = RewardLogs()  # log_metric calls of every chunk
        for start in range(0, per_process, size):
            chunk = mine[start:start + size]
            indices = [i for i in (chunk or [0]) for _ in range(per_prompt)]
            rows = [self.eval_rows[i] for i in indices]
            sampled = self._sample(rows, [self.eval_prompt_ids[i] for i in indices])
            completion_ids = sampled.completion_ids
            per_func, error, logs = None, None, RewardLogs()
            if chunk:  # a process without rows left only kept the others company in the collectives
                try:
                    per_func = self._score(rows, *self._decode(rows, completion_ids), completion_ids, logs,
                                           sampled.extra).to(device)
                except Exception as caught:
                    error = caught
            for name, values in logs.metrics.items():
                logged.metrics[name].extend(values)
            dist.raise_together(acc, error)
            self.callback_handler.fire("prediction_step")
            if per_func is None:
                continue
            total = combine_rewards(per_func, self.reward_weights.to(device))
            values = torch.cat([total.unsqueeze(1), per_func], dim=1)  # [n, F + 1]
            sums += torch.nan_to_num(values).sum(0)
            counts += (~torch.isnan(values)).sum(0)
        names = ["reward"] + [f"rewards/{r.name}/mean" for r in self.rewards]
        pooled: dict = {}  # functions of one name pool their values
        for i, name in enumerate(names):
            total, count = pooled.get(name, (0.0, 0))
            pooled[name] = (total + sums[i], count + counts[i])
        for name, (total, count) in self._logged_metrics(logged).items():  # summed over processes by the caller
            pooled[name] = (torch.tensor(total, device=device), torch.tensor(float(count), device=device))
        return pooled

    def on_log(self, record: dict) -> None:
        if self.args.log_completions and self._samples and self.accelerator.is_main_process:
            write_completions(self.args.output_dir, record["step"], self._samples, self.args.num_completions_to_print)
            self._samples = []

    # ------------------------------------------------------------------ resume

    def save_extra_state(self, folder: str) -> None:
        if self.args.sync_ref_model:  # the moved reference is not the model it was loaded from: keep it
            reference = dist.unwrap(self.accelerator, self._ref_model)
            with dist.gathered_parameters(self.accelerator, reference):
                if self.accelerator.is_main_process:
                    torch.save({k: v.detach().cpu() for k, v in reference.state_dict().items()},
                               os.path.join(folder, "reference.pt"))
        if self.entropy_control is not None:  # the adaptive coefficient and the entropy it last saw
            with open(os.path.join(folder, f"entropy-{self.accelerator.process_index}.json"), "w") as f:
                json.dump(dataclasses.asdict(self.entropy_control), f)
        if self._rollout is not None:
            torch.save({"round": self._rollout_round, "rollout": self._rollout.to("cpu").__dict__},
                       os.path.join(folder, f"rollout-{self.accelerator.process_index}.pt"))

    def load_extra_state(self, folder: str) -> None:
        if self.args.sync_ref_model and os.path.exists(os.path.join(folder, "reference.pt")):
            state = torch.load(os.path.join(folder, "reference.pt"), weights_only=True)
            dist.load_full_state_dict(self.accelerator, self._ref_model, state)
        entropy_path = os.path.join(folder, f"entropy-{self.accelerator.process_index}.json")
        if self.entropy_control is not None and os.path.exists(entropy_path):
            with open(entropy_path) as f:
                saved = json.load(f)
            self.entropy_control.coef, self.entropy_control.last_entropy = saved["coef"], saved["last_entropy"]
        path = os.path.join(folder, f"rollout-{self.accelerator.process_index}.pt")
        if os.path.exists(path):
            saved = torch.load(path, weights_only=True)
            self._rollout = Rollout(**saved["rollout"]).to(self.accelerator.device)
            self._rollout_round = saved["round"]
