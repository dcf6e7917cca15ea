"""The memory planner (trainers/cli/planner/): byte arithmetic per strategy, recommendations, output, flags."""

import argparse
import json

import pytest

from trainers.errors import ConfigError
from trainers.cli import planner
from trainers.cli.planner import GB, MODEL_SIZES, ModelShape, PlanInputs, Strategy, make_plan, model_state_bytes

# The model of docs/distributed.md's measured tables: Qwen2-shaped, width 2048, 8 layers, byte vocabulary.
SHAPE_303M = ModelShape("303M", 2048, 8, 16, 4, 4464, 259, True, qkv_bias=True)
MODEL_STATES = ("weights", "gradients", "master_weights", "adam_states")


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="trainers plan")
    planner.add_arguments(parser)
    return parser.parse_args(list(argv))


def plan_for(**fields) -> planner.Plan:
    return make_plan(PlanInputs(**fields))


def states(strategy: Strategy, n: int, **fields) -> dict:
    inputs = PlanInputs(model_size="7B", **fields)
    return model_state_bytes(MODEL_SIZES["7B"], inputs, strategy, n)[0]


# ---------------------------------------------------------------------------------------------------- shapes


@pytest.mark.parametrize("size, billions", [("0.5B", 0.494), ("1.5B", 1.544), ("7B", 7.616), ("8B", 8.030),
                                            ("14B", 14.77), ("70B", 70.55)])
def test_the_size_table_gives_the_published_parameter_counts(size, billions):
    assert MODEL_SIZES[size].num_parameters() / 1e9 == pytest.approx(billions, rel=0.005)


def test_a_model_folder_gives_its_shape_and_exact_parameter_count(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    shape = planner.shape_from_folder(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert shape.num_parameters() == sum(p.numel() for p in model.parameters())
    assert (shape.hidden_size, shape.num_layers, shape.vocab_size) == (64, 2, 259)


# ---------------------------------------------------------------------------------------------------- model states


def test_zero3_splits_weights_gradients_and_adam_as_one_over_n():
    full = sum(states(Strategy("deepspeed", 3), 1)[k] for k in MODEL_STATES)
    assert full == 16 * MODEL_SIZES["7B"].num_parameters()  # bf16 2 + grads 2 + fp32 master 4 + Adam 8
    for n in (2, 4, 8, 16):
        per_rank = states(Strategy("deepspeed", 3), n)
        for kind in MODEL_STATES:
            assert per_rank[kind] == pytest.approx(states(Strategy("deepspeed", 3), 1)[kind] / n, abs=1)


def test_zero2_splits_gradients_and_adam_but_keeps_full_weights():
    one, eight = states(Strategy("deepspeed", 2), 1), states(Strategy("deepspeed", 2), 8)
    assert eight["weights"] == one["weights"]
    for kind in ("gradients", "master_weights", "adam_states"):
        assert eight[kind] == pytest.approx(one[kind] / 8, abs=1)
    zero1 = states(Strategy("deepspeed", 1), 8)
    assert zero1["gradients"] == one["gradients"] and zero1["adam_states"] == eight["adam_states"]


def test_ddp_replicates_everything_and_keeps_a_second_gradient_copy():
    ddp = states(Strategy("ddp"), 8)
    params = MODEL_SIZES["7B"].num_parameters()
    assert (ddp["weights"], ddp["gradients"], ddp["adam_states"]) == (4 * params, 4 * params, 8 * params)
    assert ddp["ddp_gradient_buckets"] == 4 * params


def test_offload_moves_model_states_off_the_gpu_but_not_off_the_cpu():
    offload = Strategy("deepspeed", 3, True, True)
    gpu, host = model_state_bytes(MODEL_SIZES["7B"], PlanInputs(model_size="7B"), offload, 8)
    assert sum(gpu[k] for k in MODEL_STATES) == 0
    assert host == pytest.approx(16 * MODEL_SIZES["7B"].num_parameters() / 8, abs=8)
    cpu = states(Strategy("deepspeed", 3, True, True), 2, device="cpu")
    zero3 = states(Strategy("deepspeed", 3), 2, device="cpu")
    assert sum(cpu.values()) > sum(zero3.values())  # on CPU offload cannot go below zero3 (docs/distributed.md)


# ---------------------------------------------------------------------------------------------------- estimates


def test_7b_grpo_full_fine_tuning_does_not_fit_one_80gb_gpu_but_fits_zero3_on_eight():
    one = plan_for(model_size="7B", method="grpo", num_gpus=1, gpu_memory=80)
    assert not one.estimate_for("single_gpu").fits
    eight = plan_for(model_size="7B", method="grpo", num_gpus=8, gpu_memory=80)
    assert eight.estimate_for("zero3").fits
    assert not eight.estimate_for("multi_gpu").fits
    assert eight.recommended == "zero3"  # the cheapest that fits: zero1 and zero2 do not


def test_lora_shrinks_the_estimate():
    full = plan_for(model_size="7B", num_gpus=1, gpu_memory=80)
    lora = plan_for(model_size="7B", num_gpus=1, gpu_memory=80, lora=True)
    for template in ("single_gpu", "zero2", "zero3"):
        assert lora.estimate_for(template).total_bytes < full.estimate_for(template).total_bytes
    assert lora.estimate_for("single_gpu").breakdown["adam_states"] < 0.01 * full.estimate_for(
        "single_gpu").breakdown["adam_states"]


def test_gradient_checkpointing_shrinks_activations():
    for method in ("grpo", "sft"):
        plain = plan_for(model_size="3B", method=method).estimate_for("single_gpu").breakdown["activations"]
        kept = plan_for(model_size="3B", method=method,
                        gradient_checkpointing=True).estimate_for("single_gpu").breakdown["activations"]
        assert kept < plain / 5


def test_activations_grow_with_the_batch_and_the_chunked_head_does_not():
    """The output head is computed a chunk of positions at a time (trainers/model/output_head.py): at Qwen2.5's
    vocabulary its buffers are the same for 2 or 4 rows, and far below full [rows, length, vocab] logits."""
    small = plan_for(model_size="1.5B", method="sft", per_device_batch=2).estimate_for("single_gpu").breakdown
    large = plan_for(model_size="1.5B", method="sft", per_device_batch=4).estimate_for("single_gpu").breakdown
    assert large["activations"] == pytest.approx(2 * small["activations"], rel=0.01)
    for kind in ("logits", "logits_kept", "head_gradient_sum"):
        assert large[kind] == small[kind] > 0
    full_logits = 4 * 1024 * MODEL_SIZES["1.5B"].vocab_size * 4  # rows x max_length x vocab, float32
    assert large["logits"] + large["logits_kept"] < full_logits / 8


def test_a_token_budget_bounds_grpo_activations_whatever_the_batch():
    """GRPOConfig.token_budget: a micro-batch holds at most that many tokens, so 16 rows of 512 + 512 tokens
    plan a quarter of the activations with a budget of 4,096, and 32 rows the same; the launch flags carry it."""
    rows = plan_for(model_size="1.5B", per_device_batch=16)
    budget = plan_for(model_size="1.5B", per_device_batch=16, token_budget=4096)
    doubled = plan_for(model_size="1.5B", per_device_batch=32, token_budget=4096)
    activations = [p.estimate_for("single_gpu").breakdown["activations"] for p in (rows, budget, doubled)]
    assert activations[1] == pytest.approx(activations[0] / 4, rel=0.01) and activations[2] == activations[1]
    assert "--padding_free true --token_budget 4096" in " ".join(planner.trainer_flags(budget.inputs))
    with pytest.raises(ConfigError, match="--token-budget 1000 is invalid; it must be at least"):
        plan_for(model_size="1.5B", token_budget=1000)


def test_preference_methods_plan_both_sides_and_their_reference():
    """dpo and reward forward chosen and rejected together (twice SFT's tokens per row of the batch); dpo and kto
    keep a reference copy (none with LoRA); a reward model has no vocabulary head."""
    plans = {m: plan_for(model_size="1.5B", method=m).estimate_for("zero3").breakdown
             for m in ("sft", "dpo", "reward", "kto")}
    assert plans["dpo"]["activations"] == pytest.approx(2 * plans["sft"]["activations"], rel=0.01)
    assert plans["reward"]["activations"] == plans["dpo"]["activations"]
    assert plans["kto"]["activations"] == plans["sft"]["activations"]
    assert plans["dpo"]["reference_model"] > 0 and plans["kto"]["reference_model"] > 0
    assert plans["sft"].get("reference_model", 0) == plans["reward"].get("reference_model", 0) == 0
    assert "logits" not in plans["reward"] and plans["dpo"]["logits"] > 0
    assert plan_for(model_size="1.5B", method="dpo", lora=True).estimate_for("zero3").breakdown.get(
        "reference_model", 0) == 0
    flags = " ".join(plan_for(model_size="1.5B", method="kto").commands)
    assert "examples/kto.py" in flags and "trainers kto --config kto.yaml" in flags and "--max_length 1024" in flags


def test_rloo_is_planned_as_grpo_with_its_own_commands():
    """RLOO runs on the same sampling base as GRPO: the same memory; its own example and CLI command."""
    rloo, grpo = (plan_for(model_size="1.5B", method=m, beta=0.05) for m in ("rloo", "grpo"))
    assert rloo.estimate_for("zero3").breakdown == grpo.estimate_for("zero3").breakdown
    flags = " ".join(rloo.commands)
    assert "examples/rloo.py" in flags and "trainers rloo --config rloo.yaml" in flags


def test_distillation_holds_its_teacher_sharded_under_zero3_even_with_lora():
    """The teacher is a bf16 copy of its own shape (--teacher-size), partitioned under ZeRO-3 (with its head gathered
    for a micro-batch), kept with LoRA; one completion per prompt; its own example and CLI command."""
    plan = plan_for(model_size="1.5B", method="distill", teacher_size="7B", num_gpus=8, lora=True)
    teacher = MODEL_SIZES["7B"]
    assert plan.estimate_for("zero2").breakdown["teacher_model"] == 2 * teacher.num_parameters()
    zero3 = plan.estimate_for("zero3").breakdown
    assert zero3["teacher_model"] == 2 * teacher.num_parameters() // 8
    assert zero3["teacher_head_copy"] == 2 * teacher.vocab_size * teacher.hidden_size
    assert plan_for(model_size="1.5B", method="distill").estimate_for("zero2").breakdown["teacher_model"] == (
        2 * MODEL_SIZES["1.5B"].num_parameters())  # no teacher given: the model's shape
    flags = " ".join(plan.commands)
    assert "examples/distillation.py" in flags and "trainers distill --config distillation.yaml" in flags
    assert "--teacher_model_name_or_path TEACHER" in flags and "--num_generations" not in flags
    with pytest.raises(ConfigError, match="--teacher"):
        plan_for(model_size="1.5B", method="grpo", teacher_size="7B")


def test_the_grpo_reference_model_is_a_copy_sharded_under_zero3_and_absent_with_lora():
    with_kl = plan_for(model_size="7B", num_gpus=8, beta=0.04, gradient_checkpointing=True)
    params = MODEL_SIZES["7B"].num_parameters()
    assert with_kl.estimate_for("zero2").breakdown["reference_model"] == 2 * params
    assert with_kl.estimate_for("zero3").breakdown["reference_model"] == 2 * params // 8
    lora = plan_for(model_size="7B", num_gpus=8, beta=0.04, lora=True)
    assert all("reference_model" not in e.breakdown for e in lora.estimates)


def test_generation_under_zero3_gathers_the_full_weights_and_fills_a_kv_cache():
    plan = plan_for(model_size="7B", num_gpus=8, gradient_checkpointing=True)
    zero3 = plan.estimate_for("zero3")
    assert zero3.phase == "generation"
    assert zero3.breakdown["gathered_for_generation"] == 2 * MODEL_SIZES["7B"].num_parameters()
    shape = MODEL_SIZES["7B"]  # 8 rows x 28 layers x K,V x 4 kv heads x 128 x 1024 tokens x bf16
    assert zero3.breakdown["kv_cache"] == 8 * shape.num_layers * 2 * 4 * 128 * 1024 * 2


def test_templates_that_cannot_run_are_never_recommended():
    one_gpu = plan_for(model_size="0.5B", num_gpus=1)
    assert not one_gpu.estimate_for("multi_gpu").applicable
    cpu = plan_for(model_size="0.5B", num_gpus=2, device="cpu", gpu_memory=1000)
    assert not cpu.estimate_for("fsdp2").applicable and not cpu.estimate_for("fsdp2").fits
    assert cpu.recommended == "multi_gpu"


def test_the_cheapest_fitting_template_is_recommended_in_cost_order():
    assert plan_for(model_size="0.5B", method="sft", num_gpus=1, gpu_memory=80).recommended == "single_gpu"
    assert plan_for(model_size="0.5B", method="sft", num_gpus=8, gpu_memory=80).recommended == "multi_gpu"
    ranks = [planner.strategy_of({"distributed_type": "DEEPSPEED", "deepspeed_config": {"zero_stage": s}}).cost_rank
             for s in (1, 2, 3)]
    assert ranks == sorted(ranks)
    offload = planner.Strategy("deepspeed", 3, True, True)
    assert offload.cost_rank > planner.Strategy("fsdp", 3).cost_rank


# ---------------------------------------------------------------------------------------------------- CPU calibration


@pytest.mark.parametrize("template, measured", [("multi_gpu", 6.76), ("zero1", 5.13), ("zero2", 5.11),
                                                ("zero3", 4.79), ("zero3_offload", 5.37)])
def test_cpu_estimates_are_within_25_percent_of_the_measured_303m_table(monkeypatch, template, measured):
    """docs/distributed.md: SFT, fp32, 2 processes, micro-batch 4 x 128 tokens, peak RSS per rank."""
    monkeypatch.setattr(planner.plan, "resolve_shape", lambda inputs: SHAPE_303M)  # what make_plan calls
    plan = plan_for(model_size="0.5B", method="sft", num_gpus=2, per_device_batch=4, max_length=128, device="cpu",
                    gpu_memory=24)
    assert plan.estimate_for(template).total_gb == pytest.approx(measured, rel=0.25)


def test_cpu_mode_is_fp32_unless_bf16_is_given():
    assert not PlanInputs(model_size="7B", device="cpu").uses_bf16
    assert PlanInputs(model_size="7B", device="cpu", bf16=True).uses_bf16
    assert PlanInputs(model_size="7B").uses_bf16 and not PlanInputs(model_size="7B", bf16=False).uses_bf16


# ---------------------------------------------------------------------------------------------------- templates


def test_every_shipped_template_maps_to_a_strategy():
    labels = {t.name: t.strategy.label for t in planner.load_templates()}
    assert labels == {"single_gpu": "single", "multi_gpu": "ddp", "zero1": "zero1", "zero2": "zero2",
                      "zero3": "zero3", "zero3_offload": "zero3_offload", "fsdp2": "fsdp2"}


def test_a_new_template_file_shows_up_in_the_plan(tmp_path):
    (tmp_path / "zero2_offload.yaml").write_text(
        "distributed_type: DEEPSPEED\nnum_processes: 8\ndeepspeed_config:\n  zero_stage: 2\n"
        "  offload_optimizer_device: cpu\n  offload_param_device: none\n")
    (tmp_path / "single_gpu.yaml").write_text("distributed_type: 'NO'\nnum_processes: 1\n")
    templates = planner.load_templates(tmp_path)
    plan = make_plan(PlanInputs(model_size="7B", num_gpus=8), templates)
    assert [e.template for e in plan.estimates] == ["single_gpu", "zero2_offload"]
    assert plan.estimate_for("zero2_offload").strategy == "zero2_offload"
    assert plan.estimate_for("zero2_offload").host_bytes > 0


def test_no_template_is_an_error_naming_the_folder_never_nothing_fits(tmp_path, monkeypatch, capsys):
    from trainers.cli import main as cli, templates

    with pytest.raises(templates.TemplatesNotFoundError, match=str(tmp_path)):
        planner.load_templates(tmp_path)
    with pytest.raises(ConfigError, match=r"does not exist"):
        planner.load_templates(tmp_path / "missing")
    with pytest.raises(templates.TemplatesNotFoundError):
        make_plan(PlanInputs(model_size="7B"), [])
    with pytest.raises(templates.TemplatesNotFoundError, match=str(tmp_path)):
        planner.run(parse("--model-size", "7B", "--templates-dir", str(tmp_path)))
    # the shipped folder itself empty (a package installed without its data): the same error, from `trainers plan`
    monkeypatch.setattr(templates, "templates_dir", lambda: tmp_path)
    with pytest.raises(templates.TemplatesNotFoundError, match=f"shipped templates' folder '{tmp_path}'"):
        planner.load_templates()
    assert cli.main(["plan", "--model-size", "7B", "--num-gpus", "8"]) == 2
    captured = capsys.readouterr()
    assert "Nothing fits" not in captured.out and str(tmp_path) in captured.err
    with pytest.raises(ConfigError, match=str(tmp_path)):
        cli.resolve_template("zero3")


def test_the_shipped_templates_are_package_data_and_the_checkout_folder_links_to_them():
    import os

    from tests.conftest import CONFIGS
    from trainers.cli import templates

    folder = templates.templates_dir()
    assert folder.name == "templates" and folder.parent.name == "trainers"
    assert set(templates.shipped_templates()) == {"single_gpu", "multi_gpu", "zero1", "zero2", "zero3",
                                                  "zero3_offload", "fsdp2"}
    assert os.path.realpath(CONFIGS) == str(folder.resolve())  # accelerate_configs/ -> trainers/templates/
    assert templates.is_shipped(os.path.join(CONFIGS, "zero3.yaml"))


def test_a_templates_dir_plans_for_its_files_and_prints_their_paths(tmp_path, capsys):
    (tmp_path / "big.yaml").write_text("distributed_type: DEEPSPEED\nnum_processes: 8\n"
                                       "deepspeed_config:\n  zero_stage: 3\n")
    assert planner.run(parse("--model-size", "7B", "--num-gpus", "8", "--templates-dir", str(tmp_path))) == 0
    text = capsys.readouterr().out
    assert "Recommended: big" in text
    assert f"accelerate launch --config_file {tmp_path / 'big.yaml'} --num_processes 8" in text


# ---------------------------------------------------------------------------------------------------- output


def test_json_names_the_recommended_template_with_breakdowns_and_commands(capsys):
    assert planner.run(parse("--model-size", "7B", "--num-gpus", "8", "--gpu-memory", "80", "--json")) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["recommended"] == "zero3"
    zero3 = next(t for t in data["templates"] if t["template"] == "zero3")
    assert zero3["fits"] and sum(zero3["breakdown"].values()) / GB == pytest.approx(zero3["total_gb"], abs=1e-3)
    assert data["commands"][0].startswith("accelerate launch --config_file accelerate_configs/zero3.yaml "
                                          "--num_processes 8 examples/grpo.py --model PATH")
    assert data["commands"][1].startswith("trainers grpo --config grpo.yaml --model PATH --accelerate_config zero3 "
                                          "--num_processes 8")


def test_json_recommends_nothing_for_70b_on_one_24gb_gpu_and_says_what_would_fit(capsys):
    planner.run(parse("--model-size", "70B", "--num-gpus", "1", "--gpu-memory", "24", "--json"))
    data = json.loads(capsys.readouterr().out)
    assert data["recommended"] is None and data["commands"] == []
    changes = {s["change"]: s for s in data["suggestions"]}
    assert any(c.startswith("LoRA") for c in changes) and "gradient checkpointing" in changes
    assert "per-device batch 1" in changes and any(c.startswith("offload") for c in changes)
    assert all(isinstance(s["total_gb"], float) and isinstance(s["fits"], bool) for s in data["suggestions"])
    assert any(s["fits"] for s in data["suggestions"])  # everything together: LoRA on zero3_offload


def test_the_table_lists_every_template_and_the_launch_commands(capsys):
    planner.run(parse("--model-size", "7B", "--num-gpus", "8"))
    text = capsys.readouterr().out
    for template in ("single_gpu", "multi_gpu", "zero1", "zero2", "zero3", "zero3_offload", "fsdp2"):
        assert f"\n{template} " in text
    assert "Recommended: zero3" in text
    assert "accelerate launch --config_file accelerate_configs/zero3.yaml --num_processes 8 examples/grpo.py" in text


def test_the_table_says_what_would_fit_when_nothing_does():
    text = planner.format_table(plan_for(model_size="70B", num_gpus=1, gpu_memory=24))
    assert "Nothing fits in 24 GB" in text and "LoRA (rank 16)" in text and "does not fit" in text


# ---------------------------------------------------------------------------------------------------- arguments


def test_every_flag_says_its_default():
    parser = argparse.ArgumentParser()
    planner.add_arguments(parser)
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            assert "default" in (action.help or ""), action.option_strings


@pytest.mark.parametrize("argv, message", [
    (["--model-size", "9B"], "argument --model-size: '9B' is not a known size"),
    (["--model-size", "7B", "--model-size", "x"], "argument --model-size"),
    ([], "one of the arguments --model --model-size is required"),
    (["--model-size", "7B", "--method", "ppo"], "argument --method"),
])
def test_bad_arguments_name_the_flag(capsys, argv, message):
    with pytest.raises(SystemExit):
        parse(*argv)
    assert message in capsys.readouterr().err


def test_a_folder_without_config_json_names_model(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parse("--model", str(tmp_path))
    assert "argument --model:" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--model"):
        planner.shape_from_folder(str(tmp_path))


def test_model_and_model_size_together_are_refused(tiny_model_dir, capsys):
    with pytest.raises(SystemExit):
        parse("--model", tiny_model_dir, "--model-size", "7B")
    assert "not allowed with argument --model" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--model PATH .* or --model-size"):
        make_plan(PlanInputs(model=tiny_model_dir, model_size="7B"))


@pytest.mark.parametrize("field, value, flag", [("num_gpus", 0, "--num-gpus"), ("gpu_memory", -1, "--gpu-memory"),
                                                ("per_device_batch", 0, "--per-device-batch"),
                                                ("num_generations", 1, "--num-generations"),
                                                ("beta", -0.1, "--beta")])
def test_invalid_numbers_name_the_flag(field, value, flag):
    with pytest.raises(ConfigError, match=flag):
        make_plan(PlanInputs(model_size="7B", **{field: value}))


def test_a_model_folder_plans_through_the_trainers_command(tiny_model_dir, capsys):
    from trainers.cli.main import main

    assert main(["plan", "--model", tiny_model_dir, "--method", "sft", "--device", "cpu", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["recommended"] == "single_gpu" and data["model"]["hidden_size"] == 64
    assert f"--model {tiny_model_dir}" in data["commands"][0]


def test_a_config_the_planner_cannot_read_names_model(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')  # no intermediate_size
    with pytest.raises(ConfigError, match="--model .*intermediate_size"):
        planner.shape_from_folder(str(tmp_path))


@pytest.mark.parametrize("method", ["grpo", "rloo", "distill"])
def test_fsdp2_is_never_recommended_to_a_trainer_that_samples(method):
    """The sampling trainers refuse fsdp2.yaml (tests/integration/test_errors.py); SFT on GPUs takes it."""
    estimate = plan_for(model_size="7B", method=method, num_gpus=8, gpu_memory=80).estimate_for("fsdp2")
    assert not estimate.applicable and "zero3" in estimate.note
    assert plan_for(model_size="7B", method="sft", num_gpus=8, gpu_memory=80).estimate_for("fsdp2").applicable
