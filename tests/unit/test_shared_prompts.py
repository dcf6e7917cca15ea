"""Completions of one prompt share its forward (trainers/sampling/shared_prompt.py, shared_prompt_logprobs): the same log-probs, entropy and
gradients as one forward over prompt + completion per row, for ragged prompts, padded completions, groups
split across micro-batches, LoRA and bf16 autocast."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from trainers.sampling.batch import MicroBatch, prompt_groups
from trainers.sampling.shared_prompt import shared_prompt_logprobs
from trainers.model.modeling import token_logprobs


def make_model(kind: str = "qwen2"):
    torch.manual_seed(0)
    common = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, max_position_embeddings=128)
    model_class, config_class = {"qwen2": (Qwen2ForCausalLM, Qwen2Config), "llama": (LlamaForCausalLM, LlamaConfig)}[kind]
    return model_class(config_class(**common)).train()


def make_batch(groups=((7, 3), (4, 3), (9, 2)), completion_length=6, pad_id=0):
    """Rows of (prompt length, copies): left-padded prompts, right-padded completions of varied length."""
    torch.manual_seed(1)
    P = max(length for length, _ in groups)
    prompt_ids, prompt_mask = [], []
    for length, copies in groups:
        ids = torch.full((P,), pad_id)
        ids[P - length:] = torch.randint(3, 96, (length,))
        mask = torch.zeros(P, dtype=torch.long)
        mask[P - length:] = 1
        prompt_ids += [ids] * copies
        prompt_mask += [mask] * copies
    B = len(prompt_ids)
    completion_ids = torch.randint(3, 96, (B, completion_length))
    attention = torch.ones(B, completion_length, dtype=torch.long)
    for row in range(0, B, 2):  # every other completion ended early (EOS then padding)
        attention[row, 2 + row % 3:] = 0
    completion_ids[attention == 0] = pad_id
    prompt_ids, prompt_mask = torch.stack(prompt_ids), torch.stack(prompt_mask)
    groups = prompt_groups([ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids, prompt_mask)])
    return MicroBatch(prompt_ids, prompt_mask, completion_ids, attention, torch.tensor(groups),
                      loss_mask=attention.float(), advantages=torch.zeros(B))


def one_forward(model, batch, temperature=1.0):
    input_ids, attention_mask, position_ids = batch.model_inputs()
    return token_logprobs(model, input_ids, batch.completion_ids, attention_mask, position_ids,
                          temperature=temperature, logits_to_keep=batch.completion_ids.shape[1], with_entropy=True)


def shared(model, batch, temperature=1.0):
    return shared_prompt_logprobs(model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                  batch.completion_attention, batch.prompt_group, temperature=temperature,
                                  with_entropy=True)


def run(forward, model, batch, bf16=False, **kwargs):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        out = forward(model, batch, **kwargs)
    mask = batch.completion_attention.float()
    loss = (out["logps"] * mask).sum() / mask.sum() + 0.1 * (out["logps"].exp() * mask).sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, loss.detach(), grads


def assert_same(a, b, rtol, atol, mask):
    (out_a, loss_a, grads_a), (out_b, loss_b, grads_b) = a, b
    keep = mask.bool()
    for key in ("logps", "entropy"):
        assert out_a[key].shape == out_b[key].shape == mask.shape
        assert torch.allclose(out_a[key][keep], out_b[key][keep], rtol=rtol, atol=atol), key
    assert torch.allclose(loss_a, loss_b, rtol=rtol, atol=atol)
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name in grads_a:
        scale = grads_a[name].norm() + 1e-8
        assert (grads_a[name] - grads_b[name]).norm() <= rtol * scale, name


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_same_logps_entropy_and_gradients(kind, temperature):
    model, batch = make_model(kind), make_batch()
    expected = run(one_forward, model, batch, temperature=temperature)
    got = run(shared, model, batch, temperature=temperature)
    assert_same(expected, got, rtol=1e-4, atol=1e-5, mask=batch.completion_attention)


def test_group_split_across_micro_batches_and_single_token_completions():
    """Only some rows share (a group cut by the micro-batch boundary), and completions of one token."""
    model = make_model()
    batch = make_batch(groups=((5, 1), (6, 2), (3, 1)), completion_length=1)
    batch.completion_attention[:] = 1
    assert_same(run(one_forward, model, batch), run(shared, model, batch), 1e-4, 1e-5, batch.completion_attention)


def test_no_shared_prompt_returns_none():
    batch = make_batch(groups=((5, 1), (6, 1), (3, 1)))
    assert shared(make_model(), batch) is None


def test_pad_ids_under_the_mask_do_not_split_a_group():
    """Rows of one group may differ under their padding (masked out): the shared forward runs one of them."""
    model, batch = make_model(), make_batch(groups=((4, 3), (9, 1)))
    batch.prompt_ids[1, :2] = 77  # masked out
    expected, got = run(one_forward, model, batch), run(shared, model, batch)
    assert_same(expected, got, 1e-4, 1e-5, batch.completion_attention)


def assert_same_under_bf16_autocast(forward):
    """``forward`` against one forward per row under bf16 autocast, within bf16's tolerance."""
    model, batch = make_model(), make_batch()
    expected = run(one_forward, model, batch, bf16=True)
    got = run(forward, model, batch, bf16=True)
    assert_same(expected, got, rtol=3e-2, atol=3e-2, mask=batch.completion_attention)


def assert_same_with_lora(forward, target_modules):
    """``forward`` against one forward per row with LoRA adapters on ``target_modules``: the same gradients."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(make_model(), peft.LoraConfig(r=4, target_modules=target_modules))
    with torch.no_grad():  # LoRA's B starts at zero: give the adapters a value so their inputs' gradients matter
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    batch = make_batch()
    assert_same(run(one_forward, model, batch), run(forward, model, batch), 1e-4, 1e-5, batch.completion_attention)


def test_bf16_autocast_within_bf16_tolerance():
    assert_same_under_bf16_autocast(shared)


def test_lora_gradients_match():
    assert_same_with_lora(shared, ["q_proj", "v_proj", "up_proj"])


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
@pytest.mark.parametrize("checkpointing", [
    {},  # every layer, transformers' default (non-reentrant)
    {"every_n_layers": 2},  # layer 0 replayed, layer 1 keeps its activations
])
def test_under_gradient_checkpointing_the_prompt_cache_survives_the_replay(checkpointing, kind):
    """Checkpointed layers replay their forward (cache update included) in backward: the prompt's keys and
    values must be stored once and the replay must see the same cache, else the gradients differ or the
    replay raises (torch checks the recomputed tensors' shapes)."""
    model, batch = make_model(kind), make_batch()
    expected = run(one_forward, model, batch)
    model.activation_checkpointing_enable(**checkpointing)
    replayed = [layer.gradient_checkpointing for layer in model.model.layers]
    assert replayed == ([True, False] if checkpointing.get("every_n_layers") else [True, True])
    got = run(shared, model, batch)
    assert_same(expected, got, rtol=1e-4, atol=1e-5, mask=batch.completion_attention)
    # The layers got transformers' rule back: a cache is dropped under checkpointing outside this forward.
    assert all("_can_checkpoint_with_cache" not in vars(layer) for layer in model.model.layers)
    assert not model.model.layers[0]._can_checkpoint_with_cache


def test_lora_under_gradient_checkpointing():
    """PEFT with checkpointing (transformers makes the embeddings' output require a gradient, so the adapters'
    gradients reach the replayed layers): the adapters' gradients equal the one-forward path's."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(make_model(), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "up_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    batch = make_batch()
    expected = run(one_forward, model, batch)
    model.base_model.model.activation_checkpointing_enable()
    model.enable_input_require_grads()
    assert all(layer.gradient_checkpointing for layer in model.base_model.model.model.layers)
    assert_same(expected, run(shared, model, batch), 1e-4, 1e-5, batch.completion_attention)


def test_reentrant_checkpoints_fall_back_to_one_forward_per_row():
    """A reentrant checkpoint runs the forward without autograd: gradients could not reach the cached prompt
    keys, so the shared forward declines (None) and the caller runs one forward per row."""
    model, batch = make_model(), make_batch()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
    assert shared(model, batch) is None
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"preserve_rng_state": False})
    assert shared(model, batch) is None  # torch's default without use_reentrant is reentrant
    model.eval()  # no replay outside training: sharing is safe again
    with torch.no_grad():
        assert shared(model, batch) is not None
