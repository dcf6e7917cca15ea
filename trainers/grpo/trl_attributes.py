"""TRL's public attributes of ``GRPOTrainer`` that user code reads (``trainer.beta``, ``trainer.reward_funcs``,
``trainer.vllm_generation``, ...), in one mixin: each reads the config or the part of the trainer that holds it,
the one place it is kept. The trainer itself (grpo/trainer.py) holds none of them."""

from __future__ import annotations

import torch

from trainers.grpo.objectives import off_policy_sequence_mask
from trainers.grpo.rewards import RewardModel

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


class TRLAttributes:
    """TRL's ``GRPOTrainer`` attributes (module docstring)."""

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

    @property
    def vllm_generation(self):
        """TRL's ``trainer.vllm_generation`` with use_vllm: the vLLM backend (``.llm`` colocated,
        ``.vllm_client`` as a server; trainers/generation/vllm_colocate.py, vllm_remote.py); None without."""
        return getattr(self, "_vllm", None)

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

    # the log-prob scorer's (trainers/grpo/scoring.py), where tests and scripts read them on the trainer

    def policy_logprobs(self, model, batch, **options) -> dict:
        return self.scorer.policy_logprobs(model, batch, **options)

    @property
    def shares_prompt_forward(self) -> bool:
        return self.scorer.shares_prompt_forward

    @property
    def skips_zero_gradient_rows(self) -> bool:
        return self.scorer.skips_zero_gradient_rows

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


def add_config_attributes(cls: type) -> type:
    """``cls.<name>`` reads ``args.<name>`` for each of TRL_CONFIG_ATTRIBUTES."""
    for name in TRL_CONFIG_ATTRIBUTES:
        setattr(cls, name, _config_attribute(name))
    return cls
