"""Float32 attention for bf16 training on CPU (the core calls it; it does not change a result beyond rounding).

PyTorch's CPU flash-attention kernel (what ``attn_implementation="sdpa"`` runs) is slower in bf16 than in
float32 at every length we train at: forward + backward of 16 rows × 12 / 4 heads × head dim 64 take 21.4 ms
in bf16 against 9.2 ms in float32 at 80 tokens, and 89 against 86 ms at 272 tokens (2-core AVX-512 CPU,
torch 2.13; docs/benchmarks.md). Under bf16 autocast the query, key and value come out of the projections in
bf16, so the training forward calls the slow kernel. ``float32_attention_on_cpu`` switches the model's
attention, for one forward, to HF's own SDPA attention run on float32 copies of q, k and v (the output goes
back to bf16, as the next projection would cast it anyway). Float32 attention is also the more accurate one.

The switch is HF's documented extension point (``AttentionInterface`` / ``AttentionMaskInterface``), under
the name ``FLOAT32_SDPA``; it is made only for models whose attention is ``"sdpa"``, only on CPU, and undone
after the forward, so the user's model object keeps its configuration.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

FLOAT32_SDPA = "trainers_sdpa_float32"


def sdpa_attention_in_float32(module, query, key, value, attention_mask, **kwargs):
    """HF's ``sdpa_attention_forward`` in float32 for multi-token queries on CPU that would otherwise run the bf16
    (or fp16) kernel; otherwise exactly ``sdpa_attention_forward``. query: [B, H, Tq, D]; key, value:
    [B, KV, Tk, D]. Under autocast, RoPE has already promoted q and k to float32 while v is bf16: autocast would
    cast all three to bf16 for the kernel. The output has the dtype the bf16 kernel would have returned."""
    autocast = torch.is_autocast_enabled("cpu")
    out_dtype = torch.get_autocast_dtype("cpu") if autocast else query.dtype
    low_precision = out_dtype != torch.float32 or any(t.dtype != torch.float32 for t in (query, key, value))
    if query.device.type != "cpu" or query.shape[2] == 1 or not low_precision:
        # Decoding (one query) reads the whole cache: casting it would cost more than the kernel saves.
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    with torch.autocast("cpu", enabled=False):  # autocast would cast the inputs back to bf16
        out, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(), attention_mask,
                                              **kwargs)
    return out.to(out_dtype), weights


AttentionInterface.register(FLOAT32_SDPA, sdpa_attention_in_float32)
AttentionMaskInterface.register(FLOAT32_SDPA, sdpa_mask)  # the same masks as "sdpa"


def _sdpa_configs(model: torch.nn.Module) -> list:
    """The configs with ``"sdpa"`` attention that the model's modules read (wrappers such as DDP and PEFT reach
    the base model's through ``modules()``; a multimodal model's sub-configs are found on their own modules).
    None when gradient checkpointing is on: backward re-runs the forward outside the switch, and the
    recomputation must match the original forward."""
    found = {}
    for module in model.modules():
        if getattr(module, "gradient_checkpointing", False) is True:
            return []
        config = getattr(module, "config", None)
        if getattr(config, "_attn_implementation", None) == "sdpa":
            found[id(config)] = config
    return list(found.values())


@contextmanager
def float32_attention_on_cpu(model: torch.nn.Module, device: torch.device):
    """During the block, a model on CPU whose attention is ``"sdpa"`` runs it in float32 (see the module doc).
    Anything else (a GPU, eager or flash attention, a custom model, gradient checkpointing) is left as it is."""
    configs = _sdpa_configs(model) if device.type == "cpu" else []
    # The internal field, not the ``_attn_implementation`` setter: the setter also rewrites every sub-config,
    # which would turn, say, an "eager" vision tower into "sdpa" when restored.
    for config in configs:
        config._attn_implementation_internal = FLOAT32_SDPA
    try:
        yield
    finally:
        for config in configs:
            config._attn_implementation_internal = "sdpa"
