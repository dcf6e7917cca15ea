"""GRPOTrainer: group-relative policy optimization with verifiable rewards (arXiv:2402.03300).

One optimizer step, as the base loop runs it (trainers/base.py):

1. ``prepare_step``: the rollout stage builds each generation round the step trains on that is not built yet
   (trainers/grpo/rollout.py): ``generation_batch_size / num_generations`` prompts (identically on every
   process), each repeated ``num_generations`` times, this process's contiguous share sampled, scored, its
   advantages computed from every process's rewards, kept as a typed ``Rollout`` (trainers/grpo/batch.py).
2. ``micro_batch``: a slice of the round (a ``MicroBatch``). A round serves ``steps_per_generation`` micro-steps,
   ``num_iterations`` times over.
3. ``compute_loss``: the policy's log-probs (``policy_logprobs``), the objective of ``loss_type``
   (``OBJECTIVES``, trainers/grpo/objectives.py), its masks, the KL term, averaged as ``AGGREGATIONS`` says.
4. ``after_optimizer_step``: the round metrics, the adaptive entropy coefficient, the reference model's sync.

docs/grpo.md has the formulas; docs/design.md walks the step with file names.
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
from trainers import health
from trainers.base import BaseTrainer
from trainers.configs import ConfigError
from trainers.data import PromptRow, tokenize_prompt_rows, tokenize_prompts
from trainers.errors import DatasetFormatError, VLLMServerError
from trainers.generation import engine
from trainers.grpo import evaluation, rollout
from trainers.grpo import health as grpo_health
from trainers.grpo.batch import MicroBatch, Rollout
from trainers.grpo.config import GRPOConfig
from trainers.grpo.entropy_control import EntropyControl
from trainers.grpo.metrics import policy_loss_stats, write_completions
from trainers.grpo.objectives import (
    OBJECTIVES,
    PolicyInputs,
    entropy_bonus,
    high_entropy_mask,
    importance_log_weights,
    k3_kl,
    off_policy_sequence_mask,
)
from trainers.grpo.rewards import Reward, RewardModel, accuracy_reward, check_accuracy_references, resolve_reward
from trainers.generation.sampling import GenerationContext, PolicySampler, Sampler, SamplingParams
from trainers.grpo.shared_prompt import shared_prompt_logprobs
from trainers.grpo.tool_loop import EMPTY_PROMPT, ToolLoop
from trainers.grpo.user_rollout import RolloutFuncSampler
from trainers.grpo.vllm_generation import VLLMGeneration, VLLMSampler, vllm_missing
from trainers.logs import logger
from trainers.losses import AGGREGATIONS, BatchCounts
from trainers.modeling import (
    cast_lm_head_to_fp32,
    context_length,
    generation_eos_ids,
    load_causal_lm,
    prompt_learning_config,
    token_logprobs,
)
from trainers.samplers import group_slots
from trainers.stats import Stats
from trainers.streaming import (
    IndexedBatches,
    PerThread,
    is_stream,
    load_data_position,
    note_map_style_workers,
    refuse_dispatch_batches,
    save_data_position,
    stream_batches,
)

# TRL's GRPOTrainer copies these GRPOConfig fields onto itself and user code reads them there (trainer.temperature,
# trainer.beta). Here each reads the config, the one place they are kept. They are read-only: set after
# construction, one would not reach the sampler or the loss, which were set up from the config.
TRL_CONFIG_ATTRIBUTES = (
    "beta", "importance_sampling_level", "log_completions", "log_multimodal", "log_unique_prompts", "loss_type",
    "mask_truncated_completions", "max_completion_length", "min_p", "multi_objective_aggregation",
    "num_completions_to_print", "num_generations", "num_iterations", "off_policy_mask_threshold",
    "pad_to_multiple_of", "repetition_penalty", "scale_rewards", "shuffle_dataset", "temperature",
    "top_entropy_quantile", "top_k", "top_p", "use_adaptive_entropy", "use_transformers_continuous_batching",
    "use_vllm", "vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
    "vllm_importance_sampling_clip_max", "vllm_importance_sampling_clip_min",
)


def _config_attribute(name: str) -> property:
    def read(self):
        return getattr(self.args, name)

    def refuse(self, value):
        raise AttributeError(f"GRPOTrainer.{name} reads args.{name}, which the trainer was set up with; set "
                             f"GRPOConfig({name}=...) before building the trainer.")

    return property(read, refuse, doc=f"``args.{name}``, as TRL's trainer attribute of that name.")


class _Placeholder(list):
    """train_dataset=None with an environment_factory: prepare_data makes a round's worth of empty prompts."""


class GRPOTrainer(BaseTrainer):
    """Trains a policy with GRPO. ``reward_funcs``: callables, built-in names ("accuracy", "format",
    "overlong"), ``module:function`` strings, or reward models (folders, Hub ids or instances). ``rollout_func``
    replaces the trainer's sampling (trainers/grpo/user_rollout.py). Arguments in TRL's order."""

    config_class = GRPOConfig
    _tag_names = ("trainers", "grpo")  # the model card tags added to the model (TRL: ["trl", "grpo"])
    HEALTH_RULES = grpo_health.RULES + health.RULES  # reward variance, entropy, truncation, length, KL; non-finite
    # A causal LM's buffers (the rotary frequencies) are constants; broadcasting them would make every DDP forward
    # a collective, and the number of forwards per micro-batch differs between processes here (a shared prompt
    # forward, rows out of the backward). ddp_broadcast_buffers=True restores DDP's default and turns both off.
    ddp_defaults = {"broadcast_buffers": False}
    EVAL_STATE = ("eval_rows", "eval_prompt_ids", "eval_given")

    def __init__(self, model, reward_funcs=None, args: GRPOConfig | None = None, train_dataset=None, eval_dataset=None,
                 processing_class=None, reward_processing_classes=None, callbacks=None, optimizers=(None, None),
                 quantization_config=None, peft_config=None, tools=None, rollout_func=None, environment_factory=None):
        if rollout_func is not None and not callable(rollout_func):
            raise ConfigError(f"rollout_func must be a function (prompts, trainer) -> dict, got "
                              f"{type(rollout_func).__name__}.")
        if rollout_func is not None and (tools or environment_factory):
            raise ConfigError("GRPOTrainer: a rollout_func runs its own episodes; pass tools/environment_factory "
                              "(the trainer's tool loop) or a rollout_func, not both.")
        # TRL's tool calling: built with the tokenizer (prepare_data); trainers/grpo/tool_loop.py
        if tools is not None and not isinstance(tools, (list, tuple)):
            raise ConfigError(f"tools must be a list of functions, got {type(tools).__name__}.")
        self._tools, self._environment_factory = list(tools or []), environment_factory
        self.tool_loop: ToolLoop | None = None
        if train_dataset is None and environment_factory:  # the environment owns the data (TRL's rule)
            train_dataset = self._placeholder_rows(environment_factory, args)
        self.rollout_func = rollout_func
        self.sampler: Sampler | None = None  # chosen once the policy is prepared (after_prepare)
        self.policy_sampler: PolicySampler | None = None  # the policy itself (trainer.generate: a rollout_func's)
        self.vllm_generation: VLLMGeneration | None = None  # TRL's trainer.vllm_generation, with use_vllm
        self._reward_specs = (list(reward_funcs) if isinstance(reward_funcs, (list, tuple))
                              else [] if reward_funcs is None else [reward_funcs])
        if not self._reward_specs and not environment_factory:  # an environment may own the reward (get_reward)
            raise ConfigError("No reward source provided: reward_funcs is empty; give at least one reward function.")
        # one entry per reward function (a tokenizer for a reward model, None for a function); as in TRL, one
        # tokenizer given alone is a list of one, for a single reward function
        if reward_processing_classes is None:
            self._reward_tokenizers = [None] * len(self._reward_specs)
        elif isinstance(reward_processing_classes, (list, tuple)):
            self._reward_tokenizers = list(reward_processing_classes)
        else:
            self._reward_tokenizers = [reward_processing_classes]
        if len(self._reward_tokenizers) != len(self._reward_specs):
            raise ConfigError(f"The number of reward processing classes ({len(self._reward_tokenizers)}) must match "
                              f"the number of reward functions ({len(self._reward_specs)}): give one per reward "
                              f"function, None for a function.")
        self._model_source = model
        self._rounds: dict[int, Rollout] = {}  # the rounds the current step trains on, by round index
        self._round_metrics: list[dict] = []  # one per round built since the last optimizer step
        self._samples: list[dict] = []  # log_completions: the last round's records, until they are logged
        if peft_config is not None and getattr(args, "sync_ref_model", False):
            raise ConfigError("GRPOConfig: `sync_ref_model=True` does not work with a PEFT model (as in TRL): its "
                              "reference is the base model with the adapters off, not a copy to move.")
        super().__init__(model, args, train_dataset, eval_dataset, processing_class, peft_config, quantization_config,
                         callbacks, optimizers)

    # ------------------------------------------------------------------ data and rounds

    def prepare_data(self, train_dataset, eval_dataset) -> None:
        args, world = self.args, self.accelerator.num_processes
        per_device = self.per_process_train_batch_size  # per_device_train_batch_size, split with split_batches
        per_step = per_device * world  # completions per micro-step, all processes
        if args.generation_batch_size is not None:
            if args.generation_batch_size % per_step:
                raise ConfigError(
                    f"generation_batch_size={args.generation_batch_size} must be a multiple of "
                    f"per_device_train_batch_size x processes = {per_device} x {world} = {per_step}.")
            self.steps_per_generation = args.generation_batch_size // per_step
        else:
            self.steps_per_generation = args.steps_per_generation or args.gradient_accumulation_steps
        self.generation_batch_size = per_step * self.steps_per_generation
        if self.generation_batch_size % args.num_generations:
            raise ConfigError(
                f"generation_batch_size = per_device_train_batch_size x processes x steps_per_generation = "
                f"{per_device} x {world} x {self.steps_per_generation} = "
                f"{self.generation_batch_size} completions per round is not a multiple of num_generations="
                f"{args.num_generations}; each prompt needs all its {args.num_generations} completions in one round.")
        self.prompts_per_round = self.generation_batch_size // args.num_generations
        self._check_loss_options()
        # colocate runs vLLM in this process; a server needs only its own environment to have it
        if args.use_vllm and args.vllm_mode == "colocate" and (missing := vllm_missing()):  # before the model loads
            raise ConfigError(f"GRPOConfig: `use_vllm=True` with vllm_mode='colocate' needs vLLM here: {missing}. "
                              f"Install it (on CPU: `bash scripts/setup.sh vllm`; docs/grpo.md, "
                              f"'Generation with vLLM'), use vllm_mode='server' with a server in its own "
                              f"environment, or leave use_vllm False.")
        # Old log-probs differ from the current ones once an optimizer step falls inside a round.
        self.need_old_logps = args.num_iterations > 1 or args.gradient_accumulation_steps % self.steps_per_generation != 0

        self.rewards: list[Reward] = [resolve_reward(spec, args.max_completion_length, tok, args.chat_template_kwargs,
                                                     args.model_init_kwargs, args.trust_remote_code)
                                      for spec, tok in zip(self._reward_specs, self._reward_tokenizers)]
        weights = args.reward_weights or [1.0] * len(self.rewards)
        if len(weights) != len(self.rewards):
            raise ConfigError(f"reward_weights has {len(weights)} entries but reward_funcs has {len(self.rewards)}; "
                              f"give one weight per reward function.")
        if self._tools or self._environment_factory:
            self.tool_loop = ToolLoop(self._tools, self._environment_factory, args, self.processing_class,
                                      len(self.rewards))
            # an environment's get_reward is one more reward function, weight 1, named after its class (as TRL)
            self.rewards += [Reward(name, func) for name, func in self.tool_loop.reward_functions]
            weights = list(weights) + [1.0] * len(self.tool_loop.reward_functions)
        self.reward_weights = torch.tensor(weights, dtype=torch.float32)

        if isinstance(train_dataset, _Placeholder):  # a round's worth of empty prompts, cycled (TRL's)
            train_dataset = [{"prompt": list(EMPTY_PROMPT)} for _ in range(self.prompts_per_round)]
        self._given_train_dataset = train_dataset  # trainer.train_dataset: as given, as TRL keeps it
        evals = eval_dataset.values() if isinstance(eval_dataset, dict) else [eval_dataset]
        if is_stream(train_dataset) or any(is_stream(data) for data in evals):
            refuse_dispatch_batches(args)
        if is_stream(train_dataset) and args.dataloader_num_workers:
            # TRL's rule: a stream is read by one worker, whose order keeps each prompt's group together
            if self.accelerator.is_main_process:
                logger.warning(f"Iterable datasets require `dataloader_num_workers=0` to preserve prompt grouping; "
                               f"overriding the provided value ({args.dataloader_num_workers}).")
            args.dataloader_num_workers = 0
        if is_stream(train_dataset):  # read in order during training, a chunk of prompts tokenized at a time
            self.train_rows = self.train_prompt_ids = self.prompt_sampler = None
            # a copy of the tokenizer for each worker thread (dataloader_num_workers): one thread at a time may use
            # a fast tokenizer
            self._tokenizers = PerThread(self.processing_class)
            self.prompt_batches = stream_batches(self, train_dataset, self._prompt_chunk, self.prompts_per_round)
        else:
            self.train_rows, self.train_prompt_ids = self._prompts(train_dataset, "train_dataset")
            self.prompt_sampler = self.batch_sampler([len(ids) for ids in self.train_prompt_ids],
                                                     self.prompts_per_round, "generation round")
            self.prompt_batches = IndexedBatches(
                [PromptRow(row, ids) for row, ids in zip(self.train_rows, self.train_prompt_ids)], self.prompt_sampler)
            note_map_style_workers(self)
        self.eval_rows = self.eval_prompt_ids = self.eval_given = None
        if eval_dataset is not None:
            self.tokenize_eval(eval_dataset, "eval_dataset")  # its context check waits for the model (after_load)
        self.eos_ids = {i for i in {self.processing_class.eos_token_id} if i is not None}
        self.sampling = SamplingParams(
            max_new_tokens=args.max_completion_length, temperature=args.temperature, top_p=args.top_p,
            top_k=args.top_k or 0, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
            extra=dict(args.generation_kwargs or {}))

    def _check_loss_options(self) -> None:
        """The loss options that need the trainer to be checked (a rollout function) or are warned about, as TRL."""
        args, main = self.args, self.accelerator.is_main_process
        if args.loss_type == "luspo" and args.importance_sampling_level != "sequence" and main:
            logger.warning("loss_type='luspo' is GSPO's sequence-level loss scaled by length; with "
                           "importance_sampling_level='token' it is a token sum per sequence. Set "
                           "importance_sampling_level='sequence' for the paper's setting (TRL warns the same).")
        if args.importance_sampling_level == "sequence" and args.loss_type in ("bnpo", "dr_grpo", "dapo", "cispo") \
                and main:  # TRL's warning, in its words
            logger.warning(f"When using `importance_sampling_level='sequence'`, the `'{args.loss_type}'` loss sums "
                           "per-token contributions, which effectively weights each sequence by its completion length "
                           "instead of optimizing the per-sequence objective. To reproduce the GSPO paper's setup, set "
                           "`loss_type='grpo'`.")
        if args.multi_objective_aggregation == "normalize_then_sum" and args.scale_rewards != "group" and main:
            logger.warning(f"scale_rewards={args.scale_rewards!r} is not used with multi_objective_aggregation="
                           "'normalize_then_sum', which normalizes each function per group and the sum over the batch.")
        if args.loss_type == "vespo" and (self.rollout_func is not None or args.use_vllm) \
                and args.vllm_importance_sampling_correction and args.vllm_importance_sampling_mode.startswith("sequence"):
            sampler = "a rollout_func" if self.rollout_func is not None else "use_vllm"
            raise ConfigError(f"loss_type='vespo' with {sampler} needs vllm_importance_sampling_mode "
                              f"'token_truncate' or 'token_mask' (got {args.vllm_importance_sampling_mode!r}): VESPO "
                              f"folds per-token sampler weights into its own sequence weight, as in TRL. Or set "
                              f"vllm_importance_sampling_correction=False.")
        if args.loss_type == "vespo" and args.importance_sampling_level != "token" and main:
            logger.warning("loss_type='vespo' computes its sequence-level weight itself, from token log-ratios; "
                           "importance_sampling_level is not used (TRL warns the same).")

    @staticmethod
    def _placeholder_rows(environment_factory, args) -> _Placeholder:
        """No train_dataset with an environment_factory: the environment owns the data, reset() gives each prompt
        (TRL's rule, TRL's errors)."""
        if isinstance(environment_factory, dict):
            raise ConfigError("A dict environment_factory (several environments) needs a train_dataset with an "
                              "'environment' column to route each row to its environment. Give a dataset, or a "
                              "single environment factory.")
        if args is None or args.max_steps <= 0:
            raise ConfigError("Training without a train_dataset (the environment owns the data and returns the "
                              "prompt from reset()) needs max_steps > 0 to set the run's length: "
                              "GRPOConfig(max_steps=...).")
        return _Placeholder()

    def _prompt_kwargs(self) -> dict | None:
        """chat_template_kwargs for tokenizing the dataset's prompts: with tools, every tool's schema (the prompts'
        lengths then bound what a round renders; the round renders each prompt with its own tools)."""
        if self.tool_loop is None:
            return self.args.chat_template_kwargs
        schemas = {s["function"]["name"]: s for group in self.tool_loop.schemas.values() for s in group}
        return {**(self.args.chat_template_kwargs or {}), "tools": list(schemas.values()) or None}

    def _prompts(self, dataset, name: str) -> tuple[list[dict], list[list[int]]]:
        rows, ids = tokenize_prompts(dataset, name, self.processing_class, self._prompt_kwargs())
        if any(r.func is accuracy_reward for r in self.rewards):
            check_accuracy_references(rows, name)
        if self.tool_loop is not None:
            self.tool_loop.check_rows(rows, name)
        return rows, ids

    def _prompt_chunk(self, raw: list[dict], first: int) -> list[PromptRow]:
        """A chunk of a streamed train_dataset (its raw rows ``first``, ``first + 1``, ...) as prompts, checked as
        ``_prompts`` checks a dataset; it may run in a worker thread, with that thread's copy of the tokenizer."""
        ids = tokenize_prompt_rows(raw, "train_dataset", self._tokenizers.get(), self._prompt_kwargs(), first)
        if any(r.func is accuracy_reward for r in self.rewards):
            check_accuracy_references(raw, f"train_dataset (the chunk from row {first})")
        if self.tool_loop is not None:
            self.tool_loop.check_rows(raw, "train_dataset", first)
        return [PromptRow(row, row_ids) for row, row_ids in zip(raw, ids)]

    @property
    def train_dataset(self):
        """The training data as given (TRL's GRPOTrainer keeps it so: prompts are tokenized when rounds are built)."""
        return self._given_train_dataset

    @property
    def eval_dataset(self):
        """The evaluation data as given; a dict for named eval datasets (as TRL keeps it)."""
        if self.eval_sets:
            return {name: eval_set["eval_given"] for name, eval_set in self.eval_sets.items()}
        return self.eval_given

    def optimizer_steps_per_epoch(self) -> int:
        if self.prompt_sampler is None:  # a stream's length is unknown: as transformers, one "epoch" is max_steps
            return self.args.max_steps
        micro_steps = self.prompt_sampler.steps_per_epoch * self.steps_per_generation * self.args.num_iterations
        return max(1, math.ceil(micro_steps / self.args.gradient_accumulation_steps))

    def _place(self, step: int, accumulation_index: int) -> tuple[int, int, int]:
        """Where micro-batch ``accumulation_index`` of optimizer step ``step`` comes from: (round, iteration over
        the round, slice of the round)."""
        micro_step = step * self.args.gradient_accumulation_steps + accumulation_index
        round_index, within = divmod(micro_step, self.steps_per_generation * self.args.num_iterations)
        iteration, part = divmod(within, self.steps_per_generation)
        return round_index, iteration, part

    def prepare_step(self, step: int) -> None:
        """The rollout stage: build, in order, the generation rounds optimizer step ``step`` trains on that are
        not built yet (a round may serve several steps); drop the rounds it no longer needs."""
        needed = list(dict.fromkeys(self._place(step, a)[0] for a in range(self.args.gradient_accumulation_steps)))
        self._rounds = {index: self._rounds[index] for index in needed if index in self._rounds}
        position, built = self.prompt_batches.state(), []  # a stream's position before this step's rounds
        try:
            for index in needed:
                if index not in self._rounds:
                    self._rounds[index] = self.build_round(index)
                    built.append(index)
        except VLLMServerError:
            # the run stops with a checkpoint of the step before (train()): its data position must not count
            # this step's prompts as read, or the resumed run would skip them (a stream is read in order)
            self._rounds = {index: rollout for index, rollout in self._rounds.items() if index not in built}
            self.prompt_batches.restore(position)
            raise

    def build_round(self, round_index: int) -> Rollout:
        """Generation round ``round_index`` on this process (trainers/grpo/rollout.py); its metrics and
        completions wait for the step's log."""
        prompts = self.prompt_batches.batch(round_index)  # the round's prompts, the same on every process
        slots = group_slots(list(range(len(prompts))), self.args.num_generations, self.accelerator.num_processes,
                            self.accelerator.process_index)
        built = rollout.build_round(self, [prompts[i].row for i in slots], [prompts[i].ids for i in slots])
        self._round_metrics.append(built.metrics)
        if built.completions is not None:  # as in TRL, the last round of a step is what gets logged
            self._samples = built.completions
        return built.rollout

    def micro_batch(self, step: int, accumulation_index: int) -> MicroBatch:
        round_index, iteration, part = self._place(step, accumulation_index)
        if round_index not in self._rounds:
            raise RuntimeError(f"round {round_index} is not built: call prepare_step({step}) before micro_batch.")
        size = self.per_process_train_batch_size
        # a round trained on again (num_iterations > 1): its tokens were counted once, as in TRL
        return self._rounds[round_index].micro_batch(part * size, (part + 1) * size, count_tokens=iteration == 0)

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams | None = None) -> list[list[int]]:
        """Completions from the policy (eval mode, no gradients), for a rollout function. Every process must call
        this together."""
        return self.policy_sampler.generate(prompt_ids, params or self.sampling)

    # ------------------------------------------------------------------ TRL's public attributes

    @property
    def reward_funcs(self) -> list:
        """TRL's ``trainer.reward_funcs``: the reward functions in order, a reward model as the model itself
        (an ``AutoModelForSequenceClassification``, prepared for the accelerator once training is set up)."""
        return [r.func.model if isinstance(r.func, RewardModel) else r.func for r in self.rewards]

    @property
    def reward_processing_classes(self) -> list:
        """TRL's: one entry per reward function, the tokenizer of a reward model (given, or its own) and what was
        given (None by default) for a function."""
        return [r.func.tokenizer if isinstance(r.func, RewardModel) else given
                for r, given in zip(self.rewards, self._reward_tokenizers)]

    @property
    def reward_func_names(self) -> list[str]:
        """TRL's: the names the reward metrics are logged under (``rewards/<name>/mean``)."""
        return [r.name for r in self.rewards]

    @property
    def num_generations_eval(self) -> int:
        return self.args.num_generations_eval or self.args.num_generations

    @property
    def chat_template_kwargs(self) -> dict:
        return self.args.chat_template_kwargs or {}

    @property
    def epsilon_low(self) -> float:
        return self.args.epsilon

    @property
    def epsilon_high(self) -> float:
        return self.args.epsilon if self.args.epsilon_high is None else self.args.epsilon_high

    @property
    def entropy_coef(self) -> float:
        """The entropy bonus's coefficient now: with use_adaptive_entropy it moves every step, as TRL's does."""
        control = getattr(self, "entropy_control", None)  # set once training is set up (after_prepare)
        return control.coef if control is not None else self.args.entropy_coef

    @property
    def eos_token_ids(self) -> list[int]:
        """The ids that end a completion: the tokenizer's EOS first, then the model's own end ids (as TRL)."""
        first = self.processing_class.eos_token_id
        return ([first] if first is not None else []) + sorted(self.eos_ids - {first})

    # ------------------------------------------------------------------ models

    def after_load(self, model) -> None:
        args = self.args
        prompt_learning = prompt_learning_config(model)
        if prompt_learning is not None:
            # generation (the lean engine, the shared prompt cache), left-padded prompts' position ids and the
            # reference (adapters off) all assume the model's inputs are the tokens themselves
            raise ConfigError(
                f"GRPOTrainer: a PEFT prompt-learning adapter ({prompt_learning.peft_type.value}, from peft_config "
                f"or the PeftModel given as model) is not supported: its virtual tokens are not handled in "
                f"generation or the policy log-probs. Use an adapter such as LoRA (peft_config=LoraConfig(...)).")
        # Generation also ends on the model's own end ids (as in TRL): Qwen3's generation config adds
        # <|endoftext|> to the tokenizer's <|im_end|>, Llama 3 Instruct <|eom_id|>.
        self.eos_ids |= set(generation_eos_ids(model))
        if self.train_prompt_ids is not None:  # the eval datasets: check_eval_fit
            self._check_context(model, "train_dataset", self.train_prompt_ids)
        else:  # a stream: each chunk when it is first used (the one read already: now)
            self.prompt_batches.validate = lambda prompts, first: self._check_context(
                model, "train_dataset", [p.ids for p in prompts], first)
        if args.disable_dropout:
            for module in model.modules():
                if isinstance(module, torch.nn.Dropout):
                    module.p = 0.0
        if args.cast_lm_head_to_fp32:
            cast_lm_head_to_fp32(model)
        self.ref_model = None
        if args.beta > 0 and not self.is_peft:  # with PEFT the reference is the base model, adapters disabled
            source = self._model_source
            self.ref_model = (load_causal_lm(source, args.model_init_kwargs, args.trust_remote_code)
                              if isinstance(source, str) else copy.deepcopy(model))
            if args.cast_lm_head_to_fp32 and isinstance(source, str):  # a deep copy has it already
                cast_lm_head_to_fp32(self.ref_model)

    def _check_context(self, model, name: str, prompt_ids: list[list[int]], first: int = 0) -> None:
        """Every prompt leaves room for max_completion_length tokens in the model's context (rows counted from
        ``first`` in errors: a chunk of a stream)."""
        context = context_length(model)
        for index, ids in enumerate(prompt_ids if context else [], start=first):
            if len(ids) + self.args.max_completion_length > context:
                raise DatasetFormatError(
                    f"{name} row {index}: the prompt has {len(ids)} tokens; with max_completion_length="
                    f"{self.args.max_completion_length} that exceeds the model's context of {context} tokens. "
                    f"Shorten the prompt or lower max_completion_length.")

    def tokenize_eval(self, dataset, name: str) -> None:
        """Validate and tokenize ``dataset`` as the evaluation prompts (all but the model's context check)."""
        if is_stream(dataset):  # given to evaluate(): TRL's rule there too
            refuse_dispatch_batches(self.args)
        self.eval_rows, self.eval_prompt_ids = self._prompts(dataset, name)
        self.eval_given = dataset  # trainer.eval_dataset

    def check_eval_fit(self, model, name: str) -> None:
        self._check_context(model, name, self.eval_prompt_ids)

    def after_prepare(self) -> None:
        args = self.args
        self.entropy_control = EntropyControl(
            args.entropy_coef, args.use_adaptive_entropy, args.entropy_target, args.entropy_coef_delta,
            args.entropy_coef_min, args.entropy_coef_max) if args.entropy_coef or args.use_adaptive_entropy else None
        if self.ref_model is not None:
            self.ref_model = dist.prepare_frozen(self.accelerator, self.ref_model)
        for reward in self.rewards:
            if isinstance(reward.func, RewardModel):
                reward.func.model = dist.prepare_frozen(self.accelerator, reward.func.model)
        self._choose_sampler()

    def _choose_sampler(self) -> None:
        """The one place the rollout stage's sampler is chosen: a user's rollout_func, vLLM (use_vllm), or the
        policy itself (the lean engine or HF generate). Last in setting up: vLLM's engine takes the prepared
        policy's weights (gathered under ZeRO-3)."""
        args = self.args
        context = GenerationContext(self.accelerator, self.processing_class.pad_token_id, frozenset(self.eos_ids),
                                    engine=args.generation_engine, gather_for_generation=args.ds3_gather_for_generation,
                                    pad_to_multiple_of=args.pad_to_multiple_of)
        self.policy_sampler = PolicySampler(context, self.model, self.model_wrapped)
        if args.use_vllm:
            self.vllm_generation = VLLMGeneration(self)
        if self.rollout_func is not None:
            self.sampler = RolloutFuncSampler(self.rollout_func, self)
        elif args.use_vllm:
            self.sampler = VLLMSampler(self)
        else:
            self.sampler = self.policy_sampler

    # ------------------------------------------------------------------ the vLLM engine's lifetime

    def train(self, resume_from_checkpoint: bool | str | None = None):
        """BaseTrainer.train; with use_vllm the engine is shut down when it returns, fails or is stopped by a
        signal (it starts again if generation is needed later: evaluate, a rollout function)."""
        try:
            return super().train(resume_from_checkpoint)
        except VLLMServerError as error:  # every process has it (raise_together's shared): they stop together
            raise self._stopped_by_server(error) from error
        finally:
            self.close_vllm()
            if self.tool_loop is not None:  # its threads; a later round starts them again
                self.tool_loop.close()

    def _stopped_by_server(self, error: VLLMServerError) -> VLLMServerError:
        """The vLLM server failed mid-run (it died, or stopped answering): a resumable checkpoint of the last
        optimizer step (the failed round's prompts are not counted as read, see prepare_step), and the error to
        raise, which says where it is. No checkpoint before the first step: there is nothing to resume."""
        self.run_log.close()
        step = self.state.global_step
        if step == 0:
            where = "No optimizer step was done, so no checkpoint was written."
        else:
            path = self._checkpoint_now()
            where = (f"Training stopped after step {step}; checkpoint written to {path}. Restart the server and "
                     f"resume with trainer.train(resume_from_checkpoint=True) (or --resume_from_checkpoint true).")
        if self.accelerator.is_main_process:
            logger.error(f"{error} {where}")
        return VLLMServerError(f"{error} {where}")

    def end(self) -> None:
        self.close_vllm()
        if self.tool_loop is not None:
            self.tool_loop.close()
        super().end()

    def close_vllm(self) -> None:
        """Shut the vLLM engine (colocate) or client (server) down; idempotent, nothing without use_vllm."""
        if self.vllm_generation is not None:
            self.vllm_generation.close()

    # ------------------------------------------------------------------ log-probs

    @functools.cached_property
    def shares_prompt_forward(self) -> bool:
        """Whether a micro-batch's completions of one prompt share its forward (``shared_prompt_logprobs``):
        for the model families the lean engine knows, and not where a forward is collective: whether a
        micro-batch shares a prompt differs between processes. That also leaves out ZeRO-3, where a second
        forward per micro-batch would cost a second all-gather of every layer's weights (it computes correctly
        there: checked on CPU, not enabled). Under gradient checkpointing the function itself falls back where
        the checkpoints would lose the prompt's cache (reentrant ones, an older transformers)."""
        return (engine.supports(self.unwrapped_model)
                and not dist.forwards_are_collective(self.accelerator, self.model_wrapped)
                and not self.router_aux_loss_coef)  # the router loss wants every token's routing in one forward

    def policy_logprobs(self, model, batch: MicroBatch, with_entropy: bool = False, with_router_loss: bool = False,
                        entropy_grad: bool = False) -> dict:
        """The one entry point for log-probs of a micro-batch's completions under ``model`` (the policy, or the
        reference): {"logps": [B, C], "entropy": [B, C] with ``with_entropy``, "aux_loss" with
        ``with_router_loss``}. Rows of one prompt share its forward where that holds (``shares_prompt_forward``)."""
        if self.shares_prompt_forward:
            out = shared_prompt_logprobs(model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                         batch.completion_attention, batch.prompt_group, self.args.temperature,
                                         with_entropy, entropy_grad)
            if out is not None:  # None: no two rows of this micro-batch share a prompt
                return out
        input_ids, attention_mask, position_ids = batch.model_inputs()
        return token_logprobs(model, input_ids, batch.completion_ids, attention_mask, position_ids,
                              temperature=self.args.temperature, logits_to_keep=batch.completion_ids.shape[1],
                              with_entropy=with_entropy, with_router_loss=with_router_loss, entropy_grad=entropy_grad)

    def round_logprobs(self, model, rollout: Rollout) -> torch.Tensor:
        """Per-token log-probs of every completion of a round, in micro-batches: [N, C]."""
        out = torch.zeros_like(rollout.loss_mask)
        size = self.per_process_train_batch_size
        for start in range(0, rollout.loss_mask.shape[0], size):
            logps = self.policy_logprobs(model, rollout.micro_batch(start, start + size))["logps"]
            out[start:start + size, : logps.shape[1]] = logps
        return out

    def reference_logprobs(self, rollout: Rollout) -> torch.Tensor:
        """The reference model's log-probs of a round: [N, C]. With PEFT, the base model (adapters off)."""
        if self.ref_model is not None:
            return self.round_logprobs(self.ref_model, rollout)
        with self.unwrapped_model.disable_adapter():
            return self.round_logprobs(self.model_wrapped, rollout)

    @functools.cached_property
    def skips_zero_gradient_rows(self) -> bool:
        """skip_zero_gradient_rows where it holds: not where forwards are collective (ZeRO-3, FSDP, DDP with
        ddp_broadcast_buffers=True: the extra forward runs on some processes only), nor with an MoE router loss
        (every row's routing counts in it)."""
        return (self.args.skip_zero_gradient_rows and not dist.forwards_are_collective(self.accelerator, self.model_wrapped)
                and not self.router_aux_loss_coef)

    def _training_forward(self, model, batch: MicroBatch, **options) -> dict:
        """``policy_logprobs`` for the loss, with only the rows whose loss has a gradient in the backward.

        A row without loss tokens adds nothing to the loss; with beta=0 and no entropy bonus neither does a row
        with advantage 0, since every policy loss is a multiple of the advantage, nor one whose sampler weights
        (vllm_importance_sampling_*) are 0 on all its loss tokens. Such rows are forwarded without gradients (the
        logged entropy needs them; on the unwrapped model, as a forward with no backward needs none of DDP's
        bookkeeping), or, without loss tokens, not at all: their log-probs are set to the old ones (every ratio
        1, every term finite) and their entropy to 0 (masked). The result covers the whole micro-batch
        ({"logps", "entropy"}, [B, C]), so the loss and every statistic are computed as without skipping."""
        if not self.skips_zero_gradient_rows:
            return self.policy_logprobs(model, batch, **options)
        mask = batch.loss_mask  # [B, C]
        silent = mask.sum(-1) == 0  # [B]: no loss tokens
        idle = silent.clone()  # [B]: rows whose loss gradient is zero
        if self.args.beta == 0 and self.entropy_control is None:
            idle |= batch.advantages == 0
            if batch.sampler_weights is not None and self.args.loss_type != "vespo":
                idle |= (batch.sampler_weights * mask).sum(-1) == 0  # masked out by the sampler correction
        if not idle.any():
            return self.policy_logprobs(model, batch, **options)
        if idle.all():  # one row keeps a backward, so DDP's and DeepSpeed's gradient hooks fire on every process
            idle[0] = False
        trained, frozen = (~idle).nonzero().squeeze(1), (idle & ~silent).nonzero().squeeze(1)
        parts = [(trained, self.policy_logprobs(model, batch.rows(trained), **options))]
        if frozen.numel():
            with torch.no_grad():
                parts.append((frozen, self.policy_logprobs(dist.unwrap(self.accelerator, model), batch.rows(frozen),
                                                           with_entropy=True)))
        width = mask.shape[1]
        logps = batch.old_logps if batch.old_logps is not None else torch.zeros_like(mask)
        entropy = torch.zeros_like(mask)
        for rows, out in parts:  # [b, c] -> their rows of [B, C]; index_copy keeps the trained rows' gradient
            pad = (0, width - out["logps"].shape[1])
            logps = logps.index_copy(0, rows, torch.nn.functional.pad(out["logps"], pad))
            entropy = entropy.index_copy(0, rows, torch.nn.functional.pad(out["entropy"], pad))
        return {"logps": logps, "entropy": entropy}

    # ------------------------------------------------------------------ loss

    def compute_loss(self, model, batch: MicroBatch, counts: BatchCounts) -> tuple[torch.Tensor, Stats]:
        args, bonus = self.args, self.entropy_control
        # dr_grpo normalizes by the longest possible completion (the base loop's counts do not know GRPO)
        counts = dataclasses.replace(counts, max_completion_length=args.max_completion_length)
        # One autocast (bf16 mixed precision) around the micro-batch's forwards (the shared prompt's two, the rows
        # without a gradient): inside it autocast casts each weight to bf16 once for all of them. Each forward's
        # own would cast anew, and backward would keep a copy per forward (+2 bytes per parameter at the peak).
        with self.accelerator.autocast():
            out = self._training_forward(model, batch, with_entropy=True,
                                         with_router_loss=bool(self.router_aux_loss_coef), entropy_grad=bonus is not None)
        logps, mask, advantages = out["logps"], batch.loss_mask, batch.advantages  # [B, C], [B, C], [B]
        old = batch.old_logps if batch.old_logps is not None else logps.detach()
        policy = OBJECTIVES[args.loss_type](PolicyInputs(logps, old, advantages, mask, batch.sampler_weights), args)
        per_token = policy.per_token  # [B, C] or [B, 1]
        if args.off_policy_mask_threshold is not None:  # [B, 1]: whole completions
            # as TRL, measured from the sampler's log-probs when a rollout function gave them (both sources of
            # off-policyness: optimizer steps and the sampler's own numerics)
            behaviour = batch.sampler_logps if batch.sampler_logps is not None else old
            per_token = per_token * off_policy_sequence_mask(logps, behaviour, advantages, mask,
                                                             args.off_policy_mask_threshold)
        kept = mask  # [B, C]: the tokens the policy loss (and an entropy bonus) acts on
        if args.top_entropy_quantile < 1.0:  # the high-entropy tokens only
            kept = mask * high_entropy_mask(out["entropy"], mask, self._entropy_threshold(out["entropy"], mask))
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

    def _entropy_threshold(self, entropy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The (1 - top_entropy_quantile) quantile of the entropy of every process's loss tokens in this
        micro-batch (inf when there are none: nothing is kept), as TRL computes it."""
        values = dist.gather_varlen(self.accelerator, entropy.detach()[mask.bool()].float())
        if values.numel() == 0:
            return torch.tensor(float("inf"), device=entropy.device)
        return torch.quantile(values, 1.0 - self.args.top_entropy_quantile)

    def after_optimizer_step(self, metrics: dict) -> None:
        """The step's round metrics (the mean over the rounds built for it, as TRL averages what it appended);
        the entropy bonus's coefficient adapted to the step's entropy (and logged); and with sync_ref_model,
        every ref_model_sync_steps steps, the reference moved toward the policy (TRL's SyncRefModelCallback), so
        later rounds' KL is to the moved reference."""
        rounds, self._round_metrics = self._round_metrics, []
        for name in dict.fromkeys(name for m in rounds for name in m):
            metrics[name] = sum(m[name] for m in rounds if name in m) / sum(name in m for m in rounds)
        if self.entropy_control is not None:
            self.entropy_control.update(metrics.pop("entropy_bonus/entropy"))
            metrics["entropy_coef"] = self.entropy_control.coef
        args = self.args
        if args.sync_ref_model and (self.state.global_step + 1) % args.ref_model_sync_steps == 0:  # the step just done
            dist.mix_parameters(self.accelerator, self.unwrapped_model, self.ref_model, args.ref_model_mixup_alpha)

    # ------------------------------------------------------------------ evaluation and logging

    def eval_rows_per_batch(self) -> int:
        """Prompts per evaluation batch: per_device_eval_batch_size counts completions."""
        per_prompt = self.args.num_generations_eval or self.args.num_generations
        return max(1, self.per_process_eval_batch_size // per_prompt)

    def evaluation_stats(self) -> Stats:
        """Rewards, eval_loss and the loss's statistics of num_generations_eval (default num_generations) sampled
        completions per eval prompt (trainers/grpo/evaluation.py)."""
        return evaluation.evaluation_stats(self)

    def on_log(self, record: dict) -> None:
        if self.args.log_completions and self._samples and self.accelerator.is_main_process:
            write_completions(self.args.output_dir, record["step"], self._samples, self.args.num_completions_to_print)
            self._samples = []

    # ------------------------------------------------------------------ resume

    def save_extra_state(self, folder: str) -> None:
        save_data_position(self.prompt_batches, folder, self.accelerator.process_index)
        if self.args.sync_ref_model:  # the moved reference is not the model it was loaded from: keep it
            reference = dist.unwrap(self.accelerator, self.ref_model)
            with dist.gathered_parameters(self.accelerator, reference):
                if self.accelerator.is_main_process:
                    torch.save({k: v.detach().cpu() for k, v in reference.state_dict().items()},
                               os.path.join(folder, "reference.pt"))
        if self.entropy_control is not None:  # the adaptive coefficient and the entropy it last saw
            with open(os.path.join(folder, f"entropy-{self.accelerator.process_index}.json"), "w") as f:
                json.dump(dataclasses.asdict(self.entropy_control), f)
        if self._rounds:  # the last round may serve the next step too
            index = max(self._rounds)
            torch.save({"round": index, "rollout": self._rounds[index].to("cpu").__dict__},
                       os.path.join(folder, f"rollout-{self.accelerator.process_index}.pt"))

    def load_extra_state(self, folder: str) -> None:
        load_data_position(self.prompt_batches, folder, self.accelerator.process_index)
        if self.args.sync_ref_model and os.path.exists(os.path.join(folder, "reference.pt")):
            state = torch.load(os.path.join(folder, "reference.pt"), weights_only=True)
            dist.load_full_state_dict(self.accelerator, self.ref_model, state)
        entropy_path = os.path.join(folder, f"entropy-{self.accelerator.process_index}.json")
        if self.entropy_control is not None and os.path.exists(entropy_path):
            with open(entropy_path) as f:
                saved = json.load(f)
            self.entropy_control.coef, self.entropy_control.last_entropy = saved["coef"], saved["last_entropy"]
        path = os.path.join(folder, f"rollout-{self.accelerator.process_index}.pt")
        if os.path.exists(path):
            saved = torch.load(path, weights_only=True)
            self._rounds = {saved["round"]: Rollout(**saved["rollout"]).to(self.accelerator.device)}


for _name in TRL_CONFIG_ATTRIBUTES:
    setattr(GRPOTrainer, _name, _config_attribute(_name))
