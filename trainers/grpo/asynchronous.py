"""TRL's experimental asynchronous GRPO contract (``trl.experimental.async_grpo``) on GRPOTrainer: a TRL script ports
by changing its import. ``AsyncGRPOConfig`` is GRPOConfig with async_generation on, the vLLM server on, and the
defaults of TRL's AsyncGRPOConfig; every GRPOConfig option stays available (TRL's takes a subset). The pipeline
itself is trainers/sampling/async_rounds.py; docs/grpo.md, "Asynchronous generation", maps the options."""

from __future__ import annotations

from dataclasses import dataclass

from trainers.errors import ConfigError
from trainers.grpo.config import GRPOConfig
from trainers.grpo.trainer import GRPOTrainer
from trainers.config.options import check_field, opt, reject_unknown_options

DTYPES = ("auto", "bfloat16", "float16", "float32")


@reject_unknown_options
@dataclass
class AsyncGRPOConfig(GRPOConfig):
    """GRPOConfig with generation ahead of training, against a `trainers vllm-serve` server, and the defaults of
    TRL's experimental AsyncGRPOConfig."""

    async_generation: bool = opt(True, "Generate rounds ahead of training (GRPOConfig's switch; on here).")
    use_vllm: bool = opt(True, "Sample from a vLLM server (on here: TRL's async trainer has no other sampler).")
    vllm_mode: str = opt("server", "Only 'server' here: generation runs ahead in an engine apart from training.",
                         choices=("server",))
    vllm_server_base_url: str | None = opt("http://localhost:8000", "The vLLM server's URL (TRL's default).")
    dtype: str = opt(
        "float32", "The policy's dtype when it is loaded from a path (TRL's AsyncGRPOConfig): a dtype in "
        "model_init_kwargs wins. Serve the same dtype (`trainers vllm-serve --dtype`) to keep the sampler's "
        "log-probs close to the trainer's.", choices=DTYPES)
    max_completion_length: int = opt(2048, "Maximum tokens generated per completion (TRL's async default).", ge=1)
    logging_steps: float = opt(1, "Log every this many optimizer steps (TRL's async default).", gt=0)
    lr_scheduler_type: str = opt(
        "constant", "The learning-rate schedule (TRL's async default: constant).")
    gradient_checkpointing: bool = opt(
        True, "Recompute activations in backward to save memory (TRL's async default).")

    def __post_init__(self):
        init = dict(self.model_init_kwargs or {})
        init.setdefault("dtype", self.dtype)  # as TRL: model_init_kwargs' dtype first
        self.model_init_kwargs = init
        super().__post_init__()
        check_field(self.async_generation, type(self).__name__, "async_generation", self.async_generation,
                    "AsyncGRPOConfig generates ahead of training; for synchronous GRPO use GRPOConfig")


class AsyncGRPOTrainer(GRPOTrainer):
    """GRPOTrainer with an AsyncGRPOConfig, in the argument order of TRL's experimental AsyncGRPOTrainer (model,
    reward_funcs, args, train_dataset, processing_class, callbacks, optimizers, peft_config, tools,
    environment_factory, rollout_worker, weight_transfer); GRPOTrainer's other arguments by keyword."""

    config_class = AsyncGRPOConfig
    _tag_names = ("trainers", "async-grpo")

    def __init__(self, model, reward_funcs=None, args: AsyncGRPOConfig | None = None, train_dataset=None,
                 processing_class=None, callbacks=None, optimizers=(None, None), peft_config=None, tools=None,
                 environment_factory=None, rollout_worker=None, weight_transfer=None, *, eval_dataset=None,
                 reward_processing_classes=None):
        for name, given in (("rollout_worker", rollout_worker), ("weight_transfer", weight_transfer)):
            if given is not None:
                raise ConfigError(f"AsyncGRPOTrainer: `{name}` (TRL's pluggable {name.replace('_', ' ')}) is not "
                                  f"taken: the producer samples through the vLLM server's client and the weights "
                                  f"go through `trainers vllm-serve`'s transfer engine (docs/grpo.md, "
                                  f"'Asynchronous generation'). Leave it None.")
        super().__init__(model, reward_funcs, args, train_dataset, eval_dataset, processing_class,
                         reward_processing_classes, callbacks, optimizers, peft_config=peft_config, tools=tools,
                         environment_factory=environment_factory)
