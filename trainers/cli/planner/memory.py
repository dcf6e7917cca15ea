"""Peak memory per process under one Accelerate template: the template's strategy (ZeRO stage, FSDP, offload), the
bytes of each kind of tensor, and one template's estimate with its named breakdown."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from trainers.cli.planner.shapes import GB, SAMPLING, ModelShape, PlanInputs, teacher_shape
from trainers.cli.templates import shipped_templates
from trainers.model.output_head import chunk_positions, kept_positions

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


def load_templates(directory: str | os.PathLike | None = None) -> list[Template]:
    """Every ``*.yaml`` template in ``directory`` (default: the shipped ones, trainers/templates/), so a new
    template shows up in the plan without a change here. A folder with none raises TemplatesNotFoundError."""
    import yaml

    templates = []
    for name, path in shipped_templates(directory).items():
        with open(path) as f:
            config = yaml.safe_load(f) or {}
        templates.append(Template(name, str(path), strategy_of(config)))
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
    # The lean generation engine keeps its KV cache in the weights' dtype (fp32 here; trainers/generation/engine.py).
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
    """The output head of ``positions`` (batch x scored positions) tokens, computed by the chunked head
    (trainers/model/output_head.py), which never holds [positions, vocab] logits: one chunk's logits in the logits'
    dtype and a float32 scratch of the same size in forward, two float32 chunks in backward ("logits"); the
    log-probabilities of the first chunks, up to SAVED_BYTES, kept from forward to backward ("logits_kept");
    and the float32 sum of the head's weight gradient, [vocab, hidden] ("head_gradient_sum")."""
    vocab = shape.vocab_size
    chunk = chunk_positions(vocab)
    return {"logits": min(positions, chunk) * vocab * max(logit_bytes + 4, 2 * 4),
            "logits_kept": kept_positions(positions, vocab, chunk) * vocab * 4,
            "head_gradient_sum": vocab * shape.hidden_size * 4}


def kv_cache_bytes(shape: ModelShape, rows: int, length: int, element_bytes: int) -> int:
    """rows x layers x (K and V) x kv_heads x head_dim x (prompt + completion) x bytes."""
    return rows * shape.num_layers * 2 * shape.num_kv_heads * shape.head_size * length * element_bytes


def zero_bucket_elements(shape: ModelShape) -> int:
    """hidden^2 within [1e6, 5e8]: the bucket size trainers/parallel/distributed.py's zero_settings derives."""
    return int(min(max(shape.hidden_size ** 2, 1e6), 5e8))


def zero3_live_elements(shape: ModelShape) -> int:
    """Two layers' worth, at least the largest tensor: zero_settings' stage3_max_live_parameters."""
    return int(max(2 * shape.layer_parameters(), shape.largest_parameter(), 1e6))


# Runtime overhead, named:
CUDA_CONTEXT_BYTES = int(1.0 * GB)  # CUDA context, cuBLAS/cuDNN workspaces, NCCL buffers: outside torch's allocator
ALLOCATOR_FRAGMENTATION = 0.10  # of the transient tensors (activations, logits, caches, gathered weights)
# Measured as the peak RSS of a whole SFT run of a width-64 model (its tensors weigh nothing): Python, torch,
# transformers, gloo, the tokenizer and the trainer around it; DeepSpeed's engine adds its own on top.
CPU_PROCESS_BASELINE_BYTES = int(0.56 * GB)
DEEPSPEED_CPU_RUNTIME_BYTES = int(0.05 * GB)

# Calibration (--device cpu) against docs/distributed.md's measured table: 303M parameters, SFT, fp32, 2 processes,
# micro-batch 4 x 128 tokens; GB per rank, planned vs measured peak RSS. Which term explains what:
#   multi_gpu      6.83 vs 6.76  baseline 0.56 + weights 1.13 + gradients 1.13 + DDP's bucket copy 1.13 + Adam 2.26
#                                + activations 0.55 + fragmentation 0.06. Without the bucket copy: 5.70 (-16%).
#   zero1          5.22 vs 5.13  weights and gradients replicated (1.13 each), fp32 master 0.57 + Adam 1.13 halved,
#                                + DeepSpeed's runtime 0.05.
#   zero2          4.80 vs 5.11  gradients halved too (0.57) plus one layer's unreduced gradients (0.14). Measured
#                                zero2 equals zero1: the full gradients' blocks stay resident on CPU (not modelled).
#   zero3          4.55 vs 4.79  every state halved (2.83 = 20 bytes/param / 2) + 2 gathered layers 0.28; heap
#                                blocks ZeRO-3 frees and re-gathers each step stay resident (not modelled: -5%).
#   zero3_offload  5.11 vs 5.37  zero3 + the host-side fp32 gradient buffer 0.57: offload cannot beat zero3 on CPU.
# Smaller models (tests/integration/test_planner_measured.py; width 512/768/1024, 4/8/12 layers, measured
# 2026-11-27): single process 1.91 vs 1.83 (width 768); multi_gpu 0.97-1.01 of measured, zero2 0.93-0.96, zero3
# 0.84-0.89: the blocks ZeRO-3 keeps in the heap weigh more where every tensor is under the 8 MiB mmap threshold.


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
    """The frozen reference of GRPO (beta > 0), DPO and KTO, or distillation's teacher: a bf16 copy
    (trainers/parallel/distributed.py prepare_frozen), partitioned under ZeRO-3 (and offloaded with the parameters under
    zero3_offload). With LoRA the reference is the base with adapters disabled: no copy (a teacher is its own
    model whatever the student trains)."""
    if inputs.method == "distill":
        frozen = teacher_shape(inputs, shape)
    elif inputs.method in ("dpo", "kto") or (inputs.method in SAMPLING and inputs.beta > 0):
        frozen = None if inputs.lora else shape
    else:
        frozen = None
    if frozen is None:
        return 0
    element = precision_of(strategy, inputs.uses_bf16).compute
    sharded = strategy.kind == "deepspeed" and strategy.zero_stage == 3
    return frozen.num_parameters() * element // (n if sharded else 1)


def training_transients(shape: ModelShape, inputs: PlanInputs, strategy: Strategy) -> dict[str, int]:
    """What exists only during forward and backward of one micro-batch."""
    p = precision_of(strategy, inputs.uses_bf16)
    batch = inputs.per_device_batch
    if inputs.method in SAMPLING:
        tokens = batch * (inputs.max_prompt_length + inputs.max_completion_length)
        scored = batch * inputs.max_completion_length  # logits_to_keep: only completion positions are scored
        if inputs.token_budget is not None:  # a micro-batch holds at most that many tokens, however many rows
            tokens = scored = inputs.token_budget
    else:  # sft; dpo and reward: chosen and rejected in one forward; kto: the rows (the KL pairs: no gradient)
        sequences = 2 * batch if inputs.method in ("dpo", "reward") else batch
        tokens = scored = sequences * inputs.max_length
    parts = {"activations": activation_bytes(shape, tokens, p.activations, inputs.gradient_checkpointing)}
    if inputs.method != "reward":  # a reward model's head is one score, not the vocabulary
        parts.update(logits_bytes(shape, scored, p.logits))
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
    if inputs.method == "distill" and strategy.kind == "deepspeed" and strategy.zero_stage == 3:
        # the teacher's head, gathered and copied for the micro-batch (trainers/distillation/teacher.py)
        teacher = teacher_shape(inputs, shape)
        parts["teacher_head_copy"] = teacher.vocab_size * teacher.hidden_size * p.compute
    if strategy.shards_gradients:
        # Backward produces each layer's full gradients before reduce-scatter hands every rank its shard.
        trainable_layer = (shape.lora_parameters(inputs.lora_r) // shape.num_layers if inputs.lora
                           else max(shape.layer_parameters(), shape.largest_parameter()))
        parts["unreduced_gradients"] = trainable_layer * p.gradients
    return parts


def generation_transients(shape: ModelShape, inputs: PlanInputs, strategy: Strategy) -> dict[str, int]:
    """What exists only while GRPO generates a round of completions."""
    if inputs.method not in SAMPLING:
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
        static["teacher_model" if inputs.method == "distill" else "reference_model"] = reference
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
        if strategy.kind == "deepspeed":
            breakdown["deepspeed_runtime"] = DEEPSPEED_CPU_RUNTIME_BYTES
    else:
        breakdown["cuda_context"] = CUDA_CONTEXT_BYTES
    breakdown["allocator_fragmentation"] = int(ALLOCATOR_FRAGMENTATION * totals[phase])
    breakdown = {k: int(v) for k, v in breakdown.items() if v}
    overhead = sum(breakdown.get(name, 0) for name in ("process_baseline", "deepspeed_runtime", "cuda_context"))
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
    if strategy.kind == "fsdp" and inputs.method in SAMPLING:
        return False, "not yet for the trainers that sample (GRPO, RLOO, distillation): use zero3"
    if strategy.kind == "ddp" and inputs.num_gpus == 1:
        return False, "needs 2+ GPUs"
    if strategy.kind == "single" and inputs.num_gpus > 1:
        return False, f"uses 1 of the {inputs.num_gpus} {'processes' if inputs.on_cpu else 'GPUs'}"
    return True, ""
