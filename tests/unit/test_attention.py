"""Float32 attention for bf16 training on CPU (trainers/parallel/host.py): it computes the loss and gradients of the
plain bf16 path within bf16 tolerance, really runs in float32, and leaves the user's model as it was."""

import contextlib

import pytest
import torch
from transformers import AttentionInterface, Qwen2Config, Qwen2ForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from trainers.model import cpu_attention as attention
from trainers.model import modeling
def make_model(attn_implementation: str = "sdpa") -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, max_position_embeddings=128,
                         attn_implementation=attn_implementation)
    return Qwen2ForCausalLM(config).train()


def batch():
    torch.manual_seed(1)
    ids = torch.randint(3, 96, (4, 24))  # [B, T]
    mask = torch.ones_like(ids)
    mask[:2, :5] = 0  # left-padded prompts, as in GRPO
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, positions


def loss_and_grads(model, float32_attention: bool, bf16: bool = True):
    ids, mask, positions = batch()
    model.zero_grad(set_to_none=True)
    switch = modeling.float32_attention_on_cpu
    if not float32_attention:
        modeling.float32_attention_on_cpu = lambda *a: contextlib.nullcontext()
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = modeling.token_logprobs(model, ids, ids[:, -10:], mask, positions, logits_to_keep=10)
        loss = out["logps"].mean()
        loss.backward()
    finally:
        modeling.float32_attention_on_cpu = switch
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.fixture
def spy():
    """Records the dtypes the kernel really receives inside the float32 attention function."""
    seen = []

    def recording(module, query, key, value, attention_mask, **kwargs):
        seen.append((query.shape[2], torch.is_autocast_enabled("cpu")))
        return attention.sdpa_attention_in_float32(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(attention.FLOAT32_SDPA, recording)
    yield seen
    AttentionInterface.register(attention.FLOAT32_SDPA, attention.sdpa_attention_in_float32)


def test_same_loss_and_gradients_as_bf16_attention(spy):
    model = make_model()
    fast_loss, fast_grads = loss_and_grads(model, float32_attention=True)
    assert len(spy) == 2  # both layers went through the float32 function
    plain_loss, plain_grads = loss_and_grads(model, float32_attention=False)
    ref_loss, ref_grads = loss_and_grads(model, float32_attention=False, bf16=False)  # all float32
    assert torch.allclose(fast_loss, plain_loss, rtol=1e-2, atol=1e-2)
    for name, g in plain_grads.items():
        scale = ref_grads[name].norm()
        # bf16 noise: both paths are close to the float32 gradients, and the float32 attention no further off
        assert (fast_grads[name] - plain_grads[name]).norm() <= 0.05 * scale + 1e-6, name
        assert (fast_grads[name] - ref_grads[name]).norm() <= (g - ref_grads[name]).norm() * 1.5 + 1e-3 * scale, name


def test_kernel_runs_in_float32_outside_autocast():
    module = make_model().model.layers[0].self_attn
    q = torch.randn(2, 4, 6, 16)  # [B, H, T, D]: RoPE leaves q and k in float32 under autocast
    k = torch.randn(2, 2, 6, 16)
    v = torch.randn(2, 2, 6, 16).bfloat16()  # v comes straight out of a bf16 projection
    seen = []
    original = attention.sdpa_attention_forward
    attention.sdpa_attention_forward = lambda m, q_, k_, v_, *a, **kw: (
        seen.append((q_.dtype, k_.dtype, v_.dtype, torch.is_autocast_enabled("cpu"))), original(m, q_, k_, v_, *a, **kw))[1]
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out, _ = attention.sdpa_attention_in_float32(module, q, k, v, None, scaling=0.25)
    finally:
        attention.sdpa_attention_forward = original
    assert seen == [(torch.float32, torch.float32, torch.float32, False)]
    assert out.dtype == torch.bfloat16  # what the bf16 kernel would have returned
    expected, _ = sdpa_attention_forward(module, q, k, v.float(), None, scaling=0.25)
    assert torch.allclose(out.float(), expected, atol=1e-2)


def test_passes_through_float32_and_decoding():
    module = make_model().model.layers[0].self_attn
    q, k, v = torch.randn(2, 4, 6, 16), torch.randn(2, 2, 6, 16), torch.randn(2, 2, 6, 16)
    for query in (q, q[:, :, :1]):  # float32 training, and one decode query
        out, _ = attention.sdpa_attention_in_float32(module, query, k, v, None, scaling=0.25, is_causal=False)
        expected, _ = sdpa_attention_forward(module, query, k, v, None, scaling=0.25, is_causal=False)
        assert torch.equal(out, expected)


def test_model_config_restored_even_on_error():
    model = make_model()
    with attention.float32_attention_on_cpu(model, torch.device("cpu")):
        assert model.config._attn_implementation == attention.FLOAT32_SDPA
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(RuntimeError):
        with attention.float32_attention_on_cpu(model, torch.device("cpu")):
            raise RuntimeError("boom")
    assert model.config._attn_implementation == "sdpa"
    assert "trainers" not in model.config.to_json_string()  # nothing of the switch is saved with the model


@pytest.mark.parametrize("case", ["eager", "gpu", "gradient_checkpointing"])
def test_left_alone(case, spy):
    model = make_model("eager" if case == "eager" else "sdpa")
    if case == "gradient_checkpointing":
        # backward re-runs the forward outside the switch: the recomputation must match the original forward
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    device = torch.device("cuda") if case == "gpu" else torch.device("cpu")
    before = model.config._attn_implementation
    with attention.float32_attention_on_cpu(model, device):
        assert model.config._attn_implementation == before
    if case == "gradient_checkpointing":
        loss, grads = loss_and_grads(model, float32_attention=True)  # trains, with no mismatch at recomputation
        assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads.values())
        assert spy == []


def test_peft_wrapped_model_switched():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(make_model(), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with attention.float32_attention_on_cpu(model, torch.device("cpu")):
        assert model.base_model.model.config._attn_implementation == attention.FLOAT32_SDPA
    assert model.base_model.model.config._attn_implementation == "sdpa"


def test_padding_free_on_cuda_takes_a_varlen_attention_or_says_what_it_costs():
    """Issue 59, finding 8: padding-free rows under SDPA get a dense block-diagonal mask, quadratic in the packed
    length. On CUDA the trainer switches a model it loaded to flash-attn 2 when that is installed, keeps what the
    user chose and warns, and warns when there is no varlen kernel; on CPU (measured, float32 SDPA) nothing
    changes."""
    from trainers.model.modeling import padding_free_attention

    assert padding_free_attention("cuda", "sdpa", chosen_by_user=False, flash_available=True) == \
        ("flash_attention_2", None)
    for chosen, flash in ((True, True), (False, False)):
        switch, warning = padding_free_attention("cuda", "sdpa", chosen, flash)
        assert switch is None and "padding_free=True" in warning and "attn_implementation='sdpa'" in warning
        assert "flash_attention_2" in warning and "padding_free=False" in warning
    for current in ("flash_attention_2", "flex_attention", "kernels-community/flash-attn3"):
        assert padding_free_attention("cuda", current, False, True) == (None, None)
    assert padding_free_attention("cpu", "sdpa", False, True) == (None, None)
    assert padding_free_attention("cpu", "eager", True, False) == (None, None)
