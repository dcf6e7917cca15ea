"""The benchmark harness's arithmetic (benchmarks/compare_trl.py), without running a benchmark: the GPU model's
shape, the parameter count MFU uses, MFU and completion tokens/s, GPU memory ratios; the floor of a GRPO step
(benchmarks/floor.py); and that the variants of benchmarks/generation.py leave the engine as they found it."""

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from benchmarks.compare_trl import MODELS, gpu_extra, matmul_parameters, peak_tflops, summarize
from trainers.cli.tiny import save_tiny_model


def test_gpu_model_has_qwen2_5_0_5b_shape():
    shape = MODELS["qwen05"]
    config = Qwen2Config(vocab_size=shape["vocab_size"], hidden_size=shape["hidden_size"],
                         num_hidden_layers=shape["num_layers"], num_attention_heads=shape["num_heads"],
                         num_key_value_heads=shape["num_kv_heads"], intermediate_size=shape["intermediate_size"],
                         tie_word_embeddings=True)
    with torch.device("meta"):
        assert Qwen2ForCausalLM(config).num_parameters() == 494_032_768  # Qwen/Qwen2.5-0.5B's count


def test_vocab_larger_than_the_tokenizer_and_matmul_parameters(tmp_path):
    path = save_tiny_model(str(tmp_path / "m"), vocab_size=512, hidden_size=32, num_layers=1)
    model = Qwen2ForCausalLM.from_pretrained(path)
    assert model.config.vocab_size == 512
    assert matmul_parameters(path) == model.num_parameters()  # the tied head counted once
    with pytest.raises(ValueError, match="vocab_size=100"):
        save_tiny_model(str(tmp_path / "n"), vocab_size=100)


def runs(s_per_step, tokens_per_step, gpu_mb=None):
    return [{"step_times": [9.0, s_per_step, s_per_step], "num_tokens": 3 * tokens_per_step, "loss": 1.0,
             "peak_mb": 1000.0, **({"peak_gpu_mb": gpu_mb, "device": "NVIDIA H100 80GB HBM3"} if gpu_mb else {})}]


def test_mfu_and_completion_tokens_per_second():
    sft = summarize("sft-qwen05-packed", "sft", {"trl": runs(2.0, 10_000, 4000.0), "ours": runs(1.0, 10_000, 3000.0)},
                    warmup=1, steps=3)
    assert sft["ratio"] == [2.0] and sft["gpu_memory_ratio"] == [0.75]
    peak = peak_tflops(sft["ours"]["device"], None)
    assert peak == 989.4 and peak_tflops("some other GPU", None) is None and peak_tflops("x", 500.0) == 500.0
    # 6 x 494M x 5,000 (TRL) and 10,000 (ours) tokens/s over 989.4 TFLOP/s
    assert gpu_extra(sft, "sft", {}, 494_032_768, peak) == "1.5% / 3.0% MFU"
    assert "--peak-tflops" in gpu_extra(sft, "sft", {}, 494_032_768, None)

    grpo = summarize("grpo-qwen05-256-b64", "grpo", {"trl": runs(4.0, 1), "ours": runs(2.0, 1)}, warmup=1, steps=3)
    assert grpo["ratio"] == [0.5] and "gpu_memory_ratio" not in grpo  # host-only runs carry no GPU numbers
    assert gpu_extra(grpo, "grpo", {"completion_length": 256, "batch": 64}, 0, None) == \
        "4096 / 8192 completion tok/s"


def test_gpu_table_prints_every_column(capsys):
    from benchmarks.compare_trl import print_table

    row = summarize("sft-qwen05-packed", "sft", {"trl": runs(2.0, 10_000, 4000.0), "ours": runs(1.0, 10_000, 3000.0)},
                    warmup=1, steps=3)
    print_table([row], {"sft-qwen05-packed": "sft"}, {"sft-qwen05-packed": "1.5% / 3.0% MFU"})
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line == ("| sft-qwen05-packed | NVIDIA H100 80GB HBM3 | 5000 tok/s | 10000 tok/s | 2.00 | 1.5% / 3.0% MFU | "
                    "4000 | 3000 | 0.75 | 1.000 / 1.000 |")


def test_run_one_extra_overrides_the_defaults_and_lora_is_shared():
    """--extra may change a field the harness also sets (it raised 'multiple values' for beta before), and
    --lora gives both frameworks the same adapters."""
    import argparse

    from benchmarks.run_one import grpo_args, lora_config, sft_args

    cli = argparse.Namespace(out="/tmp/x", method="grpo", steps=3, bf16=False, batch=16, max_length=256, packing=False,
                             num_generations=8, completion_length=64, lora=8,
                             extra={"beta": 0.04, "gradient_checkpointing": True, "learning_rate": 3e-5})
    grpo = grpo_args(cli)
    assert (grpo["beta"], grpo["gradient_checkpointing"], grpo["learning_rate"]) == (0.04, True, 3e-5)
    assert grpo["generation_kwargs"] == {"min_new_tokens": 64} and grpo["num_generations"] == 8
    assert sft_args(cli)["learning_rate"] == 3e-5 and sft_args(cli)["max_length"] == 256
    rloo = argparse.Namespace(**{**vars(cli), "method": "rloo", "extra": {}})
    assert grpo_args(rloo)["beta"] == 0.05 and grpo_args(argparse.Namespace(**{**vars(rloo), "method": "grpo"}))[
        "beta"] == 0.0  # RLOO's row has TRL's RLOO default, GRPO's none
    lora = lora_config(cli)
    assert (lora.r, lora.lora_alpha, lora.target_modules) == (8, 16, "all-linear")
    assert lora_config(argparse.Namespace(lora=0)) is None


def test_generation_variants_patch_the_engine_and_restore_it_as_it_was():
    import inspect

    from benchmarks.generation import patched, with_compiled_elementwise
    from trainers.generation import engine

    def state():
        return {"rms_norm": engine.rms_norm, **{name: inspect.getattr_static(engine.Decoder, name)
                                                for name in ("_rope", "mlp")}}

    before, seen = state(), {}
    with_compiled_elementwise(lambda: seen.update(state()))()  # torch.compile is lazy: nothing compiles here
    assert all(seen[name] is not before[name] for name in before)
    after = state()
    assert after == before and isinstance(after["_rope"], staticmethod)  # not the bare function getattr returns
    patched(engine.Decoder, "_rope", staticmethod(lambda x, cos, sin: x), lambda: None)()
    assert inspect.getattr_static(engine.Decoder, "_rope") is before["_rope"]


def test_grpo_floor_counts_the_products_no_step_can_skip():
    """benchmarks/floor.py: training is 6 FLOPs per weight and completion token; each of the L - 1 decode steps
    takes the longer of reading every weight and multiplying it for every row."""
    from benchmarks.floor import Rates, grpo_floor, training_shapes

    rates = Rates(flops_per_s=1e11, bytes_per_s=2e10)
    floor = grpo_floor(weights=10**8, batch=16, completion_length=256, rates=rates, bytes_per_weight=4)
    assert floor.train_s == pytest.approx(6 * 1e8 * 16 * 256 / 1e11)  # 24.576 s
    # per decode step: 3.2 GFLOP at 100 GFLOP/s (32 ms) takes longer than reading 400 MB at 20 GB/s (20 ms)
    assert floor.sample_s == pytest.approx(255 * 2 * 1e8 * 16 / 1e11)  # the arithmetic bounds it: 8.16 s
    reading = grpo_floor(weights=10**8, batch=4, completion_length=256, rates=rates, bytes_per_weight=4)
    assert reading.sample_s == pytest.approx(255 * 4e8 / 2e10)  # 4 rows: reading the weights bounds it: 5.1 s
    halved = grpo_floor(weights=10**8, batch=4, completion_length=256, rates=rates, bytes_per_weight=2)
    assert halved.sample_s == pytest.approx(reading.sample_s / 2)  # bf16 weights: half the bytes
    assert floor.total_s == pytest.approx(floor.train_s + floor.sample_s)
    # the product shapes measured: forward, both backward products of the MLP, and a square one
    assert training_shapes({"hidden_size": 768, "intermediate_size": 2048}, 4096) == \
        [(4096, 768, 2048), (4096, 2048, 768), (768, 4096, 2048), (2048, 2048, 2048)]
