"""TRL's public attributes of ``GRPOTrainer`` that user code reads (``trainer.beta``, ``trainer.reward_funcs``,
``trainer.vllm_generation``, ...), in one mixin: each reads the config or the part of the trainer that holds it,
the one place it is kept. The trainers themselves hold none of them."""

from __future__ import annotations

import dataclasses

from trainers.config.trl_options import TRL_ONLY_OPTIONS
from trainers.sampling.rewards import RewardModel

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
        raise AttributeError(f"{type(self).__name__}.{name} reads args.{name}, which the trainer was set up with; set "
                             f"{type(self.args).__name__}({name}=...) before building the trainer.")

    return property(read, refuse, doc=f"``args.{name}``, as TRL's trainer attribute of that name.")


class TRLAttributes:
    """TRL's ``GRPOTrainer`` attributes (module docstring). Each subclass reads, of TRL_CONFIG_ATTRIBUTES, those its
    config has (a field, or a TRL option accepted at TRL's default)."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        options = {f.name for f in dataclasses.fields(cls.config_class)} | set(TRL_ONLY_OPTIONS)
        for name in TRL_CONFIG_ATTRIBUTES:
            if name in options and name not in cls.__dict__:
                setattr(cls, name, _config_attribute(name))

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
    def eos_token_ids(self) -> list[int]:
        """The ids that end a completion: the tokenizer's EOS first, then the model's own end ids (as TRL)."""
        first = self.processing_class.eos_token_id
        return ([first] if first is not None else []) + sorted(self.eos_ids - {first})

    @property
    def vllm_generation(self):
        """TRL's ``trainer.vllm_generation`` with use_vllm: the vLLM backend (``.llm`` colocated,
        ``.vllm_client`` as a server; trainers/generation/vllm_colocate.py, vllm_remote.py); None without."""
        return getattr(self, "_vllm", None)

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
