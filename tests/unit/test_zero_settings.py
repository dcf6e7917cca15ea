"""ZeRO settings derived from the model's shape, and the rule that a user's DeepSpeed config wins."""

from types import SimpleNamespace

import torch
from accelerate.utils import DistributedType

from trainers.parallel.distributed import configure_deepspeed, zero_settings


def test_stage3_settings_for_a_300m_model():
    s = zero_settings(3, hidden_size=2048, num_parameters=303_000_000, layer_parameters=37_900_000,
                      largest_parameter=9_000_000)
    assert s["reduce_bucket_size"] == 2048 * 2048  # 16 MB in fp32, not DeepSpeed's 2 GB
    assert s["stage3_prefetch_bucket_size"] == int(0.9 * 2048 * 2048)
    assert s["stage3_param_persistence_threshold"] == 20480
    assert s["stage3_max_live_parameters"] == s["stage3_max_reuse_distance"] == 75_800_000  # two layers
    assert s["sub_group_size"] == 100_000_000
    assert "allgather_bucket_size" not in s


def test_buckets_are_clamped_and_live_parameters_cover_the_largest_tensor():
    tiny = zero_settings(3, hidden_size=64, num_parameters=100_000, layer_parameters=10_000, largest_parameter=500_000)
    assert tiny["reduce_bucket_size"] == 1_000_000  # never below 1e6 elements
    assert tiny["stage3_max_live_parameters"] == 1_000_000  # at least 1e6, and at least the largest tensor
    assert tiny["sub_group_size"] == 1_000_000
    huge = zero_settings(2, hidden_size=65536, num_parameters=10**12, layer_parameters=10**10, largest_parameter=10**9)
    assert huge["reduce_bucket_size"] == huge["allgather_bucket_size"] == 500_000_000  # DeepSpeed's default as cap


def fake_accelerator(zero: dict):
    config = {"zero_optimization": zero, "train_batch_size": "auto"}
    plugin = SimpleNamespace(deepspeed_config=config, zero_stage=zero["stage"])
    return SimpleNamespace(distributed_type=DistributedType.DEEPSPEED, num_processes=2,
                           state=SimpleNamespace(deepspeed_plugin=plugin)), config


def test_configure_fills_batches_clipping_and_zero_settings_but_keeps_user_values():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                         num_key_value_heads=1, intermediate_size=64))
    accelerator, config = fake_accelerator({"stage": 3, "reduce_bucket_size": 12345,
                                            "stage3_prefetch_bucket_size": "auto"})
    applied = configure_deepspeed(accelerator, micro_batch_size=4, gradient_accumulation_steps=3, max_grad_norm=0.5,
                                  model=model)
    assert config["train_micro_batch_size_per_gpu"] == 4 and config["gradient_accumulation_steps"] == 3
    assert config["train_batch_size"] == 4 * 3 * 2 and config["gradient_clipping"] == 0.5
    zero = config["zero_optimization"]
    assert zero["reduce_bucket_size"] == 12345 and "reduce_bucket_size" not in applied  # the user's value stays
    assert zero["stage3_prefetch_bucket_size"] == int(0.9 * 32 * 32)  # "auto" is filled
    assert zero["stage3_param_persistence_threshold"] == 320
    assert applied["stage3_max_live_parameters"] == zero["stage3_max_live_parameters"]


def test_configure_does_nothing_without_deepspeed():
    accelerator = SimpleNamespace(distributed_type=DistributedType.MULTI_CPU)
    assert configure_deepspeed(accelerator, 4, 1, 1.0, model=torch.nn.Linear(2, 2)) == {}
