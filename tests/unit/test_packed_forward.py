"""GRPO's padding-free forward (trainers/sampling/packed_forward.py, GRPOConfig.padding_free): a micro-batch's
sequences packed into one row give the padded forward's log-probs, entropy and gradients, for ragged prompts and
completions, temperature, bf16 autocast, LoRA and an MoE model's router loss."""

import pytest
import torch

from tests.unit.test_shared_prompts import (
    assert_same,
    assert_same_under_bf16_autocast,
    assert_same_with_lora,
    make_batch,
    make_model,
    one_forward,
    run,
)
from trainers.sampling.batch import MicroBatch
from trainers.sampling.packed_forward import packed_logprobs
from trainers.model.output_head import plan_head


def packed(model, batch, temperature=1.0, **options):
    return packed_logprobs(model, plan_head(model), batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                           batch.completion_attention, temperature=temperature, with_entropy=True, **options)


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_same_logps_entropy_and_gradients(kind, temperature):
    model, batch = make_model(kind), make_batch()
    padding = 1 - batch.completion_attention.float().mean()
    assert padding > 0.2  # the packed row leaves that much out
    expected = run(one_forward, model, batch, temperature=temperature)
    got = run(packed, model, batch, temperature=temperature)
    assert_same(expected, got, rtol=1e-4, atol=1e-5, mask=batch.completion_attention)
    assert torch.all(got[0]["logps"][batch.completion_attention == 0] == 0)  # padding scores 0


def test_single_token_completions_and_one_row():
    model = make_model()
    batch = make_batch(groups=((5, 1), (1, 2)), completion_length=1)
    batch.completion_attention[:] = 1
    assert_same(run(one_forward, model, batch), run(packed, model, batch), 1e-4, 1e-5, batch.completion_attention)
    one = make_batch(groups=((7, 1),))
    assert_same(run(one_forward, model, one), run(packed, model, one), 1e-4, 1e-5, one.completion_attention)


@pytest.mark.parametrize("groups", [((7, 3), (4, 3), (9, 2)), ((0, 2), (3, 1))])
def test_host_counts_select_what_the_masks_do(groups):
    """Given the micro-batch's counts as host integers (RowWidths.counts, read once per round), the packed forward
    selects the same positions as when it reads the masks: the same scores, bit for bit, also for rows without
    prompt tokens (whose first completion token no real position predicts) and without completion tokens."""
    model, batch = make_model(), make_batch(groups=groups)
    batch.completion_attention[-1] = 0  # a row without completion tokens
    batch = MicroBatch(**batch.init_fields() | {"widths": None})  # its widths read again, from the new mask
    read, given = packed(model, batch), packed(model, batch, counts=batch.widths.counts())
    for key in ("logps", "entropy"):
        assert torch.equal(read[key], given[key]), key


def test_bf16_autocast_within_bf16_tolerance():
    assert_same_under_bf16_autocast(packed)


def test_lora_gradients_match():
    assert_same_with_lora(packed, ["q_proj", "v_proj", "lm_head"])  # the head's adapter added per chunk


def test_moe_router_loss_counts_real_tokens_only():
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen2MoeForCausalLM(Qwen2MoeConfig(
        vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4,
        num_experts_per_tok=2, max_position_embeddings=128)).train()
    batch = make_batch()
    out = packed(model, batch, with_router_loss=True)
    assert out["aux_loss"].requires_grad and out["aux_loss"] > 0
    expected = one_forward(model, batch)
    keep = batch.completion_attention.bool()
    torch.testing.assert_close(out["logps"][keep], expected["logps"][keep], rtol=1e-4, atol=1e-5)
