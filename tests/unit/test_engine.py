"""The lean sampling engine produces the same tokens as HF generate under greedy decoding, for every model
family it claims, with LoRA, repeated prompts (shared prefill), ragged prompt lengths and early EOS."""

import pytest
import torch

from trainers.generation import engine
from trainers.generation.sampling import SamplingParams, generate, hf_generate


def make_model(kind: str, vocab: int):
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    common = dict(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, max_position_embeddings=256)
    config_class, model_class = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM),
                                 "qwen3": (Qwen3Config, Qwen3ForCausalLM),
                                 "mistral": (MistralConfig, MistralForCausalLM)}[kind]
    extra = {"head_dim": 16} if kind == "qwen3" else {}
    torch.manual_seed(0)
    model = model_class(config_class(**common, **extra)).eval()
    with torch.no_grad():  # sharpen the random model so greedy choices are not near-ties
        model.lm_head.weight.mul_(8)
    return model


PROMPTS = [[5, 6, 7, 8], [5, 6, 7, 8], [9, 10], [9, 10], [11, 12, 13, 14, 15, 16, 17], [3]]


@pytest.mark.parametrize("kind", ["qwen2", "llama", "qwen3", "mistral"])
def test_greedy_tokens_equal_hf_generate(kind, tokenizer):
    model = make_model(kind, len(tokenizer))
    assert engine.supports(model)
    params = SamplingParams(max_new_tokens=12, do_sample=False)
    eos = {tokenizer.eos_token_id}
    ours = engine.generate(model, PROMPTS, params, tokenizer.pad_token_id, eos)
    hf = hf_generate(model, PROMPTS, params, tokenizer.pad_token_id, eos)
    assert ours == hf


def test_early_eos_and_min_new_tokens(tokenizer):
    model = make_model("qwen2", len(tokenizer))
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    with torch.no_grad():  # make EOS the greedy choice after any token 7 or 10
        model.lm_head.weight[eos] = model.model.embed_tokens.weight[7] * 50 + model.model.embed_tokens.weight[10] * 50
    greedy = SamplingParams(max_new_tokens=10, do_sample=False)
    ours = engine.generate(model, PROMPTS, greedy, pad, {eos})
    assert ours == hf_generate(model, PROMPTS, greedy, pad, {eos})
    assert any(len(c) < 10 and c[-1] == eos for c in ours), "some rows stop early and are dropped"
    forced = SamplingParams(max_new_tokens=10, do_sample=False, extra={"min_new_tokens": 6})
    ours_forced = engine.generate(model, PROMPTS, forced, pad, {eos})
    assert ours_forced == hf_generate(model, PROMPTS, forced, pad, {eos})
    assert all(len(c) >= 6 for c in ours_forced)


def test_repetition_penalty_matches_hf(tokenizer):
    model = make_model("llama", len(tokenizer))
    params = SamplingParams(max_new_tokens=10, do_sample=False, repetition_penalty=1.8)
    pad, eos = tokenizer.pad_token_id, {tokenizer.eos_token_id}
    assert engine.generate(model, PROMPTS, params, pad, eos) == hf_generate(model, PROMPTS, params, pad, eos)


def test_lora_adapters_are_used(tokenizer):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(make_model("qwen2", len(tokenizer)), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)  # a non-trivial adapter
    params = SamplingParams(max_new_tokens=8, do_sample=False)
    pad, eos = tokenizer.pad_token_id, {tokenizer.eos_token_id}
    ours = engine.generate(model, PROMPTS, params, pad, eos)
    assert ours == hf_generate(model, PROMPTS, params, pad, eos)
    with model.disable_adapter():
        assert engine.generate(model, PROMPTS, params, pad, eos) != ours


def test_sampling_filters(tokenizer):
    model = make_model("qwen2", len(tokenizer))
    pad, eos = tokenizer.pad_token_id, {tokenizer.eos_token_id}
    greedy = engine.generate(model, PROMPTS, SamplingParams(max_new_tokens=8, do_sample=False), pad, eos)
    torch.manual_seed(1)
    assert engine.generate(model, PROMPTS, SamplingParams(max_new_tokens=8, top_k=1), pad, eos) == greedy
    torch.manual_seed(1)
    assert engine.generate(model, PROMPTS, SamplingParams(max_new_tokens=8, top_p=1e-6), pad, eos) == greedy
    torch.manual_seed(1)
    assert engine.generate(model, PROMPTS, SamplingParams(max_new_tokens=8, min_p=0.999), pad, eos) == greedy
    torch.manual_seed(1)
    hot = engine.generate(model, PROMPTS * 4, SamplingParams(max_new_tokens=8, temperature=5.0), pad, eos)
    assert len({tuple(c) for c in hot}) > 10  # a hot sampler explores


def test_dispatch_falls_back_to_hf_and_refuses_what_lean_cannot_do(tokenizer):
    model = make_model("qwen2", len(tokenizer))
    pad, eos = tokenizer.pad_token_id, {tokenizer.eos_token_id}
    unusual = SamplingParams(max_new_tokens=4, do_sample=False, extra={"no_repeat_ngram_size": 2})
    assert not engine.supports(model, unusual.extra)
    assert generate(model, PROMPTS, unusual, pad, eos) == hf_generate(model, PROMPTS, unusual, pad, eos)
    with pytest.raises(ValueError, match="generation_engine='lean'"):
        generate(model, PROMPTS, unusual, pad, eos, engine="lean")


def test_inverse_cdf_sampling_matches_the_distribution():
    torch.manual_seed(0)
    probs = torch.tensor([0.5, 0.0, 0.3, 0.2])
    logits = probs.log().expand(20000, 4)
    draws = engine.sample(logits)
    frequencies = torch.bincount(draws, minlength=4).float() / len(draws)
    assert frequencies[1] == 0  # a token with probability 0 is never drawn
    torch.testing.assert_close(frequencies, probs, atol=0.015, rtol=0)


def packable_model(vocab: int):
    """Big enough (512 x 1024 MLP weights) for the packed-weight path."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=vocab, hidden_size=512, num_hidden_layers=2,
                                         num_attention_heads=8, num_key_value_heads=2, intermediate_size=1024,
                                         max_position_embeddings=256)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8)
    return model


PACKS = engine.can_pack(torch.device("cpu"), torch.float32)


@pytest.mark.skipif(not PACKS, reason="needs oneDNN packed GEMM")
def test_the_packed_layout_stacks_qkv_and_gate_up():
    model = packable_model(96)
    run = engine.Decoder(model)
    run.pack_weights(6)
    for layer in run.layers:  # q/k/v and gate/up stacked, under the first module of each stack
        attn, mlp = layer.self_attn, layer.mlp
        assert run.packed[id(attn.q_proj)][2] == [512, 128, 128] and run.packed[id(mlp.gate_proj)][2] == [1024, 1024]
        assert run.packed[id(attn.o_proj)][2] == [512] and run.packed[id(mlp.down_proj)][2] == [512]


def test_the_packed_weight_path_gives_the_same_greedy_tokens(tokenizer):
    """Where packing runs (test_the_packed_layout_stacks_qkv_and_gate_up), the engine decodes through it: the
    same greedy tokens as HF in float32; in bf16 (packed bf16 weights against HF's autocast, two different
    kernels) the same tokens up to a tie at bf16's resolution, after which greedy decoding may part."""
    model = packable_model(len(tokenizer))
    params = SamplingParams(max_new_tokens=12, do_sample=False)
    pad, eos = tokenizer.pad_token_id, {tokenizer.eos_token_id}
    assert engine.generate(model, PROMPTS, params, pad, eos) == hf_generate(model, PROMPTS, params, pad, eos)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # bf16 packed weights
        ours, hf = engine.generate(model, PROMPTS, params, pad, eos), hf_generate(model, PROMPTS, params, pad, eos)
    for prompt, a, b in zip(PROMPTS, ours, hf):
        parted = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if parted is None:
            assert a == b, (a, b)
            continue
        # Measured on an AMX CPU: the two tokens are float32's best two, 0.015 apart at logits of ~9-11, where
        # one bf16 step is 0.0625. A wrong packed layout parts at the first token, between unrelated tokens.
        with torch.no_grad():
            logits = model(torch.tensor([prompt + b[:parted]])).logits[0, -1]
        assert {a[parted], b[parted]} == set(logits.topk(2).indices.tolist()), (parted, a, b)
        assert abs(logits[a[parted]] - logits[b[parted]]) < 2 ** -7 * logits.abs().max(), (parted, a, b)
    assert sum(a == b for a, b in zip(ours, hf)) >= len(PROMPTS) // 2, (ours, hf)


@pytest.mark.skipif(not PACKS, reason="needs oneDNN packed GEMM")
def test_projections_packed_together_give_each_modules_own_output(tokenizer):
    """One product over stacked weights (q/k/v with Qwen2's biases, gate/up) splits into every module's output;
    a stack mixing biased and unbiased layers gets zeros for the missing bias; a module without a plain weight
    leaves its whole stack to the modules' own forwards."""
    model = packable_model(len(tokenizer))
    run = engine.Decoder(model)
    run.pack_weights(6)
    attn, mlp = run.layers[0].self_attn, run.layers[0].mlp
    x = torch.randn(2, 3, 512)  # [A, T, H]
    for modules in ([attn.q_proj, attn.k_proj, attn.v_proj], [mlp.gate_proj, mlp.up_proj]):
        outputs = run.linears(modules, x)
        assert [o.shape for o in outputs] == [(2, 3, m.out_features) for m in modules]
        for module, out in zip(modules, outputs):
            torch.testing.assert_close(out, module(x), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(run.linear(attn.o_proj, x), attn.o_proj(x), rtol=1e-4, atol=1e-4)

    torch.manual_seed(1)
    biased, unbiased = torch.nn.Linear(512, 256), torch.nn.Linear(512, 256, bias=False)
    wrapped = torch.nn.Sequential(torch.nn.Linear(512, 256))  # no weight of its own: not packable
    run.pack_group([unbiased, biased], 6)
    run.pack_group([biased, wrapped], 6)
    assert id(unbiased) in run.packed and id(biased) not in run.packed
    for modules in ([unbiased, biased], [biased, wrapped]):
        for module, out in zip(modules, run.linears(modules, x)):
            torch.testing.assert_close(out, module(x), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])  # bf16 packs every weight: Qwen3 norms q, k from the stack
def test_under_bf16_autocast_the_engine_matches_hf(tokenizer, kind):
    model = make_model(kind, len(tokenizer))
    params = SamplingParams(max_new_tokens=10, do_sample=False)
    pad, eos = tokenizer.pad_token_id, {tokenizer.eos_token_id}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = engine.generate(model, PROMPTS, params, pad, eos)
        hf = hf_generate(model, PROMPTS, params, pad, eos)
    matching = sum(a == b for a, b in zip(ours, hf))
    assert matching >= len(PROMPTS) - 1, (ours, hf)  # bf16 rounding may flip a near-tie in one row at most


def lora_model(vocab: int, **options):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(packable_model(vocab), LoraConfig(r=8, target_modules="all-linear", **options))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.02)  # a non-trivial adapter
    return model.eval()


@pytest.mark.skipif(not PACKS, reason="needs oneDNN packed GEMM")
def test_a_lora_layer_packs_its_merged_weight():
    """A LoRA layer's packed product is one of W + B @ A x scaling: the module's own output."""
    model = lora_model(96)
    mlp = model.get_base_model().model.layers[0].mlp
    run = engine.Decoder(model)
    run.pack_weights(6)
    assert run.packed[id(mlp.gate_proj)][2] == [1024, 1024] and id(mlp.down_proj) in run.packed
    merged = mlp.gate_proj.base_layer.weight + mlp.gate_proj.get_delta_weight("default")
    x = torch.randn(6, 512)
    gate, up = run.linears([mlp.gate_proj, mlp.up_proj], x)
    torch.testing.assert_close(gate, mlp.gate_proj(x), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(gate, x @ merged.T, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(up, mlp.up_proj(x), rtol=1e-4, atol=1e-4)


def test_lora_layers_are_packed_with_their_adapters_merged(tokenizer):
    """A LoRA layer decodes through one packed product of W + B @ A x scaling where packing runs
    (test_a_lora_layer_packs_its_merged_weight): the same greedy tokens as HF's three products, the model's
    weights untouched, and a disabled or DoRA adapter keeps PEFT's own forward."""
    model = lora_model(len(tokenizer))
    mlp = model.get_base_model().model.layers[0].mlp
    before = mlp.gate_proj.base_layer.weight.clone()
    params = SamplingParams(max_new_tokens=12, do_sample=False)
    pad, eos = tokenizer.pad_token_id, {tokenizer.eos_token_id}
    ours = engine.generate(model, PROMPTS, params, pad, eos)
    assert ours == hf_generate(model, PROMPTS, params, pad, eos)
    assert torch.equal(mlp.gate_proj.base_layer.weight, before), "merging happens in the packed copy only"
    with model.disable_adapter():
        assert engine.effective_weight(mlp.gate_proj) is None
        plain = engine.generate(model, PROMPTS, params, pad, eos)
        assert plain == hf_generate(model, PROMPTS, params, pad, eos)
    assert plain != ours, "the adapters change the greedy tokens (else this test shows nothing)"
    dora = lora_model(len(tokenizer), use_dora=True)
    assert engine.effective_weight(dora.get_base_model().model.layers[0].mlp.gate_proj) is None
    assert engine.generate(dora, PROMPTS, params, pad, eos) == hf_generate(dora, PROMPTS, params, pad, eos)


def test_sampling_never_holds_more_than_one_steps_logits():
    """At a large vocabulary the engine's biggest tensors are one decode step's [rows, vocab] logits (and their
    filtered copies within the step) and the head's packed copy [vocab, hidden]: never [rows, steps, vocab]."""
    from tests.unit.test_output_head import LargestTensor

    vocab, rows, steps = 32768, 16, 32
    model = make_model("qwen2", vocab)
    params = SamplingParams(max_new_tokens=steps, do_sample=True, temperature=0.9, top_k=50, top_p=0.95,
                            extra={"min_new_tokens": steps})
    with LargestTensor() as probe:
        out = engine.generate(model, [[5, 6, 7]] * rows, params, 0, {1})
    assert [len(row) for row in out] == [steps] * rows
    one_step = rows * vocab
    head_copy = vocab * model.config.hidden_size
    assert probe.largest <= max(one_step, head_copy) < rows * steps * vocab / 4
