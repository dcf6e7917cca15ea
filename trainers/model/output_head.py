"""The output head without full-vocabulary logits: per-position log p(target), entropy and argmax hit, computed
from the body's hidden states and the head's weight a chunk of positions at a time.

A causal LM's head turns [B, T, H] hidden states into [B, T, V] logits. At a real vocabulary (Qwen2.5: V =
151,936) those logits, their float32 copy and, in backward, their gradient dominate a step's memory, while
training needs only a few numbers per position. ``ChunkedHead`` computes those numbers from [c, V] logits of c
positions at a time and keeps at most SAVED_BYTES of their log-probabilities: backward recomputes the other
chunks' logits and turns each into its gradient in place. So no [tokens, V] tensor larger than one chunk (or
than the kept block) exists, forward or backward.

The model's own forward still runs (through DDP or DeepSpeed, with its MoE router loss and PEFT's virtual
tokens): ``scoring_head`` swaps the head module's ``forward`` for one call, so the "logits" the model returns are
the scores, [B, K, 3] float32 (log-prob, entropy, argmax hit). Under ZeRO-3 DeepSpeed gathers the head's weight
for that module call as for any other: once per forward and once per backward, not per chunk.

Heads it takes: a linear head (tied to the embeddings or not, with or without bias, cast to float32 by
``cast_lm_head_to_fp32``), PEFT's copy of one (``modules_to_save``), and a LoRA-adapted one (its low-rank path is
added per chunk; not under ZeRO-3, whose gather hooks sit on the base layer). ``plan_head`` says None for
anything else (a model that scales or soft-caps its logits after the head, PEFT's trainable-token head, a DoRA
adapter, a head a user's forward hook watches, ...), and the caller computes full logits as before.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass

import torch

# Positions per chunk are chosen so a chunk's float32 logits take about this many bytes (backward holds about two
# such buffers). 64 MiB: ~110 positions at a 151,936-token vocabulary, 2,048 at 8,192.
CHUNK_BYTES = 64 * 2**20
MAX_CHUNK_POSITIONS = 4096
# Chunks whose log-probabilities fit in this many bytes in all are kept for backward instead of recomputed: the
# recomputation is a fourth product of the head (on CPU +30% of the head's time), worth it only where the logits
# are large. 128 MiB keeps every chunk at small vocabularies (8,192 x 4,096 positions) and ~220 positions at
# 151,936.
SAVED_BYTES = 128 * 2**20

# Config fields of models that transform the logits after the head (Gemma's soft-capping, Cohere's and Granite's
# scales, ...): the scores the head returns would be transformed too, so such models keep full logits.
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier",
                    "logits_scaling")


# On a GPU the chunks are larger (fewer, larger products keep its tensor cores busy): 1/GPU_CHUNK_FRACTION of its
# memory, between CHUNK_BYTES and GPU_CHUNK_BYTES. Its total memory, not its free memory: a run and its resume then
# choose the same chunks, so the float sums of a weight's gradient add up in the same order.
GPU_CHUNK_FRACTION = 128
GPU_CHUNK_BYTES = 512 * 2**20


def chunk_positions(vocab: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    return max(1, min(MAX_CHUNK_POSITIONS, chunk_bytes // (4 * vocab)))


def chunk_bytes_for(device_type: str, total_memory: int | None = None) -> int:
    """Bytes of float32 logits per chunk on this kind of device: CHUNK_BYTES on CPU (cache-sized), on a GPU a
    share of its ``total_memory`` (read from the device when not given)."""
    if device_type != "cuda":
        return CHUNK_BYTES
    if total_memory is None:
        total_memory = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return max(CHUNK_BYTES, min(GPU_CHUNK_BYTES, total_memory // GPU_CHUNK_FRACTION))


_OUT_DTYPE_WORKS: dict[torch.dtype, bool] = {}  # set when a GPU's addmm(out_dtype=float32) first ran or failed


def low_precision_weight_grad(device_type: str, dtype: torch.dtype) -> bool:
    """Whether the head's weight gradient is computed in the model's dtype (bf16/fp16 products on a GPU's tensor
    cores, accumulated and written in float32: ``torch.addmm(..., out_dtype=torch.float32)``) rather than as a
    float32 product. Float32 on CPU (no such kernel; AVX float32 is as fast as bf16 there without AMX) and for a
    float32 model."""
    return device_type == "cuda" and dtype in (torch.float16, torch.bfloat16) and _OUT_DTYPE_WORKS.get(dtype, True)


def add_weight_grad(out: torch.Tensor, grad: torch.Tensor, hidden: torch.Tensor, dtype: torch.dtype) -> None:
    """out [V, H] float32 += grad.T [V, c] @ hidden [c, H]: in ``dtype`` with float32 accumulation where
    ``low_precision_weight_grad`` says so (a fallback to float32, said once, if this torch's GPU kernel refuses),
    else in float32. Each chunk's share is added in float32 either way: rounding it to bf16 would lose the small
    shares of a long sum."""
    if low_precision_weight_grad(out.device.type, dtype):
        try:
            torch.addmm(out, grad.t().to(dtype), hidden.to(dtype), out_dtype=torch.float32, out=out)
            if dtype not in _OUT_DTYPE_WORKS:
                _OUT_DTYPE_WORKS[dtype] = True
                print(f"[trainers] output head: the weight gradient in {dtype} with float32 accumulation",
                      file=sys.stderr)
            return
        except (RuntimeError, TypeError) as error:
            _OUT_DTYPE_WORKS[dtype] = False
            print(f"[trainers] output head: the weight gradient in float32 (torch.addmm with out_dtype=float32 "
                  f"failed for {dtype}: {error})", file=sys.stderr)
    out.addmm_(grad.t(), hidden.float())


def kept_positions(positions: int, vocab: int, chunk: int, saved_bytes: int = SAVED_BYTES) -> int:
    """How many of ``positions`` have their log-probabilities kept for backward: whole chunks, from the first,
    up to ``saved_bytes`` of float32 [kept, vocab]."""
    return min(positions, saved_bytes // (4 * vocab) // chunk * chunk)


class ChunkedHead(torch.autograd.Function):
    """(hidden [N, H], weight [V, H], bias [V] | None, low_in [N, r] | None, low_weight [V, r] | None, targets [N])
    -> (log p(target) [N], entropy [N]) float32, where the logits are (hidden @ weight.T + bias + low_in @
    low_weight.T) / temperature, computed ``chunk`` positions at a time in ``dtype`` and upcast to float32. The
    low-rank pair is a LoRA adapter on the head (low_in = scaling x lora_A(dropout(hidden))). The entropy is
    computed only ``with_entropy`` (else 0) and has a gradient only with ``entropy_grad``; whether the target is
    the largest logit goes to ``hits`` [N] (it has no gradient).

    Each chunk's logits live in one reused buffer and are turned into probabilities, then gradients, in place;
    the log-sum-exp is max + log(sum(exp(z - max))), as torch.logsumexp is ~3x slower than that on CPU."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, low_in, low_weight, targets, temperature: float, chunk: int,
                dtype: torch.dtype, with_entropy: bool, entropy_grad: bool, hits: torch.Tensor, saved_bytes: int):
        ctx.set_materialize_grads(False)
        N = hidden.shape[0]
        logps = torch.empty(N, device=hidden.device, dtype=torch.float32)
        entropy = torch.zeros_like(logps)
        lse = torch.empty_like(logps)
        head = _Head(weight, bias, low_weight, dtype, temperature, min(chunk, N))
        # the first chunks' log-probabilities, up to saved_bytes, kept for backward: [kept, V], whole chunks
        kept_rows = kept_positions(N, weight.shape[0], chunk, saved_bytes) if any(ctx.needs_input_grad[:5]) else 0
        kept = torch.empty((kept_rows, weight.shape[0]), device=hidden.device, dtype=torch.float32)
        scratch = torch.empty((min(chunk, N), weight.shape[0]), device=hidden.device) \
            if with_entropy or kept_rows else None  # exp(z - max) where z - max is kept
        for start in range(0, N, chunk):
            rows = slice(start, start + chunk)
            z = head.logits(hidden[rows], None if low_in is None else low_in[rows],
                            out=kept[rows] if start < kept_rows else None)  # [c, V] float32
            target = z.gather(1, targets[rows].unsqueeze(1)).squeeze(1)  # [c]
            top = z.amax(-1, keepdim=True)  # [c, 1]
            hits[rows] = target >= top.squeeze(1)
            shifted = z.sub_(top)  # z - max, in place
            if with_entropy or start < kept_rows:  # e = exp(z - max), s = sum_v e_v
                e = torch.exp(shifted, out=scratch[: z.shape[0]])
                total = e.sum(-1)
                if with_entropy:  # H = log s - sum_v e_v (z_v - max) / s
                    entropy[rows] = total.log() - e.mul_(shifted).sum(-1) / total
            else:
                total = shifted.exp_().sum(-1)
            lse[rows] = top.squeeze(1) + total.log()
            logps[rows] = target - lse[rows]
            if start < kept_rows:
                shifted.sub_(total.log().unsqueeze(1))  # log p, in kept
        ctx.kept = kept
        ctx.save_for_backward(hidden, weight, bias, low_in, low_weight, targets, lse, entropy)
        ctx.temperature, ctx.chunk, ctx.dtype = temperature, chunk, dtype
        ctx.entropy_grad = with_entropy and entropy_grad
        if not ctx.entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logps, entropy

    @staticmethod
    def backward(ctx, grad_logps, grad_entropy):
        hidden, weight, bias, low_in, low_weight, targets, lse, entropy = ctx.saved_tensors
        grad_entropy = grad_entropy if ctx.entropy_grad else None
        need = ctx.needs_input_grad
        # float32 sums whatever the weights' dtype: rounding each chunk's share of a weight's gradient would bias it
        grads = [torch.zeros(x.shape, device=x.device, dtype=torch.float32) if x is not None and need[i] else None
                 for i, x in enumerate((hidden, weight, bias, low_in, low_weight))]
        grad_hidden, grad_weight, grad_bias, grad_low_in, grad_low_weight = grads
        N = hidden.shape[0] if grad_logps is not None or grad_entropy is not None else 0
        head = _Head(weight, bias, low_weight, ctx.dtype, ctx.temperature, min(ctx.chunk, max(N, 1)))
        kept, ctx.kept = ctx.kept, None
        for start in range(0, N, ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            low = None if low_in is None else low_in[rows]
            if start < kept.shape[0]:
                log_p = kept[rows]  # [c, V], overwritten in place below (backward runs once)
            else:
                log_p = head.logits(hidden[rows], low).sub_(lse[rows].unsqueeze(1))  # [c, V]
            # d/dz of (g_logp log p_target + g_ent H) = g_logp (onehot - p) - g_ent p (log p + H)
            if grad_entropy is not None:
                p = log_p.exp()
                grad = log_p.add_(entropy[rows].unsqueeze(1)).mul_(p).mul_(-grad_entropy[rows].unsqueeze(1))
                if grad_logps is not None:
                    grad.sub_(p.mul_(grad_logps[rows].unsqueeze(1)))
                del p
            else:
                grad = log_p.exp_().mul_(-grad_logps[rows].unsqueeze(1))
            if grad_logps is not None:
                grad.scatter_add_(1, targets[rows].unsqueeze(1), grad_logps[rows].unsqueeze(1))
            if ctx.temperature != 1.0:
                grad.div_(ctx.temperature)  # [c, V]: the gradient of the logits before the temperature
            if grad_hidden is not None:  # one chunk holds all of a position's gradient: no sum across chunks
                grad_hidden[rows] = (grad.to(head.dtype) @ head.weight).float()
            if grad_weight is not None:
                add_weight_grad(grad_weight, grad, hidden[rows], head.dtype)
            if grad_bias is not None:
                grad_bias.add_(grad.sum(0))
            if grad_low_in is not None:
                grad_low_in[rows] = grad @ low_weight.float()
            if grad_low_weight is not None:
                grad_low_weight.addmm_(grad.t(), low.float())
        return (*(None if g is None else g.to(x.dtype)
                  for g, x in zip(grads, (hidden, weight, bias, low_in, low_weight))), *([None] * 8))


class _Head:
    """The head's weights in the product's dtype (cast once per pass, not per chunk), and one buffer that each
    chunk's logits are written to (made on first use: a pass whose chunks are all kept needs none)."""

    def __init__(self, weight, bias, low_weight, dtype: torch.dtype, temperature: float, rows: int):
        self.dtype, self.temperature, self.rows = dtype, temperature, rows
        self.weight = weight.to(dtype)
        self.bias = None if bias is None else bias.to(dtype)
        self.low_weight = None if low_weight is None else low_weight.to(dtype)
        self.buffer: torch.Tensor | None = None

    def logits(self, hidden: torch.Tensor, low_in: torch.Tensor | None, out: torch.Tensor | None = None
               ) -> torch.Tensor:
        """[c, H] (and [c, r]) -> [c, V] float32 logits over the temperature: the product in the model's (or
        autocast's) dtype, then float32, as the model's own head followed by an upcast gives them. The result is
        ``out`` (float32, [c, V]) or, in float32 without it, the shared buffer the next chunk overwrites."""
        if out is not None and self.dtype != torch.float32:
            return out.copy_(self.logits(hidden, low_in))
        if out is None and self.buffer is None:
            self.buffer = torch.empty((self.rows, self.weight.shape[0]), device=self.weight.device, dtype=self.dtype)
        z = self.buffer[: hidden.shape[0]] if out is None else out
        if self.bias is None:
            torch.mm(hidden.to(self.dtype), self.weight.t(), out=z)
        else:
            torch.addmm(self.bias, hidden.to(self.dtype), self.weight.t(), out=z)
        if low_in is not None:
            z.addmm_(low_in.to(self.dtype), self.low_weight.t())
        z = z.float()
        return z.div_(self.temperature) if self.temperature != 1.0 else z


def chunked_head_scores(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                        bias: torch.Tensor | None = None, low_rank: tuple[torch.Tensor, torch.Tensor] | None = None,
                        temperature: float = 1.0, with_entropy: bool = True, entropy_grad: bool = False,
                        dtype: torch.dtype | None = None, chunk: int | None = None,
                        saved_bytes: int = SAVED_BYTES) -> dict[str, torch.Tensor]:
    """Per-position scores of the head ``weight`` [V, H] (``bias`` [V]; ``low_rank`` = (low_in [N, r],
    low_weight [V, r]) adds low_in @ low_weight.T) over ``hidden`` [N, H] for ``targets`` [N] (ids >= 0):
    {"logps", "entropy" (0 unless ``with_entropy``), "correct"}, each [N]. ``dtype``: the product's (default:
    hidden's); ``chunk``: positions per chunk (default: about ``chunk_bytes_for`` the device of float32 logits);
    ``saved_bytes``: how much of the log-probabilities backward may keep instead of recomputing them."""
    low_in, low_weight = low_rank if low_rank is not None else (None, None)
    chunk = chunk or chunk_positions(weight.shape[0], chunk_bytes_for(weight.device.type))
    hits = torch.empty(hidden.shape[0], dtype=torch.bool, device=hidden.device)
    with torch.autocast(hidden.device.type, enabled=False):
        logps, entropy = ChunkedHead.apply(hidden, weight, bias, low_in, low_weight, targets, temperature, chunk,
                                           dtype or hidden.dtype, with_entropy, entropy_grad, hits, saved_bytes)
    return {"logps": logps, "entropy": entropy, "correct": hits}


# ------------------------------------------------------------------------------------------------------------------
# The head of a model, and swapping it for one forward
# ------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HeadPlan:
    """Which module's forward to swap (``module``), and how it computes: ``linear`` is the nn.Linear holding the
    head's weight; ``lora`` the PEFT LoRA layer around it (None without); ``float32``: cast_lm_head_to_fp32."""

    module: torch.nn.Module
    linear: torch.nn.Linear
    lora: torch.nn.Module | None
    float32: bool


def plan_head(model: torch.nn.Module) -> HeadPlan | None:
    """How ``scoring_head`` computes this model's head, or None where it cannot (see the module docstring)."""
    model = getattr(model, "module", model)  # DDP's / DeepSpeed's wrapped model
    config = getattr(model, "config", None)
    text = config.get_text_config() if config is not None else None
    if text is None or any(getattr(text, name, None) not in (None, 1.0) for name in LOGIT_TRANSFORMS):
        return None
    head = model.get_output_embeddings()
    if head is None or _foreign_hooks(head):
        return None
    float32 = bool(getattr(head, "float32_head", False))
    if type(head) is torch.nn.Linear:
        return HeadPlan(head, head, None, float32)
    kind = type(head).__name__
    if kind == "ModulesToSaveWrapper":  # PEFT's trained copy of the head (or the original, adapters off)
        active = head.active_adapters
        inner = head.original_module if head.disable_adapters or any(a not in head.modules_to_save for a in active) \
            else head.modules_to_save[active[0]] if len(active) == 1 else None
        return HeadPlan(inner, inner, None, float32) if type(inner) is torch.nn.Linear else None
    if hasattr(head, "lora_A") and type(getattr(head, "base_layer", None)) is torch.nn.Linear:
        if head.disable_adapters or head.merged:
            return HeadPlan(head.base_layer, head.base_layer, None, float32)
        vanilla = all(a not in head.lora_variant and getattr(head.lora_B[a], "bias", None) is None
                      for a in head.active_adapters if a in head.lora_A)
        sharded = hasattr(head.base_layer.weight, "ds_id")  # ZeRO-3 gathers it only when the base layer runs
        if vanilla and not sharded:
            return HeadPlan(head, head.base_layer, head, float32)
    return None


def _foreign_hooks(module: torch.nn.Module) -> bool:
    """Whether a hook other than DeepSpeed's (ZeRO-3 gathers weights with them) watches the head or its modules:
    a user's forward hook expects logits, and Accelerate's device-map hooks replace ``forward`` themselves."""
    for sub in module.modules():
        if hasattr(sub, "_hf_hook"):
            return True
        hooks = [*sub._forward_hooks.values(), *sub._forward_pre_hooks.values()]
        if any(not getattr(hook, "__module__", "").startswith("deepspeed") for hook in hooks):
            return True
    return False


@contextlib.contextmanager
def scoring_head(plan: HeadPlan, targets: torch.Tensor, temperature: float = 1.0, with_entropy: bool = False,
                 entropy_grad: bool = False, rows: torch.Tensor | None = None, chunk: int | None = None,
                 with_mean_logit: bool = False, kept: int | None = None):
    """Within this block, the model's head returns scores instead of logits: for hidden states [b, K, H], a
    [B, K, 3] float32 tensor of (log p(target), entropy (0 unless ``with_entropy``), argmax hit) per position, 0
    where ``targets`` [B, K] is negative (those positions are not computed); ``with_mean_logit``: [B, K, 4], the
    logits' mean over the vocabulary fourth (no gradient). ``rows`` [B]: row i reads hidden row rows[i]
    (completions sharing a prompt's last position); None: b == B. ``kept``: how many targets are >= 0, where
    the caller knows it as a host integer (``true_positions``)."""
    def forward(hidden: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if rows is not None:
            hidden = hidden[rows]
        if hidden.shape[:2] != targets.shape:
            raise RuntimeError(f"the output head got hidden states {tuple(hidden.shape)} for targets "
                               f"{tuple(targets.shape)}: this model's forward slices its positions differently.")
        return _scores(plan, hidden, targets, temperature, with_entropy, entropy_grad, chunk, with_mean_logit, kept)

    with swapped_forward(plan.module, forward):
        yield


@contextlib.contextmanager
def swapped_forward(module: torch.nn.Module, forward):
    """Within this block ``module`` (a model's head) runs ``forward`` instead of its own; its hooks still run
    (ZeRO-3's gather of its weight among them)."""
    saved = vars(module).get("forward")  # an instance-level forward (cast_lm_head_to_fp32's) to restore
    module.forward = forward
    try:
        yield
    finally:
        if saved is None:
            del module.forward
        else:
            module.forward = saved


def _scores(plan: HeadPlan, hidden: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool,
            entropy_grad: bool, chunk: int | None, with_mean_logit: bool = False, kept: int | None = None
            ) -> torch.Tensor:
    """[B, K, H] hidden states -> [B, K, 3] scores ([B, K, 4] ``with_mean_logit``); only positions whose target
    is >= 0 (``kept`` of them, where known) are computed."""
    linear = plan.linear
    if plan.float32:
        dtype = torch.float32
    elif torch.is_autocast_enabled(hidden.device.type):
        dtype = torch.get_autocast_dtype(hidden.device.type)
    else:
        dtype = linear.weight.dtype
    index = true_positions(targets >= 0, kept)  # [N] of the B x K positions
    picked = hidden.flatten(0, 1)[index]  # [N, H] (its backward accumulates as a boolean selection's does)
    low_rank = _lora_path(plan.lora, picked) if plan.lora is not None else None
    scores = chunked_head_scores(picked, linear.weight, targets.flatten()[index], linear.bias,
                                 low_rank, temperature, with_entropy, entropy_grad, dtype, chunk)
    columns = [scores["logps"], scores["entropy"], scores["correct"].float()]
    if with_mean_logit:
        columns.append(_mean_logits(linear, picked, low_rank, temperature))
    stacked = torch.stack(columns, dim=-1)  # [N, 3 or 4]
    out = stacked.new_zeros((targets.numel(), len(columns))).index_copy(0, index, stacked)  # [B x K, 3 or 4]
    return out.view(*targets.shape, len(columns))


def true_positions(mask: torch.Tensor, count: int | None = None) -> torch.Tensor:
    """The flat indices of ``mask``'s True entries, in order: [count]. ``count``: how many there are, where the
    caller knows it as a host integer; then they are found without reading the mask (``nonzero_static``): on a
    GPU, reading it (``nonzero``, boolean indexing) stalls the host until the device catches up."""
    flat = mask.flatten()
    if count is None:
        return flat.nonzero().squeeze(1)
    return torch.nonzero_static(flat, size=count).squeeze(1)


@torch.no_grad()
def _mean_logits(linear: torch.nn.Linear, hidden: torch.Tensor, low_rank: tuple | None, temperature: float
                 ) -> torch.Tensor:
    """Each position's logits averaged over the vocabulary, [N] float32, without the logits: the mean of
    hidden @ W.T + b over the vocabulary is hidden @ mean(W) + mean(b) (TRL's logits/chosen)."""
    mean = hidden.detach().float() @ linear.weight.float().mean(0)  # [N]
    if linear.bias is not None:
        mean += linear.bias.float().mean()
    if low_rank is not None:
        low_in, low_weight = low_rank
        mean += low_in.detach().float() @ low_weight.float().mean(0)
    return mean / temperature


def _lora_path(lora: torch.nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A LoRA head's low-rank path for ``hidden`` [N, H]: (scaling x lora_A(dropout(hidden)) [N, r], lora_B's
    weight [V, r]), the active adapters' concatenated along r, so the head adds low_in @ low_weight.T."""
    ins, weights = [], []
    for name in lora.active_adapters:
        if name not in lora.lora_A:
            continue
        x = hidden.to(lora.lora_A[name].weight.dtype)
        ins.append(lora.lora_A[name](lora.lora_dropout[name](x)) * lora.scaling[name])
        weights.append(lora.lora_B[name].weight)
    return torch.cat(ins, dim=-1), torch.cat(weights, dim=-1)
