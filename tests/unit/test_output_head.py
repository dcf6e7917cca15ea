"""The chunked output head (trainers/model/output_head.py): the same log-probs, entropy, argmax hits, vocabulary-mean
logits and gradients as full logits, in float32, for every head it takes (tied, untied with bias, cast to
float32, LoRA on the head, PEFT's trained copy of it, prompt tuning's virtual tokens, an MoE model's router
loss), and never a [tokens, vocabulary] tensor larger than one chunk."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM

from trainers.model.modeling import cast_lm_head_to_fp32, token_logprobs
from trainers.model.output_head import (CHUNK_BYTES, SAVED_BYTES, add_weight_grad, chunk_bytes_for, chunk_positions,
                                  chunked_head_scores, low_precision_weight_grad, plan_head)

VOCAB = 97


def reference(hidden, weight, targets, bias=None, low_rank=None, temperature=1.0):
    logits = hidden @ weight.T
    if bias is not None:
        logits = logits + bias
    if low_rank is not None:
        logits = logits + low_rank[0] @ low_rank[1].T
    log_p = (logits / temperature).log_softmax(-1)
    return {"logps": log_p.gather(1, targets[:, None])[:, 0], "entropy": -(log_p.exp() * log_p).sum(-1),
            "correct": logits.argmax(-1) == targets}


@pytest.mark.parametrize("chunk", [1, 4, 13, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("entropy_grad", [False, True])
@pytest.mark.parametrize("saved_bytes", [0, 2 * 4 * 4 * 50, 2**20])  # recompute all chunks, keep two, keep all
def test_chunked_scores_equal_full_logits(chunk, temperature, entropy_grad, saved_bytes):
    torch.manual_seed(0)
    N, H, V, r = 13, 8, 50, 3
    leaves = [torch.randn(*shape, requires_grad=True) for shape in ((N, H), (V, H), (V,), (N, r), (V, r))]
    hidden, weight, bias, low_in, low_weight = leaves
    targets = torch.randint(0, V, (N,))
    g_logps, g_entropy = torch.randn(N), torch.randn(N)

    def loss(out):
        return (g_logps * out["logps"]).sum() + entropy_grad * (g_entropy * out["entropy"]).sum()

    want = reference(hidden, weight, targets, bias, (low_in, low_weight), temperature)
    want_grads = torch.autograd.grad(loss(want), leaves)
    got = chunked_head_scores(hidden, weight, targets, bias, (low_in, low_weight), temperature,
                              entropy_grad=entropy_grad, chunk=chunk, saved_bytes=saved_bytes)
    assert got["entropy"].requires_grad == entropy_grad
    got_grads = torch.autograd.grad(loss(got), leaves)
    torch.testing.assert_close(got["logps"], want["logps"], rtol=0, atol=1e-5)
    torch.testing.assert_close(got["entropy"], want["entropy"], rtol=0, atol=1e-4)
    assert torch.equal(got["correct"], want["correct"])
    for name, g, w in zip(("hidden", "weight", "bias", "low_in", "low_weight"), got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4, msg=name)


def make_model(tied: bool, vocab: int = VOCAB, hidden: int = 32):
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=64, max_position_embeddings=512,
                         tie_word_embeddings=tied)
    return Qwen2ForCausalLM(config).train()


def batch(rows=3, length=11, vocab=VOCAB):
    torch.manual_seed(1)
    input_ids = torch.randint(0, vocab, (rows, length))
    targets = torch.roll(input_ids, -1, dims=1)
    targets[:, -1] = -100
    targets[0, :4] = -100  # a masked prompt
    mask = torch.ones_like(input_ids)
    mask[-1, 8:] = 0  # padding
    targets[-1, 7:] = -100
    return input_ids, targets, mask


def both_ways(model, input_ids, targets, mask, *, keep=None, bf16=False, **options):
    """token_logprobs with the chunked head and with full logits (with_logits=True): the outputs and the gradient
    of one loss over them, for every trained parameter."""
    results = []
    for full in (False, True):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = token_logprobs(model, input_ids, targets if keep is None else targets[:, -keep:], mask,
                                 logits_to_keep=keep, with_entropy=True, with_accuracy=True, entropy_grad=True,
                                 with_mean_logit=True, with_logits=full, **options)
        counted = (targets if keep is None else targets[:, -keep:]) >= 0
        loss = -(out["logps"] * counted).sum() + 0.1 * (out["entropy"] * counted).sum()
        if "aux_loss" in out:
            loss = loss + out["aux_loss"]
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append(({k: v.detach() if k == "aux_loss" else v & counted if v.dtype == torch.bool
                         else v.detach() * counted for k, v in out.items() if k != "logits"}, grads))
    (chunked, chunked_grads), (full, full_grads) = results
    assert set(chunked) == set(full) and set(chunked_grads) == set(full_grads) and full_grads
    assert "mean_logit" in chunked  # the vocabulary mean (DPO's logits/chosen): hidden @ mean(W) when chunked
    return chunked, full, chunked_grads, full_grads


def assert_same(chunked, full, chunked_grads, full_grads, atol=1e-5):
    for key in chunked:
        if chunked[key].dtype == torch.bool:
            assert torch.equal(chunked[key], full[key]), key
        else:
            torch.testing.assert_close(chunked[key], full[key], rtol=0, atol=atol, msg=key)
    for name in full_grads:
        torch.testing.assert_close(chunked_grads[name], full_grads[name], rtol=1e-4, atol=atol, msg=name)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("keep", [None, 6])
def test_token_logprobs_equal_full_logits(tied, keep):
    model = make_model(tied)
    assert plan_head(model) is not None
    input_ids, targets, mask = batch()
    assert_same(*both_ways(model, input_ids, targets.clamp(min=0) if keep else targets, mask, keep=keep,
                           temperature=0.8))


def test_head_with_bias_and_float32_cast_under_bf16_autocast():
    model = make_model(tied=False)
    head = model.get_output_embeddings()
    head.bias = torch.nn.Parameter(torch.randn(VOCAB) * 0.1)
    cast_lm_head_to_fp32(model)
    assert plan_head(model).float32
    input_ids, targets, mask = batch()
    chunked, full, chunked_grads, full_grads = both_ways(model, input_ids, targets, mask, bf16=True)
    # the same float32 head on the same bf16 body: equal up to the body's bf16 rounding (the two forwards' autocast
    # kernels are identical, so in practice exactly)
    assert_same(chunked, full, chunked_grads, full_grads, atol=1e-3)


def test_lora_on_the_head_and_modules_to_save():
    peft = pytest.importorskip("peft")
    for config in (peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"], lora_dropout=0.0),
                   peft.LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"])):
        model = peft.get_peft_model(make_model(tied=False), config)
        with torch.no_grad():  # LoRA's B starts at zero: give it a value so lora_A's gradient is not zero
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1)
        plan = plan_head(model)
        assert plan is not None and (plan.lora is not None) == ("lm_head" in config.target_modules)
        input_ids, targets, mask = batch()
        chunked, full, chunked_grads, full_grads = both_ways(model, input_ids, targets, mask)
        assert any("lm_head" in name for name in full_grads)  # the head's adapter (or copy) trains
        assert_same(chunked, full, chunked_grads, full_grads)
        with model.disable_adapter(), torch.no_grad():  # GRPO's reference with PEFT: the base head
            assert plan_head(model).lora is None
            chunked = token_logprobs(model, input_ids, targets, mask, with_entropy=True)
            full = token_logprobs(model, input_ids, targets, mask, with_entropy=True, with_logits=True)
            torch.testing.assert_close(chunked["logps"] * (targets >= 0), full["logps"] * (targets >= 0))


def test_prompt_tuning_virtual_tokens():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(make_model(tied=True), peft.PromptTuningConfig(task_type="CAUSAL_LM",
                                                                               num_virtual_tokens=5))
    input_ids, targets, mask = batch()
    assert_same(*both_ways(model, input_ids, targets, mask))


def test_moe_router_loss():
    torch.manual_seed(0)
    model = Qwen2MoeForCausalLM(Qwen2MoeConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4,
        num_experts_per_tok=2, max_position_embeddings=128)).train()
    input_ids, targets, mask = batch()
    chunked, full, chunked_grads, full_grads = both_ways(model, input_ids, targets, mask, with_router_loss=True)
    assert chunked["aux_loss"] > 0
    assert_same(chunked, full, chunked_grads, full_grads)


def test_models_that_transform_their_logits_keep_full_logits():
    model = make_model(tied=True)
    model.config.final_logit_softcapping = 30.0  # Gemma 2's: the head's output is soft-capped after the head
    assert plan_head(model) is None


class LargestTensor(TorchDispatchMode):
    """The most elements any one tensor an operator returns has (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor):
                self.largest = max(self.largest, tensor.numel())
        return out


def test_no_tensor_spans_all_positions_and_the_vocabulary():
    """2,000 positions at a 65,536-token vocabulary: full logits would be 131M elements (512 MiB in float32); the
    chunked head's largest tensor is one chunk of positions (64 MiB), or the log-probabilities it keeps for
    backward (128 MiB)."""
    vocab = 65536
    model = make_model(tied=True, vocab=vocab, hidden=16)
    input_ids, targets, mask = batch(rows=2, length=1000, vocab=vocab)
    with LargestTensor() as probe:
        out = token_logprobs(model, input_ids, targets, mask, with_entropy=True, with_accuracy=True)
        (-out["logps"].sum()).backward()
    assert chunk_positions(vocab) == CHUNK_BYTES // (4 * vocab) == 256
    assert probe.largest <= max(CHUNK_BYTES, SAVED_BYTES) // 4 < input_ids.numel() * vocab / 3  # elements
    assert model.get_output_embeddings().weight.grad.abs().sum() > 0


def test_on_a_gpu_the_weight_gradient_runs_in_the_models_dtype_and_chunks_are_larger():
    """Issue 59, finding 6: on CUDA a bf16/fp16 model's head weight gradient is a product in its dtype accumulated
    in float32 (tensor cores; the float32 product it replaced runs at about 1/12 of their speed with TF32 off), and
    chunks are sized from the card's memory (a run and its resume choose the same). On CPU nothing changes: float32
    products and CHUNK_BYTES, whatever the model's dtype. The GPU's speed is benchmarks/gpu_check.py's "head" part."""
    assert low_precision_weight_grad("cuda", torch.bfloat16) and low_precision_weight_grad("cuda", torch.float16)
    assert not low_precision_weight_grad("cuda", torch.float32)
    assert not low_precision_weight_grad("cpu", torch.bfloat16)
    assert chunk_bytes_for("cpu") == CHUNK_BYTES
    assert chunk_bytes_for("cuda", total_memory=80 * 2**30) == 512 * 2**20  # H100: at most 512 MiB of logits
    assert chunk_bytes_for("cuda", total_memory=16 * 2**30) == 128 * 2**20
    assert chunk_bytes_for("cuda", total_memory=4 * 2**30) == CHUNK_BYTES  # never below the CPU's
    # on CPU a bf16 head's weight gradient is still the float32 product of the float32 logit gradient
    torch.manual_seed(0)
    hidden = torch.randn(8, 16, dtype=torch.bfloat16)
    grad = torch.randn(8, 32)
    out = torch.zeros(32, 16)
    add_weight_grad(out, grad, hidden, torch.bfloat16)
    assert torch.equal(out, grad.t() @ hidden.float())
