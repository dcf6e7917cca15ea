"""SamplingTrainer: the base of every trainer that learns from its own samples (GRPO, RLOO, distillation).

It owns what they share, and an algorithm adds its loss and what its round needs:

- the prompts (``SamplingPrompts``, sampling/prompts.py) and where each micro-batch's rows come from (``_place``:
  a generation round serves ``steps_per_generation`` micro-steps, ``num_iterations`` times over);
- ``prepare_step``: the backend's weight sync, then each round the step trains on that is not built yet
  (``build_round``: the rollout stage, sampling/rollout.py; with async_generation its completions come from the
  producer, sampling/async_rounds.py);
- the generation backend's choice and lifetime (``GenerationLifetime``, sampling/generation_lifetime.py), the tool
  loop, the reward functions (an environment's among them), the advantage estimator (``ADVANTAGE_ESTIMATORS``,
  sampling/advantages.py) and the ``rollout_end`` / ``episode_end`` events;
- evaluation (sampling/evaluation.py), the completions table, and what a resumed run needs (sampling/resume.py).

A subclass declares its ``advantage_estimator`` (None: none), what its round needs (``round_needs``), its log-prob
scorer (``build_scorer``; None: its loss reads no log-probs of the round), its ``compute_loss``, and, with a
reference model or other frozen models, loads them in ``after_load`` / ``after_prepare``.
PolicyGradientTrainer (sampling/policy_gradient.py) is the part GRPO and RLOO share.
"""

from __future__ import annotations

import math

import torch

from trainers.parallel import distributed as dist
from trainers.loop import health
from trainers.agents.tool_loop import ToolLoop, ToolOptions
from trainers.loop.base import BaseTrainer
from trainers.errors import ConfigError, GenerationError, RemoteServiceError, VLLMServerError
from trainers.generation.backend import BACKENDS, Backend, PolicyBackend
from trainers.generation.sampling import SamplingParams
from trainers.generation.vllm_common import check_vllm_here
from trainers.model.modeling import cast_lm_head_to_fp32, generation_eos_ids, prompt_learning_config
from trainers.data.samplers import group_slots
from trainers.sampling.evaluation import EvaluationTotals, evaluation_batches, loss_batch
from trainers.sampling.advantages import ADVANTAGE_ESTIMATORS
from trainers.sampling.async_rounds import AsyncRounds
from trainers.sampling.batch import MicroBatch, Rollout, RoundPart, budget_micro_batches, round_shape
from trainers.sampling.config import SamplingConfig
from trainers.sampling.generation_lifetime import GenerationLifetime
from trainers.sampling.metrics import write_completions
from trainers.sampling.prompts import SamplingPrompts
from trainers.sampling.resume import load_round_state, save_round_state
from trainers.sampling.rewards import Reward, RewardModel, resolve_reward, reward_sources
from trainers.sampling.rollout import RolloutStage, RoundNeeds, Sampled
from trainers.sampling.scoring import LogProbScorer
from trainers.sampling.trl_attributes import TRLAttributes
from trainers.loop.stats import Stats
from trainers.data.streaming import is_stream, refuse_dispatch_batches


class SamplingTrainer(SamplingPrompts, GenerationLifetime, TRLAttributes, BaseTrainer):
    """The sampling base (module docstring). ``reward_funcs``: callables, built-in names, ``module:function``
    strings, or reward models; ``rewards_required``: whether training without any is refused (GRPO and RLOO
    learn from them; distillation from its teacher). ``rollout_func`` replaces the trainer's sampling
    (trainers/generation/user_rollout.py); ``tools`` and ``environment_factory`` run the tool loop."""

    config_class = SamplingConfig
    HEALTH_RULES = health.RULES  # non-finite steps; the policy-gradient trainers add the rules on rewards
    advantage_estimator: str | None = None  # an entry of ADVANTAGE_ESTIMATORS (sampling/advantages.py); None: none
    # A causal LM's buffers (the rotary frequencies) are constants; broadcasting them would make every DDP forward
    # a collective, and the number of forwards per micro-batch differs between processes here (a shared prompt
    # forward, rows out of the backward). ddp_broadcast_buffers=True restores DDP's default and turns both off.
    ddp_defaults = {"broadcast_buffers": False}
    EVAL_STATE = ("eval_rows", "eval_prompt_ids", "eval_given")

    def __init__(self, model, args: SamplingConfig | None = None, train_dataset=None, eval_dataset=None,
                 processing_class=None, callbacks=None, optimizers=(None, None), quantization_config=None,
                 peft_config=None, *, reward_funcs=None, reward_processing_classes=None, tools=None,
                 rollout_func=None, environment_factory=None, rewards_required: bool = True):
        name = type(self).__name__
        if dist.launched_with_fsdp():
            # FSDP2 would need what ZeRO-3 has here: generation synced across processes (a process that finishes
            # early leaves the others in FSDP's all-gathers), full tensors for the vLLM weight sync and the
            # reference mix, a global gradient norm. Refused until it is, before anything is built.
            raise ConfigError(f"{name}: FSDP (fsdp2.yaml) is not supported yet for the trainers that sample their "
                              f"own completions (GRPO, RLOO, distillation). Launch with zero3.yaml (the same "
                              f"sharding of weights, gradients and optimizer states) or multi_gpu.yaml.")
        if rollout_func is not None and not callable(rollout_func):
            raise ConfigError(f"rollout_func must be a function (prompts, trainer) -> dict, got "
                              f"{type(rollout_func).__name__}.")
        if rollout_func is not None and (tools or environment_factory):
            raise ConfigError(f"{name}: a rollout_func runs its own episodes; pass tools/environment_factory "
                              f"(the trainer's tool loop) or a rollout_func, not both.")
        if rollout_func is not None and getattr(args, "async_generation", False):
            raise ConfigError(f"{type(args).__name__}: async_generation=True samples in a producer thread of its "
                              f"own; a rollout_func runs the trainer's code, so it cannot run there. Give one of "
                              f"them.")
        # TRL's tool calling: built with the tokenizer (prepare_data); trainers/agents/tool_loop.py
        if tools is not None and not isinstance(tools, (list, tuple)):
            raise ConfigError(f"tools must be a list of functions, got {type(tools).__name__}.")
        self._tools, self._environment_factory = list(tools or []), environment_factory
        self.tool_loop: ToolLoop | None = None
        if train_dataset is None and environment_factory:  # the environment owns the data (TRL's rule)
            train_dataset = self._placeholder_rows(environment_factory, args)
        self.rollout_func = rollout_func
        self.backend: Backend | None = None  # chosen once the policy is prepared (_choose_backend)
        self.policy_sampler: PolicyBackend | None = None  # the policy itself (trainer.generate: a rollout_func's)
        self._vllm: Backend | None = None  # with use_vllm: TRL's trainer.vllm_generation
        self.stage: RolloutStage | None = None  # the rollout stage, built with the backend
        self.async_rounds: AsyncRounds | None = None  # async_generation: the backend, rounds sampled ahead
        self.ref_model: torch.nn.Module | None = None  # the reference model, where the algorithm has one
        self._reward_specs, self._reward_tokenizers = reward_sources(
            reward_funcs, reward_processing_classes, environment_factory is not None or not rewards_required)
        self._model_source = model
        self._rounds: dict[int, Rollout] = {}  # the rounds the current step trains on, by round index
        self._round_metrics: list[dict] = []  # one per round built since the last optimizer step
        self._samples: list[dict] = []  # log_completions: the last round's records, until they are logged
        super().__init__(model, args, train_dataset, eval_dataset, processing_class, peft_config, quantization_config,
                         callbacks, optimizers)

    # ------------------------------------------------------------------ what an algorithm declares

    def round_needs(self) -> RoundNeeds:
        """What a round computes beyond samples and rewards, as the trainer's loss and estimator ask (old and
        reference log-probs, dropped groups, the importance correction): nothing here."""
        return RoundNeeds()

    def reward_weights_given(self) -> list[float] | None:
        """The weights of the reward functions given (None: 1 each)."""
        return None

    @property
    def forward_token_budget(self) -> int | None:
        """The most tokens of one training forward (None: micro-batches of rows)."""
        return None

    def build_scorer(self) -> LogProbScorer | None:
        """The log-prob scorer of the policy (and the reference) the round and the loss use: old and reference
        log-probs, another sampler's compared with the policy's. None: the loss reads none (distillation's)."""
        return None

    def on_policy(self, round_index: int) -> bool:
        """Whether round ``round_index`` samples from the policy (distillation's lmbda draws some rounds from the
        dataset instead: ``off_policy_samples``)."""
        return True

    def off_policy_samples(self, rows: list[dict], prompt_ids: list[list[int]]) -> Sampled:
        """The completions of a round ``on_policy`` says is not sampled, for ``rows``."""
        raise NotImplementedError(f"{type(self).__name__} samples every round (on_policy).")

    # ------------------------------------------------------------------ data and rounds

    def prepare_data(self, train_dataset, eval_dataset) -> None:
        args, world, name = self.args, self.accelerator.num_processes, type(self.args).__name__
        self.steps_per_generation, self.generation_batch_size = round_shape(args, self.per_process_train_batch_size,
                                                                            world)
        self.prompts_per_round = self.generation_batch_size // args.num_generations
        other_sampler = "a rollout_func" if self.rollout_func is not None else "use_vllm" if args.use_vllm else None
        if args.generation_backend is not None and args.generation_backend not in BACKENDS:
            raise ConfigError(f"{name}: generation_backend={args.generation_backend!r} is not a registered "
                              f"backend; registered: {sorted(BACKENDS)} (trainers.generation.backend.register_backend "
                              f"adds one).")
        if args.generation_backend is not None and other_sampler is not None:
            raise ConfigError(f"{name}: generation_backend={args.generation_backend!r} chooses the sampler; "
                              f"{other_sampler} would choose another. Give one of them.")
        if args.use_vllm and args.vllm_mode == "colocate":  # before the model loads
            check_vllm_here()
        self.estimator = None if self.advantage_estimator is None else ADVANTAGE_ESTIMATORS[self.advantage_estimator]
        self.needs = self.round_needs()

        self.rewards: list[Reward] = [resolve_reward(spec, args.max_completion_length, tok, args.chat_template_kwargs,
                                                     args.model_init_kwargs, args.trust_remote_code)
                                      for spec, tok in zip(self._reward_specs, self._reward_tokenizers)]
        weights = self.reward_weights_given() or [1.0] * len(self.rewards)
        if len(weights) != len(self.rewards):
            raise ConfigError(f"reward_weights has {len(weights)} entries but reward_funcs has {len(self.rewards)}; "
                              f"give one weight per reward function.")
        if self._tools or self._environment_factory:
            options = ToolOptions(args.chat_template_kwargs, args.max_tool_calling_iterations, args.tool_workers,
                                  args.tool_timeout)
            self.tool_loop = ToolLoop(self._tools, self._environment_factory, options, self.processing_class,
                                      len(self.rewards))
            # an environment's get_reward is one more reward function, weight 1, named after its class (as TRL)
            self.rewards += [Reward(name, func) for name, func in self.tool_loop.reward_functions]
            weights = list(weights) + [1.0] * len(self.tool_loop.reward_functions)
        self.reward_weights = torch.tensor(weights, dtype=torch.float32)
        evals = eval_dataset.values() if isinstance(eval_dataset, dict) else [eval_dataset]
        if is_stream(train_dataset) or any(is_stream(data) for data in evals):
            refuse_dispatch_batches(args)
        self.read_train_prompts(train_dataset)
        if self.train_prompt_ids is not None:  # a stream's chunks: when each is first used (after_load)
            self._check_budget("train_dataset", self.train_prompt_ids)
        self.eval_rows = self.eval_prompt_ids = self.eval_given = None
        if eval_dataset is not None:
            self.tokenize_eval(eval_dataset, "eval_dataset")  # its context check waits for the model (after_load)
        self.eos_ids = {i for i in {self.processing_class.eos_token_id} if i is not None}
        self.sampling = SamplingParams(
            max_new_tokens=args.max_completion_length, temperature=args.temperature, top_p=args.top_p,
            top_k=args.top_k or 0, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
            extra=dict(args.generation_kwargs or {}))

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
            if self.async_rounds is not None:
                self._generate_ahead(step, needed)
            elif any(index not in self._rounds for index in needed):
                # the weight sync: an engine apart from the policy (vLLM) gets the weights of the optimizer step
                # just done (nothing when it holds them: a round built for this step already, or evaluation's)
                self.backend.sync_weights(step)
            for index in needed:
                if index not in self._rounds:
                    self._rounds[index] = self.build_round(index)
                    built.append(index)
        except (VLLMServerError, GenerationError, RemoteServiceError):
            # the run stops with a checkpoint of the step before (train()): its data position must not count
            # this step's prompts as read, or the resumed run would skip them (a stream is read in order)
            self._rounds = {index: rollout for index, rollout in self._rounds.items() if index not in built}
            self.prompt_batches.restore(position)
            raise

    def _first_step(self, round_index: int) -> int:
        """The first optimizer step that trains on generation round ``round_index``."""
        micro_steps = self.steps_per_generation * self.args.num_iterations
        return round_index * micro_steps // self.args.gradient_accumulation_steps

    def _my_rows(self, prompts: list) -> tuple[list[dict], list[list[int]]]:
        """This process's rows of a round's ``prompts`` (the same on every process): its contiguous share."""
        slots = group_slots(list(range(len(prompts))), self.args.num_generations, self.accelerator.num_processes,
                            self.accelerator.process_index)
        return [prompts[i].row for i in slots], [prompts[i].ids for i in slots]

    def build_round(self, round_index: int) -> Rollout:
        """Generation round ``round_index`` on this process (trainers/sampling/rollout.py); its metrics and
        completions wait for the step's log. With async_generation its completions come from the producer."""
        rows, ids = self._my_rows(self.prompt_batches.batch(round_index))  # the same prompts on every process
        sampled, lag = None, {}
        if not self.on_policy(round_index):  # completions from elsewhere (distillation's dataset rounds)
            sampled = self.off_policy_samples(rows, ids)
        elif self.async_rounds is not None:
            sampled, lag = self.async_rounds.take(round_index, self._first_step(round_index))
        built = self.stage.build(rows, ids, self.state, sampled=sampled)
        if built.sampled.episode is not None:
            self.callback_handler.fire("episode_end", episode=built.sampled.episode)
        self._round_metrics.append(built.metrics | lag)
        if built.completions is not None:  # as in TRL, the last round of a step is what gets logged
            self._samples = built.completions
        self.callback_handler.fire("rollout_end", round_index=round_index, rollout=built.rollout,
                                   samples=built.sampled.samples,
                                   metrics=built.metrics)
        return built.rollout

    def micro_batch(self, step: int, accumulation_index: int) -> MicroBatch:
        round_index, iteration, part = self._place(step, accumulation_index)
        if round_index not in self._rounds:
            raise RuntimeError(f"round {round_index} is not built: call prepare_step({step}) before micro_batch.")
        size = self.per_process_train_batch_size
        # a round trained on again (num_iterations > 1): its tokens were counted once, as in TRL
        return self._rounds[round_index].micro_batch(part * size, (part + 1) * size, count_tokens=iteration == 0)

    def step_batches(self, step: int) -> list[MicroBatch]:
        """The step's micro-batches: ``micro_batch`` for each accumulation index, or with a token budget, the
        same rows regrouped by tokens (``budget_micro_batches``), as many on every process."""
        budget = self.forward_token_budget
        if budget is None:
            return super().step_batches(step)
        spans: dict[tuple[int, int], list[int]] = {}  # (round, iteration over it) -> its slices this step trains on
        for a in range(self.args.gradient_accumulation_steps):
            round_index, iteration, part = self._place(step, a)
            spans.setdefault((round_index, iteration), []).append(part)
        size = self.per_process_train_batch_size  # a slice's rows; a span's slices are consecutive
        parts = [RoundPart(self._rounds[r], range(min(p) * size, (max(p) + 1) * size), count_tokens=iteration == 0)
                 for (r, iteration), p in spans.items()]
        return budget_micro_batches(self.accelerator, parts, budget)

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams | None = None) -> list[list[int]]:
        """Completions from the policy (eval mode, no gradients), for a rollout function. Every process must call
        this together."""
        return self.policy_sampler.generate(prompt_ids, params or self.sampling)

    # ------------------------------------------------------------------ models

    def after_load(self, model) -> None:
        args = self.args
        prompt_learning = prompt_learning_config(model)
        if prompt_learning is not None:
            # generation (the lean engine, the shared prompt cache), left-padded prompts' position ids and the
            # reference (adapters off) all assume the model's inputs are the tokens themselves
            raise ConfigError(
                f"{type(self).__name__}: a PEFT prompt-learning adapter ({prompt_learning.peft_type.value}, from "
                f"peft_config or the PeftModel given as model) is not supported: its virtual tokens are not handled "
                f"in generation or the policy log-probs. Use an adapter such as LoRA (peft_config=LoraConfig(...)).")
        # Generation also ends on the model's own end ids (as in TRL): Qwen3's generation config adds
        # <|endoftext|> to the tokenizer's <|im_end|>, Llama 3 Instruct <|eom_id|>.
        self.eos_ids |= set(generation_eos_ids(model))
        if self.train_prompt_ids is not None:  # the eval datasets: check_eval_fit
            self._check_context(model, "train_dataset", self.train_prompt_ids)
        else:  # a stream: each chunk when it is first used (the one read already: now)
            def validate(prompts, first):
                self._check_context(model, "train_dataset", [p.ids for p in prompts], first)
                self._check_budget("train_dataset", [p.ids for p in prompts], first)

            self.prompt_batches.validate = validate
        if args.disable_dropout:
            for module in model.modules():
                if isinstance(module, torch.nn.Dropout):
                    module.p = 0.0
        if args.cast_lm_head_to_fp32:
            cast_lm_head_to_fp32(model)

    def after_prepare(self) -> None:
        for reward in self.rewards:
            if isinstance(reward.func, RewardModel):
                reward.func.model = dist.prepare_frozen(self.accelerator, reward.func.model)
        self.scorer = self.build_scorer()
        self.backend = self._choose_backend()
        if self.args.async_generation:  # the backend seen through the producer's pipeline (sampling/async_rounds.py)
            self.backend = self._generate_asynchronously(self.backend)
        self.stage = RolloutStage(self.backend, self.tool_loop, self.rewards, self.reward_weights, self.scorer,
                                  self.args, self.accelerator, self.processing_class, self.eos_ids, self.sampling,
                                  self.needs, self.estimator)

    def after_optimizer_step(self, metrics: dict) -> None:
        """The step's round metrics: the mean over the rounds built for it, as TRL averages what it appended; the
        asynchronous pipeline's waits and syncs since the last step; with several vLLM servers, the pool's."""
        rounds, self._round_metrics = self._round_metrics, []
        for name in dict.fromkeys(name for m in rounds for name in m):
            metrics[name] = sum(m[name] for m in rounds if name in m) / sum(name in m for m in rounds)
        if self.async_rounds is not None:
            self.async_rounds.settle_weights()  # in flight, the step's push finished while it trained
            metrics.update(self.async_rounds.step_metrics())
        if hasattr(self._vllm, "step_metrics"):  # several vLLM servers: those in service, failovers, shares
            metrics.update(self._vllm.step_metrics())

    # ------------------------------------------------------------------ evaluation and logging

    def eval_rows_per_batch(self) -> int:
        """Prompts per evaluation batch: per_device_eval_batch_size counts completions."""
        per_prompt = self.args.num_generations_eval or self.args.num_generations
        return max(1, self.per_process_eval_batch_size // per_prompt)

    def evaluation_stats(self) -> Stats:
        """Rewards, eval_loss and the loss's statistics of num_generations_eval (default num_generations) sampled
        completions per eval prompt, as (sum, count) pairs of this process (the caller sums them over processes;
        trainers/sampling/evaluation.py). Each batch is built by the stage as a round is, then ``compute_loss``
        runs on it; every process runs as many batches."""
        per_prompt = self.args.num_generations_eval or self.args.num_generations
        self.backend.sync_weights(self.state.global_step)  # the weight sync: evaluation samples this step's policy
        totals = EvaluationTotals(self.rewards, self.reward_weights, self.accelerator, self.tool_loop is not None)
        for prompts in evaluation_batches(len(self.eval_rows), self.eval_rows_per_batch(), self.accelerator):
            indices = [i for i in (prompts or [0]) for _ in range(per_prompt)]  # a prompt's completions together
            built = self.stage.evaluation_round([self.eval_rows[i] for i in indices],
                                                [self.eval_prompt_ids[i] for i in indices], self.state, per_prompt,
                                                score=bool(prompts))
            if built.sampled.episode is not None:
                self.callback_handler.fire("episode_end", episode=built.sampled.episode)
            loss, stats = self.compute_loss(self.model_wrapped, *loss_batch(built.rollout))
            totals.add(built, loss, stats, counted=bool(prompts))
            self.callback_handler.fire("prediction_step")
        return totals.stats()

    def on_log(self, record: dict) -> None:
        if self.args.log_completions and self._samples and self.accelerator.is_main_process:
            write_completions(self.args.output_dir, record["step"], self._samples, self.args.num_completions_to_print)
            self._samples = []

    # ------------------------------------------------------------------ resume

    def save_extra_state(self, folder: str) -> None:
        save_round_state(folder, self.accelerator, self.prompt_batches, self._rounds)

    def load_extra_state(self, folder: str) -> None:
        rounds = load_round_state(folder, self.accelerator, self.prompt_batches)
        if rounds:
            self._rounds = rounds

