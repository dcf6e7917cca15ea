"""Memory per GPU for every shipped Accelerate template, and the cheapest one that fits: ``trainers plan``.

    trainers plan --model-size 7B --method grpo --num-gpus 8 --gpu-memory 80
    trainers plan --model path/to/model --method sft --lora --num-gpus 1 --gpu-memory 24
    trainers plan --model-size 7B --num-gpus 8 --json
    trainers plan --model PATH --method sft --num-gpus 2 --device cpu     # peak RSS per process, CPU run

For each template in accelerate_configs/ the planner adds up what one process holds at its peak: weights,
gradients, fp32 master weights and Adam states (split as the ZeRO stage, FSDP or offload splits them), the
GRPO reference model, activations (a per-token-per-layer formula, with or without gradient checkpointing),
the logits, the KV cache of generation, the weights ZeRO-3 gathers, and a named runtime overhead. It then
recommends the cheapest template that fits (offload last: it is the slowest), prints the launch commands,
and when nothing fits, recomputes with LoRA, gradient checkpointing, a smaller batch and offload and says
which of those would fit. The formulas and their limits are in docs/distributed.md ("The planner").

GB here are GiB (2^30 bytes), as torch.cuda and benchmarks/memory.py report them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainers.errors import ConfigError

GB = 1024 ** 3
TEMPLATES_DIR = Path(__file__).resolve().parent.parent / "accelerate_configs"

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


def _opt(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass
class PlanInputs:
    """One training set-up to plan for: the model (a local folder or a size from MODEL_SIZES), the method and
    its sequence lengths, LoRA, the GPUs, the batch, and the memory savers. Field help is also the flags' help."""

    model: str | None = _opt(None, "Local model folder; its config.json gives the shape (exclusive with --model-size).")
    model_size: str | None = _opt(None, f"A size from the built-in table: {', '.join(MODEL_SIZES)}.")
    method: str = _opt("grpo", "grpo or sft.")
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
        ("--method", inputs.method, inputs.method in ("grpo", "sft"), "grpo or sft"),
        ("--device", inputs.device, inputs.device in ("gpu", "cpu"), "gpu or cpu"),
        ("--lora-r", inputs.lora_r, inputs.lora_r > 0, "a positive integer"),
        ("--num-gpus", inputs.num_gpus, inputs.num_gpus > 0, "a positive integer"),
        ("--gpu-memory", inputs.gpu_memory, inputs.gpu_memory > 0, "a positive number of GB"),
        ("--per-device-batch", inputs.per_device_batch, inputs.per_device_batch > 0, "a positive integer"),
        ("--num-generations", inputs.num_generations, inputs.num_generations >= 2, "at least 2"),
        ("--max-completion-length", inputs.max_completion_length, inputs.max_completion_length > 0, "positive"),
        ("--max-prompt-length", inputs.max_prompt_length, inputs.max_prompt_length > 0, "positive"),
        ("--max-length", inputs.max_length, inputs.max_length > 0, "positive"),
        ("--beta", inputs.beta, inputs.beta >= 0, ">= 0"),
        ("steps_per_generation", inputs.steps_per_generation, inputs.steps_per_generation > 0, "positive"),
    ]
    for flag, value, ok, valid in checks:
        if not ok:
            raise ConfigError(f"{flag} {value!r} is invalid; it must be {valid}.")


def resolve_shape(inputs: PlanInputs) -> ModelShape:
    validate(inputs)
    return shape_from_folder(inputs.model) if inputs.model else shape_from_size(inputs.model_size)


# ----------------------------------------------------------------------------------------------------------------
# Templates and strategies
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Strategy:
    """How a template splits model states: ``kind`` is single, ddp, deepspeed or fsdp; ``zero_stage`` 0-3
    (fsdp shards like stage 3); offload moves optimizer states (and, stage 3, weights) to CPU RAM."""

    kind: str
    zero_stage: int = 0
    offload_optimizer: bool = False
    offload_params: bool = False

    @property
    def label(self) -> str:
        base = {"single": "single", "ddp": "ddp", "fsdp": "fsdp2"}.get(self.kind, f"zero{self.zero_stage}")
        return base + ("_offload" if self.offload_optimizer or self.offload_params else "")

    @property
    def cost_rank(self) -> float:
        """Order of preference when several fit: less sharding first (less communication), offload last."""
        rank = {"single": 0.0, "ddp": 1.0, "deepspeed": 1.0 + self.zero_stage, "fsdp": 4.5}[self.kind]
        return rank + (10 if self.offload_optimizer or self.offload_params else 0)

    @property
    def shards_weights(self) -> bool:
        return self.kind == "fsdp" or (self.kind == "deepspeed" and self.zero_stage == 3)

    @property
    def shards_gradients(self) -> bool:
        return self.kind == "fsdp" or (self.kind == "deepspeed" and self.zero_stage >= 2)

    @property
    def shards_optimizer(self) -> bool:
        return self.kind == "fsdp" or (self.kind == "deepspeed" and self.zero_stage >= 1)


@dataclass(frozen=True)
class Template:
    """A launch template: its name (the file's stem), its path, and the strategy its YAML asks for."""

    name: str
    path: str
    strategy: Strategy


def _offloads(deepspeed_config: dict, key: str) -> bool:
    return str(deepspeed_config.get(key, "none")).lower() not in ("none", "", "false")


def strategy_of(config: dict) -> Strategy:
    """The strategy an Accelerate config file describes."""
    kind = config.get("distributed_type", "NO")
    kind = "NO" if kind is False else str(kind).upper()  # an unquoted NO is YAML's false
    if kind == "DEEPSPEED":
        ds = config.get("deepspeed_config") or {}
        stage = int(ds.get("zero_stage", 0))
        return Strategy("deepspeed", stage, _offloads(ds, "offload_optimizer_device"),
                        stage == 3 and _offloads(ds, "offload_param_device"))
    if kind == "FSDP":
        offload = bool((config.get("fsdp_config") or {}).get("fsdp_offload_params", False))
        return Strategy("fsdp", 3, offload, offload)
    if kind == "NO" or int(config.get("num_processes", 1) or 1) == 1:
        return Strategy("single")
    return Strategy("ddp")


def load_templates(directory: str | Path | None = None) -> list[Template]:
    """Every ``*.yaml`` template in ``directory`` (default: the shipped accelerate_configs/), so a new template
    shows up in the plan without a change here."""
    import yaml

    folder = Path(directory) if directory else TEMPLATES_DIR
    templates = []
    for path in sorted(folder.glob("*.yaml")):
        with open(path) as f:
            config = yaml.safe_load(f) or {}
        templates.append(Template(path.stem, str(path), strategy_of(config)))
    return templates


# ----------------------------------------------------------------------------------------------------------------
# Bytes: precision, model states, activations, logits, KV cache
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Precision:
    """Bytes per element of each kind of tensor under one strategy and precision.

    single / DDP (Accelerate's native AMP): fp32 weights, fp32 gradients, no separate master; with bf16 the
    forward runs under autocast, which keeps bf16 copies of the weights for backward ("autocast_copies").
    DeepSpeed: bf16 weights and gradients with an fp32 master copy (DeepSpeed keeps the master even in fp32:
    measured, docs/distributed.md). FSDP2: fp32 sharded weights and gradients, bf16 gathered blocks.
    """

    weights: int  # the stored (possibly sharded) weights
    gradients: int
    master: int  # fp32 master weights (DeepSpeed); 0 when the weights are the master
    compute: int  # gathered weights, the KV cache, the reference model
    activations: str  # "fp32", "autocast" (fp32 residual stream, bf16 matmuls) or "bf16"
    logits: int
    autocast_copies: bool


def precision_of(strategy: Strategy, bf16: bool) -> Precision:
    if not bf16:
        return Precision(4, 4, 4 if strategy.kind == "deepspeed" else 0, 4, "fp32", 4, False)
    if strategy.kind == "deepspeed":
        return Precision(2, 2, 4, 2, "bf16", 2, False)
    if strategy.kind == "fsdp":
        return Precision(4, 4, 0, 2, "bf16", 2, False)
    # The lean generation engine keeps its KV cache in the weights' dtype (fp32 here; trainers/engine.py).
    return Precision(4, 4, 0, 4, "autocast", 2, True)


# Activation bytes saved for backward per token per decoder layer, measured by counting the tensors autograd
# saves (torch.autograd.graph.saved_tensors_hooks) in transformers' Qwen2 decoder layer with SDPA attention, for
# several widths, MLP sizes and head counts; each fit is exact to a few bytes:
#   fp32:      4 x (8 h + 2 kv + 4 i) + 5 heads      (32 h + 8 kv + 16 i bytes)
#   autocast:  2 x (15 h + 2 kv + 4 i) + 5 heads     (fp32 residual stream and norms, bf16 matmul inputs)
#   bf16:      2 x (10 h + 2 kv + 4 i) + 5 heads     (bf16 weights: DeepSpeed, FSDP2; norms still upcast)
# h = hidden size, kv = kv_heads x head_dim, i = MLP size; 5 heads = the attention's fp32 log-sum-exp and its
# mask. LoRA saves ~10% less (a frozen matrix needs no saved input); the planner keeps the full figure.
ACTIVATION_COEFFICIENTS = {"fp32": (32, 8, 16), "autocast": (30, 4, 8), "bf16": (20, 4, 8)}
RESIDUAL_BYTES = {"fp32": 4, "autocast": 4, "bf16": 2}  # one hidden-state vector per token (checkpointing)
FINAL_NORM_BYTES_PER_HIDDEN = 12  # the final RMSNorm keeps ~3 fp32 vectors per token outside the layers


def activation_bytes_per_token_per_layer(shape: ModelShape, mode: str) -> int:
    ch, ckv, ci = ACTIVATION_COEFFICIENTS[mode]
    return ch * shape.hidden_size + ckv * shape.kv_dim + ci * shape.intermediate_size + 5 * shape.num_heads


def activation_bytes(shape: ModelShape, tokens: int, mode: str, checkpointing: bool) -> int:
    """Activations of one micro-batch of ``tokens`` tokens (batch x sequence) kept for backward.

    Without checkpointing every layer keeps its activations. With it (transformers' per-layer checkpointing)
    every layer keeps only its input hidden state, and backward recomputes one layer at a time, so one
    layer's full activations exist at once on top."""
    per_layer = activation_bytes_per_token_per_layer(shape, mode)
    final = FINAL_NORM_BYTES_PER_HIDDEN * shape.hidden_size
    if checkpointing:
        return tokens * (shape.num_layers * shape.hidden_size * RESIDUAL_BYTES[mode] + per_layer + final)
    return tokens * (shape.num_layers * per_layer + final)


def logits_bytes(shape: ModelShape, positions: int, logit_bytes: int) -> dict[str, int]:
    """The logits of ``positions`` (batch x scored positions) tokens.

    trainers/losses.py upcasts them to fp32 a few rows at a time, but log-sum-exp saves each fp32 chunk for
    backward, so a full fp32 [batch, length, vocab] copy lives until backward ("logits"); next to it the model's
    own logits in forward, then their gradient in backward, in the logits' dtype ("logits_grad")."""
    n = positions * shape.vocab_size
    return {"logits": 4 * n, "logits_grad": logit_bytes * n}


def kv_cache_bytes(shape: ModelShape, rows: int, length: int, element_bytes: int) -> int:
    """rows x layers x (K and V) x kv_heads x head_dim x (prompt + completion) x bytes."""
    return rows * shape.num_layers * 2 * shape.num_kv_heads * shape.head_size * length * element_bytes


def zero_bucket_elements(shape: ModelShape) -> int:
    """hidden^2 within [1e6, 5e8]: the bucket size trainers/distributed.py's zero_settings derives."""
    return int(min(max(shape.hidden_size ** 2, 1e6), 5e8))


def zero3_live_elements(shape: ModelShape) -> int:
    """Two layers' worth, at least the largest tensor: zero_settings' stage3_max_live_parameters."""
    return int(max(2 * shape.layer_parameters(), shape.largest_parameter(), 1e6))


# Runtime overhead, named:
CUDA_CONTEXT_BYTES = int(1.0 * GB)  # CUDA context, cuBLAS/cuDNN workspaces, NCCL buffers: outside torch's allocator
ALLOCATOR_FRAGMENTATION = 0.10  # of the transient tensors (activations, logits, caches, gathered weights)
CPU_PROCESS_BASELINE_BYTES = int(0.48 * GB)  # measured: Python + torch + transformers + DeepSpeed + gloo loaded

# Calibration (--device cpu) against docs/distributed.md's measured table: 303M parameters, SFT, fp32, 2 processes,
# micro-batch 4 x 128 tokens; GB per rank, planned vs measured peak RSS. Which term explains what:
#   multi_gpu      6.75 vs 6.76  baseline 0.48 + weights 1.13 + gradients 1.13 + DDP's bucket copy 1.13 + Adam 2.26
#                                + activations 0.55 + fragmentation 0.06. Without the bucket copy: 5.62 (-17%).
#   zero1          5.08 vs 5.13  weights and gradients replicated (1.13 each), fp32 master 0.57 + Adam 1.13 halved.
#   zero2          4.67 vs 5.11  gradients halved too (0.57) plus one layer's unreduced gradients (0.14). Measured
#                                zero2 equals zero1: the full gradients' blocks stay resident on CPU (not modelled).
#   zero3          4.42 vs 4.79  every state halved (2.83 = 20 bytes/param / 2) + 2 gathered layers 0.28; the rest
#                                of the measured ~1 GB of allocator and gloo buffers is not modelled (-8%).
#   zero3_offload  4.98 vs 5.37  zero3 + the host-side fp32 gradient buffer 0.57: offload cannot beat zero3 on CPU.
# A single-process SFT run (tests/integration/test_planner_measured.py) lands within 4% of the plan.


# ----------------------------------------------------------------------------------------------------------------
# One template's estimate
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class TemplateEstimate:
    """Peak memory of one process under one template.

    ``breakdown`` holds the components present at the peak (they add up to ``total_bytes``); ``phase`` says
    whether the peak is during training (forward/backward) or GRPO's generation; ``phases`` gives both totals.
    ``host_bytes`` is what offload keeps in CPU RAM per process. A template that cannot run here (multi_gpu on
    one GPU, FSDP on CPU) has ``applicable`` False and a ``note``; it is never recommended."""

    template: str
    strategy: str
    num_processes: int
    breakdown: dict[str, int]
    total_bytes: int
    gpu_memory_bytes: int
    phase: str = "training"
    phases: dict[str, int] = field(default_factory=dict)
    host_bytes: int = 0
    applicable: bool = True
    note: str = ""
    cost_rank: float = 0.0

    @property
    def total_gb(self) -> float:
        return self.total_bytes / GB

    @property
    def fits(self) -> bool:
        return self.applicable and self.total_bytes <= self.gpu_memory_bytes

    @property
    def headroom_gb(self) -> float:
        return (self.gpu_memory_bytes - self.total_bytes) / GB


def model_state_bytes(shape: ModelShape, inputs: PlanInputs, strategy: Strategy, n: int) -> tuple[dict, int]:
    """Weights, gradients, master weights and Adam states this process holds, and the bytes offload moves to CPU.

    Every parameter has weights; only trainable ones (all, or the LoRA adapters) have gradients, a master
    copy and Adam's two fp32 moments (8 bytes). Each stage divides its share by N: ZeRO-1 the master and
    Adam, ZeRO-2 also the gradients, ZeRO-3 / FSDP2 also the weights."""
    p = precision_of(strategy, inputs.uses_bf16)
    total = shape.num_parameters()
    trainable = shape.lora_parameters(inputs.lora_r) if inputs.lora else total
    stored = total + (trainable if inputs.lora else 0)  # LoRA: the frozen base plus the adapters
    weights_n = n if strategy.shards_weights else 1
    gradients_n = n if strategy.shards_gradients else 1
    optimizer_n = n if strategy.shards_optimizer else 1
    states = {
        "weights": stored * p.weights // weights_n,
        "gradients": trainable * p.gradients // gradients_n,
        "master_weights": trainable * p.master // optimizer_n,
        "adam_states": trainable * 8 // optimizer_n,
    }
    if strategy.kind == "ddp":
        # DDP's reducer keeps its own flat gradient buckets beside param.grad (gradient_as_bucket_view=False,
        # Accelerate's default): one more copy of every gradient, on GPUs as on CPU/gloo.
        states["ddp_gradient_buckets"] = trainable * p.gradients
    host = 0
    if strategy.offload_optimizer and not inputs.on_cpu:
        host += states["master_weights"] + states["adam_states"] + states["gradients"]
        states["master_weights"] = states["adam_states"] = states["gradients"] = 0
    if strategy.offload_params and not inputs.on_cpu:
        host += states["weights"]
        states["weights"] = 0
    if strategy.offload_optimizer and inputs.on_cpu:
        # On CPU nothing leaves RSS (host and "device" are the same RAM); offload adds a host-side fp32 gradient
        # buffer beside the partition's gradients: why zero3_offload cannot go below zero3 on CPU (measured).
        states["offload_gradient_buffer"] = trainable * 4 // n
    return states, host


def reference_model_bytes(shape: ModelShape, inputs: PlanInputs, strategy: Strategy, n: int) -> int:
    """GRPO's frozen reference (beta > 0): a bf16 copy (trainers/distributed.py prepare_frozen), partitioned
    under ZeRO-3 (and offloaded with the parameters under zero3_offload). With LoRA the reference is the base
    with adapters disabled: no copy."""
    if inputs.method != "grpo" or inputs.beta <= 0 or inputs.lora:
        return 0
    element = precision_of(strategy, inputs.uses_bf16).compute
    sharded = strategy.kind == "deepspeed" and strategy.zero_stage == 3
    return shape.num_parameters() * element // (n if sharded else 1)


def training_transients(shape: ModelShape, inputs: PlanInputs, strategy: Strategy) -> dict[str, int]:
    """What exists only during forward and backward of one micro-batch."""
    p = precision_of(strategy, inputs.uses_bf16)
    batch = inputs.per_device_batch
    if inputs.method == "grpo":
        length = inputs.max_prompt_length + inputs.max_completion_length
        scored = inputs.max_completion_length  # logits_to_keep: only completion positions are scored
    else:
        length = scored = inputs.max_length
    parts = {"activations": activation_bytes(shape, batch * length, p.activations, inputs.gradient_checkpointing)}
    parts.update(logits_bytes(shape, batch * scored, p.logits))
    if p.autocast_copies:
        # autocast casts every weight to bf16 for its matmul and autograd keeps the copy for backward.
        parts["autocast_weight_copies"] = 2 * (shape.num_parameters() + (shape.lora_parameters(inputs.lora_r)
                                                                          if inputs.lora else 0))
    if strategy.kind == "deepspeed":
        bucket = zero_bucket_elements(shape)
        parts["zero_buckets"] = bucket * p.gradients + (
            int(0.9 * shape.hidden_size ** 2) if strategy.zero_stage == 3 else bucket) * p.compute
    if strategy.shards_weights:
        if strategy.kind == "fsdp":  # two blocks (current + prefetched) and the root module's embeddings
            gathered = 2 * shape.layer_parameters() + shape.embedding_parameters()
        else:
            gathered = zero3_live_elements(shape)
        parts["gathered_layers"] = gathered * p.compute
    if strategy.shards_gradients:
        # Backward produces each layer's full gradients before reduce-scatter hands every rank its shard.
        trainable_layer = (shape.lora_parameters(inputs.lora_r) // shape.num_layers if inputs.lora
                           else max(shape.layer_parameters(), shape.largest_parameter()))
        parts["unreduced_gradients"] = trainable_layer * p.gradients
    return parts


def generation_transients(shape: ModelShape, inputs: PlanInputs, strategy: Strategy) -> dict[str, int]:
    """What exists only while GRPO generates a round of completions."""
    if inputs.method != "grpo":
        return {}
    p = precision_of(strategy, inputs.uses_bf16)
    rows = inputs.per_device_batch * inputs.steps_per_generation  # this process's completions of a round
    length = inputs.max_prompt_length + inputs.max_completion_length
    parts = {"kv_cache": kv_cache_bytes(shape, rows, length, p.compute)}
    if strategy.kind == "deepspeed" and strategy.zero_stage == 3:
        if inputs.ds3_gather_for_generation:  # the default: the full weights on every rank for the whole round
            extra = shape.lora_parameters(inputs.lora_r) if inputs.lora else 0
            parts["gathered_for_generation"] = (shape.num_parameters() + extra) * p.compute
        else:  # layer by layer, as in training
            parts["gathered_layers"] = zero3_live_elements(shape) * p.compute
    if inputs.on_cpu:
        # On CPU the lean engine re-lays the linear weights for oneDNN once per round, in the compute dtype.
        parts["packed_weights_cpu"] = shape.num_parameters() * (2 if inputs.uses_bf16 else 4)
    return parts


def estimate(shape: ModelShape, inputs: PlanInputs, template: Template) -> TemplateEstimate:
    """Peak bytes per process of ``inputs`` under ``template``."""
    strategy = template.strategy
    n = 1 if strategy.kind == "single" else inputs.num_gpus
    static, host = model_state_bytes(shape, inputs, strategy, n)
    reference = reference_model_bytes(shape, inputs, strategy, n)
    if strategy.offload_params and not inputs.on_cpu:
        host += reference
    elif reference:
        static["reference_model"] = reference
    # Within a phase everything is summed, gradients and activations included although backward frees
    # activations as it creates gradients: an upper bound on GPUs (exact with gradient accumulation, where the
    # previous micro-batch's gradients live through the next forward), and what RSS shows on CPU, where glibc
    # keeps freed activation blocks resident (the measured DDP peak, 6.76 GB at 303M, matches the sum).
    # Generation and training never overlap: the KV cache is freed before the training forward.
    phases = {"training": training_transients(shape, inputs, strategy)}
    generation = generation_transients(shape, inputs, strategy)
    if generation:
        phases["generation"] = generation
    totals = {name: sum(parts.values()) for name, parts in phases.items()}
    phase = max(totals, key=totals.get)
    breakdown = {**static, **phases[phase]}
    if inputs.on_cpu:  # the estimate is peak RSS, which includes the loaded libraries
        breakdown["process_baseline"] = CPU_PROCESS_BASELINE_BYTES
    else:
        breakdown["cuda_context"] = CUDA_CONTEXT_BYTES
    breakdown["allocator_fragmentation"] = int(ALLOCATOR_FRAGMENTATION * totals[phase])
    breakdown = {k: int(v) for k, v in breakdown.items() if v}
    overhead = breakdown.get("process_baseline", 0) + breakdown.get("cuda_context", 0)
    base = sum(static.values()) + overhead
    phase_totals = {name: base + t + int(ALLOCATOR_FRAGMENTATION * t) for name, t in totals.items()}
    applicable, note = applicability(strategy, inputs)
    return TemplateEstimate(
        template=template.name, strategy=strategy.label, num_processes=n, breakdown=breakdown,
        total_bytes=sum(breakdown.values()), gpu_memory_bytes=int(inputs.gpu_memory * GB), phase=phase,
        phases=phase_totals, host_bytes=host, applicable=applicable, note=note, cost_rank=strategy.cost_rank)


def applicability(strategy: Strategy, inputs: PlanInputs) -> tuple[bool, str]:
    """Whether a template can be recommended for this set-up, and why not."""
    if strategy.kind == "fsdp" and inputs.on_cpu:
        return False, "GPU only: the trainers refuse FSDP on CPU"
    if strategy.kind == "ddp" and inputs.num_gpus == 1:
        return False, "needs 2+ GPUs"
    if strategy.kind == "single" and inputs.num_gpus > 1:
        return False, f"uses 1 of the {inputs.num_gpus} {'processes' if inputs.on_cpu else 'GPUs'}"
    return True, ""


# ----------------------------------------------------------------------------------------------------------------
# The plan: every template, the recommendation, and what would fit when nothing does
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class Suggestion:
    """One change recomputed: its best template (the cheapest that fits, else the smallest) and its GB."""

    change: str
    template: str | None
    total_gb: float
    fits: bool
    host_gb: float = 0.0  # what offload keeps in CPU RAM per process


@dataclass
class Plan:
    """Estimates for every template, the recommended one (None when nothing fits), its launch commands, and,
    when nothing fits, what each memory saver would give."""

    inputs: PlanInputs
    shape: ModelShape
    estimates: list[TemplateEstimate]
    recommended: str | None
    commands: list[str] = field(default_factory=list)
    suggestions: list[Suggestion] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def estimate_for(self, template: str) -> TemplateEstimate:
        return next(e for e in self.estimates if e.template == template)


def cheapest_fit(estimates: list[TemplateEstimate]) -> TemplateEstimate | None:
    fitting = [e for e in estimates if e.fits]
    return min(fitting, key=lambda e: (e.cost_rank, e.total_bytes)) if fitting else None


def estimate_all(shape: ModelShape, inputs: PlanInputs, templates: list[Template]) -> list[TemplateEstimate]:
    return [estimate(shape, inputs, t) for t in templates]


def best_of(shape: ModelShape, inputs: PlanInputs, templates: list[Template],
            only: set[str] | None = None) -> TemplateEstimate | None:
    """The cheapest fitting estimate, else the smallest applicable one (restricted to strategy kinds ``only``)."""
    estimates = [e for e in estimate_all(shape, inputs, templates) if e.applicable]
    if only is not None:
        estimates = [e for e in estimates if e.strategy in only]
    if not estimates:
        return None
    return cheapest_fit(estimates) or min(estimates, key=lambda e: e.total_bytes)


def suggestions(shape: ModelShape, inputs: PlanInputs, templates: list[Template]) -> list[Suggestion]:
    """Recompute with each memory saver not already in use, then with all of them together."""
    changes: list[tuple[str, dict, set[str] | None]] = []
    if not inputs.lora:
        changes.append((f"LoRA (rank {inputs.lora_r})", {"lora": True}, None))
    if not inputs.gradient_checkpointing:
        changes.append(("gradient checkpointing", {"gradient_checkpointing": True}, None))
    batch = inputs.per_device_batch // 2
    while batch >= 1:
        changes.append((f"per-device batch {batch}", {"per_device_batch": batch}, None))
        batch //= 2
    offload = {t.strategy.label for t in templates if t.strategy.offload_optimizer or t.strategy.offload_params}
    if offload:
        changes.append(("offload (" + ", ".join(sorted(offload)) + ")", {}, offload))
    everything = {"lora": True, "gradient_checkpointing": True, "per_device_batch": 1}
    together = "LoRA + gradient checkpointing + per-device batch 1"
    if inputs.method == "grpo" and inputs.ds3_gather_for_generation:
        changes.append(("ds3_gather_for_generation=False (ZeRO-3 generates layer by layer: slow)",
                        {"ds3_gather_for_generation": False}, None))
        everything["ds3_gather_for_generation"] = False
        together += " + ds3_gather_for_generation=False"
    changes.append((f"all of {together}", everything, None))
    out = []
    for change, fields, only in changes:
        best = best_of(shape, dataclasses.replace(inputs, **fields), templates, only)
        if best is not None:
            out.append(Suggestion(change, best.template, round(best.total_gb, 2), best.fits,
                                  round(best.host_bytes / GB, 2)))
    return out


def trainer_flags(inputs: PlanInputs) -> list[str]:
    """The config flags that reproduce the planned set-up (same names for examples/*.py and `trainers`)."""
    flags = ["--per_device_train_batch_size", str(inputs.per_device_batch)]
    if inputs.method == "grpo":
        flags += ["--num_generations", str(inputs.num_generations),
                  "--max_completion_length", str(inputs.max_completion_length)]
        if inputs.beta:
            flags += ["--beta", str(inputs.beta)]
        if not inputs.ds3_gather_for_generation:
            flags += ["--ds3_gather_for_generation", "false"]
    else:
        flags += ["--max_length", str(inputs.max_length)]
    if inputs.gradient_checkpointing:
        flags += ["--gradient_checkpointing", "true"]
    flags += ["--bf16", "true" if inputs.uses_bf16 else "false"]
    if inputs.on_cpu:
        flags += ["--use_cpu", "true"]
    if inputs.lora:
        flags += ["--lora_r", str(inputs.lora_r)]
    return flags


def launch_commands(inputs: PlanInputs, template: Template, num_processes: int) -> list[str]:
    """``accelerate launch`` of the example script, and the same run through ``trainers``."""
    shipped = Path(template.path).resolve().parent == TEMPLATES_DIR.resolve()
    config = f"accelerate_configs/{template.name}.yaml" if shipped else template.path
    processes = [] if template.strategy.kind == "single" else ["--num_processes", str(num_processes)]
    model = inputs.model or "PATH"
    flags = trainer_flags(inputs)
    accelerate = ["accelerate", "launch", "--config_file", config, *processes, f"examples/{inputs.method}.py",
                  "--model", model, *flags]
    trainers = ["trainers", inputs.method, "--config", f"{inputs.method}.yaml", "--model", model,
                "--accelerate_config", template.name if shipped else template.path, *processes, *flags]
    return [" ".join(accelerate), " ".join(trainers)]


def plan_notes(inputs: PlanInputs) -> list[str]:
    notes = []
    if inputs.method == "grpo":
        generation_batch = inputs.per_device_batch * inputs.num_gpus * inputs.steps_per_generation
        if generation_batch % inputs.num_generations:
            notes.append(f"per_device_batch x num_gpus x steps_per_generation = {generation_batch} is not a multiple "
                         f"of num_generations = {inputs.num_generations}: the GRPO trainer will refuse it.")
    if inputs.on_cpu:
        notes.append("--device cpu: peak RSS per process of a CPU run (gloo), including the process baseline.")
    return notes


def make_plan(inputs: PlanInputs, templates: list[Template] | None = None) -> Plan:
    """Estimate every template for ``inputs`` and pick the cheapest that fits."""
    shape = resolve_shape(inputs)
    templates = templates if templates is not None else load_templates()
    estimates = sorted(estimate_all(shape, inputs, templates), key=lambda e: (e.cost_rank, e.template))
    best = cheapest_fit(estimates)
    result = Plan(inputs, shape, estimates, best.template if best else None, notes=plan_notes(inputs))
    if best:
        template = next(t for t in templates if t.name == best.template)
        result.commands = launch_commands(inputs, template, best.num_processes)
    else:
        result.suggestions = suggestions(shape, inputs, templates)
    return result


# ----------------------------------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------------------------------


def describe(plan: Plan) -> str:
    i, s = plan.inputs, plan.shape
    what = (f"{i.method.upper()}, {s.name} ({s.num_parameters() / 1e9:.2f}B parameters), "
            + (f"LoRA rank {i.lora_r}" if i.lora else "full fine-tuning"))
    unit = "processes (CPU)" if i.on_cpu else f"x {i.gpu_memory:g} GB GPUs"
    lengths = (f"prompt {i.max_prompt_length} + completion {i.max_completion_length} tokens, "
               f"{i.num_generations} generations, beta {i.beta:g}" if i.method == "grpo"
               else f"max_length {i.max_length}")
    return (f"{what}; {i.num_gpus} {unit}; {'bf16' if i.uses_bf16 else 'fp32'}; per-device batch "
            f"{i.per_device_batch}; {lengths}; gradient checkpointing {'on' if i.gradient_checkpointing else 'off'}")


def format_table(plan: Plan) -> str:
    """A text table (template, GB per GPU, fits, headroom), the recommendation with its commands, and, when
    nothing fits, what would."""
    per = "GB per process" if plan.inputs.on_cpu else "GB per GPU"
    rows = [("template", "strategy", "processes", per, "fits", "headroom GB", "peak during")]
    for e in plan.estimates:
        fits = "yes" if e.fits else ("n/a" if not e.applicable else "no")
        rows.append((e.template, e.strategy, str(e.num_processes), f"{e.total_gb:.2f}", fits, f"{e.headroom_gb:.2f}",
                     e.phase + (f" ({e.note})" if e.note else "")))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = [describe(plan), ""]
    for index, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(w) if c in (0, 1, 4, 6) else cell.rjust(w)
                               for c, (cell, w) in enumerate(zip(row, widths))).rstrip())
        if index == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines.append("")
    if plan.recommended:
        e = plan.estimate_for(plan.recommended)
        lines.append(f"Recommended: {e.template} ({e.total_gb:.2f} {per}, {e.headroom_gb:.2f} GB headroom of "
                     f"{plan.inputs.gpu_memory:g}). At its peak ({e.phase}):")
        for name, value in sorted(e.breakdown.items(), key=lambda kv: -kv[1]):
            lines.append(f"  {name:<26} {value / GB:8.2f} GB")
        if e.host_bytes:
            lines.append(f"  offloaded to CPU RAM: {e.host_bytes / GB:.2f} GB per process, "
                         f"{e.host_bytes * e.num_processes / GB:.1f} GB per node")
        lines.append("Launch:")
        lines += [f"  {command}" for command in plan.commands]
    else:
        lines.append(f"Nothing fits in {plan.inputs.gpu_memory:g} GB. Recomputed with each memory saver:")
        for s in plan.suggestions:
            verdict = "fits        " if s.fits else "does not fit"
            host = f" (+{s.host_gb:.1f} GB CPU RAM per process)" if s.host_gb else ""
            lines.append(f"  {verdict} {s.total_gb:9.2f} GB  {s.template or '-':<14} {s.change}{host}")
    lines += [f"Note: {note}" for note in plan.notes]
    return "\n".join(lines)


def plan_to_json(plan: Plan) -> dict:
    """The plan as JSON-ready data: ``recommended`` (a template name or None), per-template breakdowns in bytes,
    totals in GB, the commands and the suggestions."""
    return {
        "inputs": {**dataclasses.asdict(plan.inputs), "bf16": plan.inputs.uses_bf16},
        "model": {**dataclasses.asdict(plan.shape), "num_parameters": plan.shape.num_parameters()},
        "recommended": plan.recommended,
        "templates": [
            {"template": e.template, "strategy": e.strategy, "num_processes": e.num_processes,
             "total_gb": round(e.total_gb, 3), "fits": e.fits, "headroom_gb": round(e.headroom_gb, 3),
             "applicable": e.applicable, "note": e.note, "peak_phase": e.phase,
             "phases_gb": {k: round(v / GB, 3) for k, v in e.phases.items()},
             "host_gb": round(e.host_bytes / GB, 3), "breakdown": dict(e.breakdown)}
            for e in plan.estimates
        ],
        "commands": list(plan.commands),
        "suggestions": [dataclasses.asdict(s) for s in plan.suggestions],
        "notes": list(plan.notes),
    }


# ----------------------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------------------


def _help(name: str) -> str:
    f = next(f for f in dataclasses.fields(PlanInputs) if f.name == name)
    return f"{f.metadata['help']} (default: {f.default})".replace("%", "%%")


def _model_size(text: str) -> str:
    try:
        shape_from_size(text)
    except ConfigError as error:
        raise argparse.ArgumentTypeError(str(error).replace(f"--model-size {text!r} is", f"{text!r} is")) from None
    return text.strip().upper()


def _model_path(text: str) -> str:
    if not os.path.isfile(os.path.join(text, "config.json")):
        raise argparse.ArgumentTypeError(f"{text!r} is not a model folder with a config.json")
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``trainers plan`` flags."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", metavar="PATH", type=_model_path, help=_help("model"))
    source.add_argument("--model-size", type=_model_size, metavar="SIZE", help=_help("model_size"))
    parser.add_argument("--method", choices=["grpo", "sft"], default="grpo", help=_help("method"))
    parser.add_argument("--lora", action="store_true", help=_help("lora"))
    parser.add_argument("--lora-r", type=int, default=16, help=_help("lora_r"))
    parser.add_argument("--num-gpus", type=int, default=1, help=_help("num_gpus"))
    parser.add_argument("--gpu-memory", type=float, default=80.0, metavar="GB", help=_help("gpu_memory"))
    parser.add_argument("--per-device-batch", type=int, default=8, help=_help("per_device_batch"))
    parser.add_argument("--num-generations", type=int, default=8, help=_help("num_generations"))
    parser.add_argument("--max-completion-length", type=int, default=512, help=_help("max_completion_length"))
    parser.add_argument("--max-prompt-length", type=int, default=512, help=_help("max_prompt_length"))
    parser.add_argument("--max-length", type=int, default=1024, help=_help("max_length"))
    parser.add_argument("--gradient-checkpointing", action="store_true", help=_help("gradient_checkpointing"))
    parser.add_argument("--beta", type=float, default=0.0, help=_help("beta"))
    precision = parser.add_mutually_exclusive_group()
    precision.add_argument("--bf16", dest="bf16", action="store_true", default=None,
                           help="bf16 mixed precision (default: on for GPUs, off with --device cpu).")
    precision.add_argument("--no-bf16", dest="bf16", action="store_false",
                           help="fp32 training (default: off for GPUs, on with --device cpu).")
    parser.add_argument("--json", action="store_true", help="Print the plan as JSON (default: a table).")
    parser.add_argument("--device", choices=["gpu", "cpu"], default="gpu", help=_help("device"))


def inputs_from_args(args: argparse.Namespace) -> PlanInputs:
    """PlanInputs from parsed ``trainers plan`` flags (validated: a bad value raises ConfigError naming its flag)."""
    names = {f.name for f in dataclasses.fields(PlanInputs)}
    inputs = PlanInputs(**{k: v for k, v in vars(args).items() if k in names})
    validate(inputs)
    return inputs


def run(args: argparse.Namespace) -> int:
    """``trainers plan``: print the table (or JSON). Returns 0; bad input raises ConfigError naming the flag."""
    plan = make_plan(inputs_from_args(args))
    print(json.dumps(plan_to_json(plan), indent=1) if args.json else format_table(plan))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="trainers plan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except ConfigError as error:
        print(f"trainers plan: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
