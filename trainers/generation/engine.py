"""A lean sampling engine for Llama-style decoders (Llama, Mistral, Qwen2, Qwen3).

HF ``generate`` spends most of a small model's decode step in per-token Python: building attention masks,
rotary tables and cache bookkeeping around a few small matrix products. This engine keeps only the work:

- a static KV cache allocated once for prompt + completion;
- each distinct prompt prefilled once and its cache copied to the ``num_generations`` rows that share it;
- rotary cos/sin computed once for all positions, with the model's own rotary module (so any rope scaling
  the model uses is honoured);
- per decode step, per layer: the model's own projection modules (so LoRA adapters and gathered ZeRO-3
  weights work unchanged), fused RMSNorm, one SDPA call over the cache, and nothing else; on CPU, large
  linear weights are re-laid once per call for oneDNN's packed GEMM (2-3x faster for a few rows), the
  projections that share an input (q/k/v, gate/up) stacked into one product, LoRA layers with their adapters
  merged into that copy;
- finished rows dropped from the decode batch.

Memory at a real vocabulary: a decode step's [rows, vocab] logits (and the sampling filters' copies of them)
live for that step only, and the prefill computes the last position's alone (tests/unit/test_engine.py). The
packed copies cost one matrix each, in the compute dtype, for the length of one ``generate`` call; the head's
is vocab x hidden: 155 MB at 151,936 x 256 in float32, 545 MB at Qwen2.5-0.5B's 151,936 x 896. It is kept
because it pays at that size too: a 16-row decode step's head product takes 20 ms packed against 30 ms at
width 256, 65 against 118 ms at width 896 (one thread, oneDNN), i.e. 0.6-3.4 s of a 64-token round; and a
round's sampling is not the run's peak (training's, with optimizer states and gradients, is higher).

Sampling follows HF's order and semantics: repetition penalty, min_new_tokens, then temperature, top-k,
top-p, min-p, softmax, multinomial; ``do_sample=False`` is greedy. Greedy decoding gives the same tokens as
HF ``generate`` (tests/unit/test_engine.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trainers.generation.rows import prompt_groups

SUPPORTED_MODEL_TYPES = {"llama", "mistral", "qwen2", "qwen3"}
SUPPORTED_EXTRA = {"min_new_tokens"}  # generation_kwargs the engine understands; anything else uses HF generate


def _causal_lm(model):
    """The HF causal LM inside a PEFT wrapper (adapters stay in place, inside its modules)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def supports(model, extra: dict | None = None) -> bool:
    """Whether this engine can decode with ``model`` (else HF ``generate`` is used)."""
    if set(extra or {}) - SUPPORTED_EXTRA:
        return False
    lm = _causal_lm(model)
    config = getattr(lm, "config", None)
    if getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return False
    if getattr(config, "use_sliding_window", False) or any(t != "full_attention" for t in
                                                            getattr(config, "layer_types", None) or []):
        return False
    decoder = getattr(lm, "model", None)
    if not all(hasattr(decoder, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")) or not hasattr(lm, "lm_head"):
        return False
    mlp = decoder.layers[0].mlp
    return all(hasattr(mlp, a) for a in ("gate_proj", "up_proj", "down_proj", "act_fn"))


# Smallest weight worth a packed layout, measured at 16 rows on CPU: in fp32 a 256 x 256 weight breaks even
# (19 vs 21 us) and a 768 x 256 one is 2.6x faster packed (30 vs 78 us); in bf16 packing also saves the
# per-call weight cast, so every weight gains (128 x 256: 16 vs 32 us).
_PACK_MIN_WEIGHT = {torch.float32: 64 * 1024, torch.bfloat16: 0}


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN's packed linear runs here. Its bf16 path needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT: on
    a CPU without them (e.g. an AVX2-only host) it raises "mkldnn_reorder_linear_weight: bf16 path needs the
    cpu support ...", so bf16 weights stay unpacked there."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn,
                                                                                        "_linear_pointwise"):
        return False
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return dtype == torch.float32


def _compute_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype matrix products run in: the autocast dtype when autocast is on (bf16 mixed precision), as the
    training forward computes, else the weights' own."""
    device = weight.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return weight.dtype


def _filter_logits(logits: torch.Tensor, params, generated: torch.Tensor, step: int, eos: torch.Tensor) -> torch.Tensor:
    """HF's logits processors and warpers, in HF's order. logits: [A, V] float32; generated: [A, S] ids so far."""
    if params.repetition_penalty != 1.0:
        seen = torch.gather(logits, 1, generated)
        seen = torch.where(seen < 0, seen * params.repetition_penalty, seen / params.repetition_penalty)
        logits = logits.scatter(1, generated, seen)
    if step < params.extra.get("min_new_tokens", 0):
        logits[:, eos] = -float("inf")
    if not params.do_sample:
        return logits
    if params.temperature != 1.0:
        logits = logits / params.temperature
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -float("inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=False)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        remove = cumulative <= (1 - params.top_p)
        remove[:, -1] = False  # keep at least one token
        logits = logits.masked_fill(remove.scatter(1, order, remove), -float("inf"))
    if params.min_p is not None:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(-1, keepdim=True).values, -float("inf"))
    return logits


def sample(logits: torch.Tensor) -> torch.Tensor:
    """One token per row from softmax(logits) [A, V], by inverse CDF: one uniform draw per row.

    ``torch.multinomial`` on CPU draws an exponential variate for every vocabulary entry (2.9 ms per step
    for 16 rows x 8k tokens, more than the model's forward); this is the same distribution for ~1/V of the
    random numbers."""
    cdf = logits.softmax(-1).cumsum(-1)  # [A, V]
    u = torch.rand(cdf.shape[0], 1, device=cdf.device, dtype=cdf.dtype) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).clamp(max=cdf.shape[1] - 1)[:, 0]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [..., H] as one fused op, computed in float32 as HF does, then scaled by weight [H]."""
    return F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype) * weight


def _base_linear(module) -> torch.nn.Module:
    return module.base_layer if hasattr(module, "lora_A") else module


def effective_weight(module) -> torch.Tensor | None:
    """The weight ``module`` multiplies its input by, detached: a plain ``nn.Linear``'s own, or for a PEFT LoRA
    layer its base weight plus every active adapter's B @ A x scaling (the merged weight, computed afresh at each
    call so it follows training). None for anything else, which keeps its own forward: LoRA variants (DoRA and
    friends), adapters with a bias, disabled or already merged adapters, adapters with dropout in training mode
    (sampling runs the policy in eval mode, where dropout is the identity), or other wrappers."""
    if type(module) is torch.nn.Linear:
        return module.weight.detach()
    if not hasattr(module, "lora_A") or type(getattr(module, "base_layer", None)) is not torch.nn.Linear:
        return None
    adapters = [a for a in module.active_adapters if a in module.lora_A]
    dropout = module.training and not all(type(module.lora_dropout[a]) is torch.nn.Identity for a in adapters)
    if (dropout or module.disable_adapters or module.merged or getattr(module, "lora_variant", None)
            or any(getattr(module, "lora_bias", {}).get(a) for a in adapters)):
        return None
    weight = module.base_layer.weight.detach()
    for adapter in adapters:
        weight = weight + module.get_delta_weight(adapter).detach().to(weight.dtype)
    return weight


def projection_groups(layer) -> list[list[torch.nn.Module]]:
    """A decoder layer's projections, grouped by the input they read (``Decoder.forward`` calls them so)."""
    attn, mlp = layer.self_attn, layer.mlp
    return [[attn.q_proj, attn.k_proj, attn.v_proj], [attn.o_proj], [mlp.gate_proj, mlp.up_proj], [mlp.down_proj]]


class Decoder:
    """The model's layers, run step by step against a static KV cache."""

    def __init__(self, model):
        self.lm = _causal_lm(model)
        self.decoder = self.lm.model
        config = self.lm.config
        self.layers = list(self.decoder.layers)
        attn = self.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling
        self.n_heads = config.num_attention_heads
        self.n_kv = config.num_key_value_heads
        self.packed: dict[int, tuple[torch.Tensor, torch.Tensor | None, list[int]]] = {}
        # The decoder's dtype, read from its final norm: the embeddings may be float32 while the rest is not (a
        # head tied to them and cast by cast_lm_head_to_fp32)
        self.body_weight = self.decoder.norm.weight
        self.dtype = _compute_dtype(self.body_weight)  # of the matrix products
        # Attention and the KV cache stay in the weights' dtype: bf16 attention is slower on CPU (its decode
        # SDPA kernel takes twice as long), and the cache is small.
        self.cache_dtype = self.body_weight.dtype

    def pack_weights(self, batch: int) -> None:
        """Re-lay large plain ``nn.Linear`` weights for oneDNN once per call (CPU; in the compute dtype): a decode
        step multiplies a few rows by each weight, where oneDNN's packed GEMM is 2-3x faster than the default
        BLAS call (and under bf16 autocast, than re-casting the weight at every call). A LoRA layer is packed
        with its adapters merged into the copy (``effective_weight``): one product per decode step instead of
        three, and the model's own weights are not touched. Projections that read the same input are packed as
        one matrix (q/k/v, gate/up), as inference engines do: fewer, larger products stream the weights faster
        (small model: 24 -> 22 ms of products per decode step)."""
        if not can_pack(self.decoder.embed_tokens.weight.device, self.dtype):
            return
        # the modules self.linear is called with (not a LoRA layer's inner base_layer, which it never calls)
        self.pack_group([self.lm.lm_head], batch)
        for layer in self.layers:
            for group in projection_groups(layer):
                self.pack_group(group, batch)

    def pack_group(self, modules: list, batch: int) -> None:
        """Pack the modules' weights stacked as one [sum of outputs, in] matrix, keyed by the first module; or
        leave them all to their own forward when one has no plain weight or the stack is too small to gain."""
        weights = [effective_weight(module) for module in modules]
        if any(w is None for w in weights) or sum(w.numel() for w in weights) < _PACK_MIN_WEIGHT[self.dtype]:
            return
        biases = [_base_linear(module).bias for module in modules]
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat([w.new_zeros(w.shape[0]) if b is None else b.detach() for w, b in zip(weights, biases)])
            bias = bias.to(self.dtype)
        weight = weights[0] if len(weights) == 1 else torch.cat(weights)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.to(self.dtype), batch)
        self.packed[id(modules[0])] = (packed, bias, [w.shape[0] for w in weights])

    def linear(self, module, x: torch.Tensor) -> torch.Tensor:
        packed = self.packed.get(id(module))
        if packed is None or len(packed[2]) != 1:  # not packed, or packed with the modules after it
            return module(x)
        return self._product(packed, x)[0]

    def linears(self, modules: list, x: torch.Tensor) -> list[torch.Tensor]:
        """Each module applied to ``x`` [..., in]: one product when they were packed together."""
        packed = self.packed.get(id(modules[0]))
        if packed is None or len(packed[2]) != len(modules):
            return [self.linear(module, x) for module in modules]
        return self._product(packed, x)

    def _product(self, packed: tuple, x: torch.Tensor) -> list[torch.Tensor]:
        weight, bias, sizes = packed
        out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]).to(self.dtype), weight, bias, "none",
                                                 [], "")  # [rows, sum of sizes]
        return [part.view(*x.shape[:-1], -1) for part in out.split(sizes, dim=-1)]

    def mlp(self, mlp, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.linears([mlp.gate_proj, mlp.up_proj], x)
        return self.linear(mlp.down_proj, mlp.act_fn(gate) * up)

    def rotary(self, length: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(length, device=like.device).unsqueeze(0)
        cos, sin = self.decoder.rotary_emb(like, positions)  # [1, length, head_dim]
        return cos[0], sin[0]

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [A, heads, T, D]; cos/sin: [A, 1, T, D]
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    @staticmethod
    def _norm(module, x: torch.Tensor) -> torch.Tensor:
        """The model's RMSNorm module applied by ``rms_norm``."""
        return rms_norm(x, module.weight, getattr(module, "variance_epsilon", None) or getattr(module, "eps", 1e-6))

    def forward(self, ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: list, start: int,
                attn_mask: torch.Tensor) -> torch.Tensor:
        """Run ``ids`` [A, T] at cache columns [start, start + T); returns the last position's logits [A, V].

        cos/sin: [A, 1, T, D] for these tokens' positions; attn_mask: [A, 1, T, start + T] bool."""
        x = self.decoder.embed_tokens(ids)  # [A, T, H]
        a, t = ids.shape
        end = start + t
        for layer, (k_cache, v_cache) in zip(self.layers, cache):
            attn = layer.self_attn
            h = self._norm(layer.input_layernorm, x)
            q, k, v = self.linears([attn.q_proj, attn.k_proj, attn.v_proj], h)
            q = q.view(a, t, self.n_heads, self.head_dim)
            k = k.view(a, t, self.n_kv, self.head_dim)
            v = v.view(a, t, self.n_kv, self.head_dim).transpose(1, 2)
            if hasattr(attn, "q_norm"):  # Qwen3
                q, k = attn.q_norm(q), attn.k_norm(k)
            q = self._rope(q.transpose(1, 2).to(self.cache_dtype), cos, sin)
            k_cache[:, :, start:end] = self._rope(k.transpose(1, 2), cos, sin)
            v_cache[:, :, start:end] = v
            # Outside autocast: it would cast the whole cache slice to bf16 at every step and run the slower
            # bf16 kernel (under bf16 autocast this halves the decode attention time).
            with torch.autocast(ids.device.type, enabled=False):
                out = F.scaled_dot_product_attention(q, k_cache[:, :, :end], v_cache[:, :, :end], attn_mask=attn_mask,
                                                     scale=self.scaling, enable_gqa=self.n_heads != self.n_kv)
            x = x + self.linear(attn.o_proj, out.transpose(1, 2).reshape(a, t, self.n_heads * self.head_dim))
            # (under autocast the residual stream stays in the weights' dtype, as in HF's forward)
            x = x + self.mlp(layer.mlp, self._norm(layer.post_attention_layernorm, x))
        return self.linear(self.lm.lm_head, self._norm(self.decoder.norm, x[:, -1:]))[:, 0].float()


@torch.inference_mode()
def generate(model, prompt_ids: list[list[int]], params, pad_id: int, eos_ids: set[int]) -> list[list[int]]:
    """Sample one completion per prompt. Identical consecutive prompts (a GRPO group) share one prefill.
    Returns completion ids, each cut after its first EOS (or ``max_new_tokens`` long)."""
    device = next(model.parameters()).device
    run = Decoder(model)
    n, max_new = len(prompt_ids), params.max_new_tokens
    run.pack_weights(n)

    # distinct prompts, left-padded to a common length P
    groups = prompt_groups(prompt_ids)
    row_of = torch.tensor(groups, device=device)  # [N]: row -> its distinct prompt
    prompts = [prompt_ids[groups.index(g)] for g in range(max(groups) + 1)]
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long, device=device)  # [U, P]
    keep = torch.zeros((len(prompts), width), dtype=torch.bool, device=device)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, device=device)
        keep[i, width - len(p):] = True
    positions = (keep.long().cumsum(-1) - 1).clamp(min=0)  # [U, P] real tokens count from 0
    cos_table, sin_table = run.rotary(width + max_new, run.body_weight)  # [P + M, D]

    # prefill the distinct prompts; then give every row its prompt's cache
    dtype = run.cache_dtype
    shape = (len(prompts), run.n_kv, width + max_new, run.head_dim)
    cache = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
             for _ in run.layers]
    causal = torch.tril(torch.ones(width, width, dtype=torch.bool, device=device))
    prefill_mask = (causal.unsqueeze(0) & keep.unsqueeze(1)).unsqueeze(1)  # [U, 1, P, P]
    prefill_mask |= torch.eye(width, dtype=torch.bool, device=device)  # padding rows attend to themselves (no NaN)
    logits = run.forward(ids, cos_table[positions].unsqueeze(1), sin_table[positions].unsqueeze(1), cache, 0,
                         prefill_mask)  # [U, V]
    cache = [(k[row_of], v[row_of]) for k, v in cache]  # [N, kv, P + M, D]
    logits = logits[row_of]
    key_mask = torch.zeros((n, width + max_new), dtype=torch.bool, device=device)
    key_mask[:, :width] = keep[row_of]
    next_position = positions[row_of, -1] + 1  # [N]
    history = ids[row_of]  # [N, P] for the repetition penalty

    eos = torch.tensor(sorted(eos_ids), device=device)
    out = torch.full((n, max_new), pad_id, dtype=torch.long, device=device)
    lengths = torch.full((n,), max_new, dtype=torch.long, device=device)
    active = torch.arange(n, device=device)  # rows still decoding, as indices into the full batch
    for step in range(max_new):
        generated = torch.cat([history[active], out[active, :step]], dim=1) if params.repetition_penalty != 1.0 else None
        scores = _filter_logits(logits, params, generated, step, eos)
        if params.do_sample:
            token = sample(scores)
        else:
            token = scores.argmax(-1)
        out[active, step] = token
        done = torch.isin(token, eos)
        lengths[active[done]] = step + 1
        if step + 1 == max_new or done.all():
            break
        if done.any():  # drop finished rows from the decode batch
            alive = ~done
            active, token = active[alive], token[alive]
            cache = [(k[alive], v[alive]) for k, v in cache]
        column = width + step
        key_mask[active, column] = True
        pos = next_position[active] + step  # [A]
        mask = key_mask[active, : column + 1].view(len(active), 1, 1, column + 1)
        logits = run.forward(token.unsqueeze(1), cos_table[pos].view(-1, 1, 1, run.head_dim),
                             sin_table[pos].view(-1, 1, 1, run.head_dim), cache, column, mask)
    return [row[:length].tolist() for row, length in zip(out, lengths.tolist())]
