"""PolicyGradientTrainer: what GRPO and RLOO add to the sampling base (sampling/trainer.py), as
PolicyGradientConfig adds it to SamplingConfig: reward weights, a frozen reference model for the KL (``beta`` > 0;
the shared ``FrozenReference``, model/reference.py, as DPO's and KTO's; with PEFT the policy with its adapters
off) that sync_ref_model moves toward the policy, the policy's forwards
(padding_free, token_budget, skip_zero_gradient_rows), and the health rules on rewards, KL and exploration.
Each of GRPO and RLOO adds its advantage estimator and its loss; neither is the other's subclass."""

from __future__ import annotations

from trainers.loop import health
from trainers.errors import ConfigError
from trainers.model.modeling import cast_lm_head_to_fp32
from trainers.model.reference import FrozenReference
from trainers.model.output_head import plan_head
from trainers.sampling import health as policy_health
from trainers.sampling.config import PolicyGradientConfig
from trainers.sampling.rollout import RoundNeeds
from trainers.sampling.scoring import LogProbScorer
from trainers.sampling.trainer import SamplingTrainer


class PolicyGradientTrainer(FrozenReference, SamplingTrainer):
    """The sampling base with rewards, a reference model and the policy's forward options (module docstring)."""

    config_class = PolicyGradientConfig
    scorer_class = LogProbScorer  # the log-prob scorer built in build_scorer (a subclass may observe its forwards)
    HEALTH_RULES = policy_health.RULES + health.RULES  # reward variance, entropy, truncation, length, KL; non-finite

    def __init__(self, model, reward_funcs, args, train_dataset, eval_dataset, processing_class,
                 reward_processing_classes, callbacks, optimizers, quantization_config, peft_config, tools,
                 rollout_func, environment_factory):
        super().__init__(model, args, train_dataset, eval_dataset, processing_class, callbacks, optimizers,
                         quantization_config, peft_config, reward_funcs=reward_funcs,
                         reward_processing_classes=reward_processing_classes, tools=tools, rollout_func=rollout_func,
                         environment_factory=environment_factory)

    def round_needs(self) -> RoundNeeds:
        """The old log-probs once an optimizer step falls inside a round (the importance ratio is no longer 1) or
        the advantage estimator reads them; the reference's with a KL (beta > 0); dynamic_sampling's dropped
        groups."""
        args = self.args
        old = (args.num_iterations > 1 or args.gradient_accumulation_steps % self.steps_per_generation != 0
               or self.estimator.needs_old_logps(args))
        return RoundNeeds(old_logps=old, ref_logps=args.beta > 0, dynamic_sampling=args.dynamic_sampling)

    def reward_weights_given(self) -> list[float] | None:
        return self.args.reward_weights

    @property
    def forward_token_budget(self) -> int | None:
        return self.args.token_budget

    def build_scorer(self, **loss) -> LogProbScorer:
        """The log-prob scorer of the policy and the reference, with the policy's forward options, and ``loss``:
        what the algorithm's loss adds (GRPO: an entropy bonus, objectives that fold the sampler's weights in)."""
        args = self.args
        return self.scorer_class(self.accelerator, self.unwrapped_model, self.model_wrapped, self.ref_model,
                                 self.per_process_train_batch_size, temperature=args.temperature,
                                 router_aux_loss_coef=self.router_aux_loss_coef, padding_free=args.padding_free,
                                 token_budget=args.token_budget, skip_zero_gradient_rows=args.skip_zero_gradient_rows,
                                 kl_in_loss=args.beta > 0, **loss)

    # TRL's names for the log-prob scorer's (trainers/sampling/scoring.py), where tests and scripts read them

    def policy_logprobs(self, model, batch, **options) -> dict:
        return self.scorer.policy_logprobs(model, batch, **options)

    @property
    def shares_prompt_forward(self) -> bool:
        return self.scorer.shares_prompt_forward

    @property
    def skips_zero_gradient_rows(self) -> bool:
        return self.scorer.skips_zero_gradient_rows

    def after_load(self, model) -> None:
        super().after_load(model)
        args = self.args
        if args.padding_free and plan_head(model) is None:
            raise ConfigError(
                f"{type(args).__name__}.padding_free=True needs an output head the chunked head computes "
                f"(trainers/model/output_head.py); {type(getattr(model, 'module', model)).__name__}'s is not one (its "
                f"logits are scaled or soft-capped after the head, a hook watches the head, or a PEFT adapter on it "
                f"is not plain LoRA). Set padding_free=False.")
        if args.beta > 0:  # a frozen copy of the model as loaded; with PEFT none (the base model, adapters off)
            self.load_reference(model, None, self._model_source)
            if self.ref_model is not None and args.cast_lm_head_to_fp32 and isinstance(self._model_source, str):
                cast_lm_head_to_fp32(self.ref_model)  # a deep copy has it already

    def after_prepare(self) -> None:
        self.prepare_reference()  # before the scorer, which holds it
        super().after_prepare()

    def after_optimizer_step(self, metrics: dict) -> None:
        """With sync_ref_model, every ref_model_sync_steps steps, the reference moved toward the policy (TRL's
        SyncRefModelCallback), so later rounds' KL is to the moved reference."""
        super().after_optimizer_step(metrics)
        self.sync_reference()

    @property
    def epsilon_low(self) -> float:
        return self.args.epsilon

    @property
    def epsilon_high(self) -> float:
        return self.args.clip_high

    def save_extra_state(self, folder: str) -> None:
        super().save_extra_state(folder)
        self.save_moved_reference(folder)

    def load_extra_state(self, folder: str) -> None:
        super().load_extra_state(folder)
        self.load_moved_reference(folder)
