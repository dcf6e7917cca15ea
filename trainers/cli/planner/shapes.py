"""What the planner plans for: model shapes (a built-in size table or a local folder's config.json) and the
training set-up (PlanInputs), validated with errors naming the flag."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from trainers.errors import ConfigError

GB = 1024 ** 3

# ----------------------------------------------------------------------------------------------------------------
# Model shapes
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """The architecture numbers memory depends on (a Llama/Qwen2-style decoder with a SwiGLU MLP)."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    tied_embeddings: bool
    head_dim: int = 0  # 0: hidden_size // num_heads
    qkv_bias: bool = False  # Qwen2 has biases on the q/k/v projections, Llama does not

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_size

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_size

    def layer_parameters(self) -> int:
        """Parameters of one decoder layer: attention, SwiGLU MLP, two RMSNorms."""
        h, q, kv, i = self.hidden_size, self.q_dim, self.kv_dim, self.intermediate_size
        attention = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if self.qkv_bias else 0)
        return attention + 3 * h * i + 2 * h

    def embedding_parameters(self) -> int:
        """Input embeddings, plus the output projection when it is not tied to them."""
        return self.vocab_size * self.hidden_size * (1 if self.tied_embeddings else 2)

    def num_parameters(self) -> int:
        return self.num_layers * self.layer_parameters() + self.embedding_parameters() + self.hidden_size

    def largest_parameter(self) -> int:
        return max(self.vocab_size * self.hidden_size, self.hidden_size * self.intermediate_size)

    def lora_parameters(self, rank: int) -> int:
        """LoRA A and B matrices on every linear layer of the decoder (peft's "all-linear": not lm_head)."""
        h, q, kv, i = self.hidden_size, self.q_dim, self.kv_dim, self.intermediate_size
        per_layer = (h + q) + 2 * (h + kv) + (q + h) + 2 * (h + i) + (i + h)  # (in + out) per adapted matrix
        return self.num_layers * rank * per_layer


# Shapes of public checkpoints (their config.json): Qwen2.5 for 0.5B-32B and 72B, Llama-3.x for 1B, 8B and 70B.
MODEL_SIZES: dict[str, ModelShape] = {
    "0.5B": ModelShape("Qwen2.5-0.5B", 896, 24, 14, 2, 4864, 151936, True, qkv_bias=True),
    "1B": ModelShape("Llama-3.2-1B", 2048, 16, 32, 8, 8192, 128256, True, head_dim=64),
    "1.5B": ModelShape("Qwen2.5-1.5B", 1536, 28, 12, 2, 8960, 151936, True, qkv_bias=True),
    "3B": ModelShape("Qwen2.5-3B", 2048, 36, 16, 2, 11008, 151936, True, qkv_bias=True),
    "7B": ModelShape("Qwen2.5-7B", 3584, 28, 28, 4, 18944, 152064, False, qkv_bias=True),
    "8B": ModelShape("Llama-3.1-8B", 4096, 32, 32, 8, 14336, 128256, False),
    "14B": ModelShape("Qwen2.5-14B", 5120, 48, 40, 8, 13824, 152064, False, qkv_bias=True),
    "32B": ModelShape("Qwen2.5-32B", 5120, 64, 40, 8, 27648, 152064, False, qkv_bias=True),
    "70B": ModelShape("Llama-3.1-70B", 8192, 80, 64, 8, 28672, 128256, False),
    "72B": ModelShape("Qwen2.5-72B", 8192, 80, 64, 8, 29568, 152064, False, qkv_bias=True),
}


def shape_from_size(size: str) -> ModelShape:
    """``7B`` / ``7b`` -> the table's shape; anything else is an error naming --model-size."""
    key = size.strip().upper()
    if key not in MODEL_SIZES:
        raise ConfigError(f"--model-size {size!r} is not a known size; known: {', '.join(MODEL_SIZES)} "
                          "(or give --model PATH, a folder with a config.json).")
    return MODEL_SIZES[key]


def shape_from_folder(path: str) -> ModelShape:
    """The shape of a local model folder, read from its config.json (offline, with transformers.AutoConfig)."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"--model {path!r} is not a model folder with a config.json (the planner reads a local "
                          f"folder only; or give --model-size, one of {', '.join(MODEL_SIZES)}).")
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as error:
        raise ConfigError(f"--model {path!r}: transformers cannot read its config.json ({error}).") from error
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    needed = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
    missing = [name for name in needed if getattr(config, name, None) is None]
    if missing:
        raise ConfigError(f"--model {path!r}: its config.json has no {', '.join(missing)}; the planner knows "
                          "Llama/Qwen2-style decoders. Use --model-size with the closest size instead.")
    heads = config.num_attention_heads
    return ModelShape(
        name=os.path.basename(os.path.normpath(path)), hidden_size=config.hidden_size,
        num_layers=config.num_hidden_layers, num_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        intermediate_size=config.intermediate_size, vocab_size=config.vocab_size,
        tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        head_dim=getattr(config, "head_dim", None) or 0,
        qkv_bias=bool(getattr(config, "attention_bias", config.model_type == "qwen2")),
    )


# ----------------------------------------------------------------------------------------------------------------
# What to plan for
# ----------------------------------------------------------------------------------------------------------------


METHODS = ("grpo", "rloo", "distill", "sft", "dpo", "reward", "kto")
# the methods that generate: planned alike (GRPO, RLOO and distillation share the sampling base's rollout stage)
SAMPLING = ("grpo", "rloo", "distill")


def _opt(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass
class PlanInputs:
    """One training set-up to plan for: the model (a local folder or a size from MODEL_SIZES), the method and
    its sequence lengths, LoRA, the GPUs, the batch, and the memory savers. Field help is also the flags' help."""

    model: str | None = _opt(None, "Local model folder; its config.json gives the shape (exclusive with --model-size).")
    model_size: str | None = _opt(None, f"A size from the built-in table: {', '.join(MODEL_SIZES)}.")
    method: str = _opt("grpo", "grpo, rloo, distill, sft, dpo, reward or kto (max_length applies to all but grpo, "
                               "rloo and distill; dpo and reward forward chosen and rejected together: "
                               "per_device_batch counts pairs).")
    teacher: str | None = _opt(None, "distill: the teacher's local folder (default: a teacher of the model's shape).")
    teacher_size: str | None = _opt(None, "distill: the teacher's size from the built-in table (exclusive with "
                                          "--teacher).")
    lora: bool = _opt(False, "Train a LoRA adapter on all linear layers instead of every weight.")
    lora_r: int = _opt(16, "LoRA rank (with lora).")
    num_gpus: int = _opt(1, "GPUs (processes) in all; with --device cpu, processes.")
    gpu_memory: float = _opt(80.0, "Memory of one GPU in GB (GiB); with --device cpu, RAM per process.")
    per_device_batch: int = _opt(8, "per_device_train_batch_size: sequences per process per micro-step "
                                    "(GRPO: completions, not prompts).")
    num_generations: int = _opt(8, "GRPO completions per prompt; the global generation batch must be a multiple.")
    max_completion_length: int = _opt(512, "GRPO: tokens generated per completion at most.")
    max_prompt_length: int = _opt(512, "GRPO: the longest prompt, in tokens.")
    max_length: int = _opt(1024, "SFT: tokens per training row (SFTConfig.max_length).")
    gradient_checkpointing: bool = _opt(False, "Recompute activations in backward (keeps one layer's worth).")
    beta: float = _opt(0.0, "GRPO KL weight; > 0 keeps a reference model (with LoRA: the base, no copy).")
    bf16: bool | None = _opt(None, "bf16 mixed precision. None: true on GPUs (as the templates say), false with "
                                   "--device cpu (as benchmarks/memory.py measures).")
    device: str = _opt("gpu", "gpu: memory per GPU; cpu: peak RSS per process of a CPU run (calibration).")
    steps_per_generation: int = _opt(1, "GRPO micro-steps per generation round: a process generates "
                                        "per_device_batch x this many completions at once.")
    token_budget: int | None = _opt(None, "GRPO: GRPOConfig.token_budget (with padding_free): a training "
                                          "forward's tokens at most, whatever per_device_batch is. None: "
                                          "per_device_batch rows of the longest prompt and completion.")
    ds3_gather_for_generation: bool = _opt(True, "GRPO under ZeRO-3: gather the full weights for generation "
                                                 "(fast); False generates layer by layer (slow, small).")

    @property
    def uses_bf16(self) -> bool:
        return self.bf16 if self.bf16 is not None else self.device == "gpu"

    @property
    def on_cpu(self) -> bool:
        return self.device == "cpu"


def validate(inputs: PlanInputs) -> None:
    """Raise a ConfigError naming the flag for anything the planner cannot use."""
    if (inputs.model is None) == (inputs.model_size is None):
        raise ConfigError("Give exactly one of --model PATH (a local folder with config.json) or --model-size "
                          f"(one of {', '.join(MODEL_SIZES)}).")
    checks = [
        ("--method", inputs.method, inputs.method in METHODS, " or ".join(METHODS)),
        ("--device", inputs.device, inputs.device in ("gpu", "cpu"), "gpu or cpu"),
        ("--lora-r", inputs.lora_r, inputs.lora_r > 0, "a positive integer"),
        ("--num-gpus", inputs.num_gpus, inputs.num_gpus > 0, "a positive integer"),
        ("--gpu-memory", inputs.gpu_memory, inputs.gpu_memory > 0, "a positive number of GB"),
        ("--per-device-batch", inputs.per_device_batch, inputs.per_device_batch > 0, "a positive integer"),
        ("--num-generations", inputs.num_generations, inputs.method == "distill" or inputs.num_generations >= 2,
         "at least 2"),
        ("--teacher", inputs.teacher, inputs.teacher is None or inputs.teacher_size is None,
         "given alone: --teacher and --teacher-size both name the teacher"),
        ("--teacher", inputs.teacher or inputs.teacher_size, inputs.method == "distill"
         or (inputs.teacher is None and inputs.teacher_size is None), "given with --method distill only"),
        ("--max-completion-length", inputs.max_completion_length, inputs.max_completion_length > 0, "positive"),
        ("--max-prompt-length", inputs.max_prompt_length, inputs.max_prompt_length > 0, "positive"),
        ("--max-length", inputs.max_length, inputs.max_length > 0, "positive"),
        ("--beta", inputs.beta, inputs.beta >= 0, ">= 0"),
        ("steps_per_generation", inputs.steps_per_generation, inputs.steps_per_generation > 0, "positive"),
        ("--token-budget", inputs.token_budget, inputs.token_budget is None
         or inputs.token_budget >= inputs.max_prompt_length + inputs.max_completion_length,
         "at least --max-prompt-length + --max-completion-length (the trainer refuses a smaller one)"),
    ]
    for flag, value, ok, valid in checks:
        if not ok:
            raise ConfigError(f"{flag} {value!r} is invalid; it must be {valid}.")


def resolve_shape(inputs: PlanInputs) -> ModelShape:
    validate(inputs)
    return shape_from_folder(inputs.model) if inputs.model else shape_from_size(inputs.model_size)


def teacher_shape(inputs: PlanInputs, student: ModelShape) -> ModelShape:
    """distill: the teacher's shape (--teacher or --teacher-size; default: the student's)."""
    if inputs.teacher:
        return shape_from_folder(inputs.teacher)
    return shape_from_size(inputs.teacher_size) if inputs.teacher_size else student
