"""Every shipped template parses; every CPU-capable one trains SFT with 2 processes to the same result as one
process with the same global batch (the invariance the base trainer promises)."""

import glob
import json
import os

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.conftest import CONFIGS, REPO, launch, rank_reports

JOB = os.path.join(REPO, "tests", "distributed", "sft_job.py")
TEMPLATES = ["single_gpu", "multi_gpu", "zero1", "zero2", "zero3", "zero3_offload", "fsdp2"]
CPU_TEMPLATES = ["multi_gpu", "zero1", "zero2", "zero3", "zero3_offload"]


@pytest.mark.parametrize("name", TEMPLATES)
def test_template_parses_and_documents_itself(name):
    from accelerate.commands.config.config_args import load_config_from_file

    path = os.path.join(CONFIGS, f"{name}.yaml")
    with open(path) as f:
        text = f.read()
    raw = yaml.safe_load(text)
    config = load_config_from_file(path)
    assert raw["num_processes"] == (1 if name == "single_gpu" else 8)
    assert config.num_processes == raw["num_processes"]
    header = [line for line in text.splitlines() if line.startswith("#")]
    assert any("Pick it when" in line for line in header), "each template says when to pick it"
    assert any("bytes/param" in line or "bytes per param" in line for line in header), "and what it costs"
    if name.startswith("zero"):
        assert raw["deepspeed_config"]["zero_stage"] == int(name[4])
    if name == "zero3_offload":
        assert raw["deepspeed_config"]["offload_optimizer_device"] == "cpu"
        assert raw["deepspeed_config"]["offload_param_device"] == "cpu"


@pytest.fixture(scope="module")
def reference(tiny_model_dir, tmp_path_factory):
    """One process, per-device 8, no accumulation: the same global batch of 8 the 2-process runs use."""
    out = str(tmp_path_factory.mktemp("reference"))
    result = launch("single_gpu", JOB, tiny_model_dir, out, "8", "1", num_processes=1)
    assert result.returncode == 0
    with open(os.path.join(out, "report-0.json")) as f:
        report = json.load(f)
    return report, load_file(os.path.join(out, "final", "model.safetensors"))


@pytest.mark.distributed
@pytest.mark.parametrize("name", CPU_TEMPLATES)
def test_two_processes_match_one(name, tiny_model_dir, tmp_path, reference):
    """(per-device 2, accumulation 2, 2 processes) == (8, 1, 1 process): same losses, same final weights,
    identical weights on both ranks; under ZeRO-3 each rank holds half of the parameters."""
    ref_report, ref_weights = reference
    # a DDP option changes nothing under DeepSpeed, and says so; under ZeRO-3 a tracker's end of training must
    # leave the process group to save_model's gathering (the job calls trainer.end() at its very end)
    extra = {"zero2": ["ddp_find_unused_parameters=true"], "zero3": ['report_to="tensorboard"']}.get(name, [])
    result = launch(name, JOB, tiny_model_dir, str(tmp_path), "2", "2", *extra)
    if name == "zero2":
        assert "options (ddp_find_unused_parameters) change nothing in this run: it uses DEEPSPEED" in \
            result.stdout + result.stderr
    reports = []
    for path in sorted(glob.glob(str(tmp_path / "report-*.json"))):
        with open(path) as f:
            reports.append(json.load(f))
    assert [r["rank"] for r in reports] == [0, 1]
    for report in reports:
        assert report["num_processes"] == 2
        assert report["effective_batch_size"] == 8
        assert report["zero_stage"] == (int(name[4]) if name.startswith("zero") else 0)
        assert report["model_class"] == "Qwen2ForCausalLM" and "sft" in report["model_tags"]
        assert report["model_wrapped_class"] == ("DeepSpeedEngine" if name.startswith("zero")
                                                 else "DistributedDataParallel")
        assert report["losses"] == pytest.approx(ref_report["losses"], rel=1e-4)
    # the processes train one model, not two
    assert reports[0]["checksum"] == pytest.approx(reports[1]["checksum"], rel=1e-9)
    if name.startswith("zero3"):
        for report in reports:
            share = report["local_numel"] / report["total_numel"]
            assert 0.45 < share < 0.55, share
    if name == "zero3":
        assert glob.glob(str(tmp_path / "**" / "events.out.tfevents.*"), recursive=True)
    saved = load_file(str(tmp_path / "final" / "model.safetensors"))
    assert saved.keys() == ref_weights.keys()
    for key in ref_weights:
        torch.testing.assert_close(saved[key], ref_weights[key], rtol=1e-4, atol=1e-5)


@pytest.mark.distributed
def test_split_batches_splits_the_per_device_batch_among_processes(tiny_model_dir, tmp_path, reference):
    """accelerator_config's split_batches: per_device_train_batch_size=4 is the batch of both processes together
    (2 each), so with 2 accumulation steps the global batch is 8, the reference's, with the same losses."""
    ref_report, ref_weights = reference
    launch("multi_gpu", JOB, tiny_model_dir, str(tmp_path), "4", "2", 'accelerator_config={"split_batches": true}')
    reports = rank_reports(tmp_path)
    for report in reports:
        assert report["effective_batch_size"] == 8
        assert report["losses"] == pytest.approx(ref_report["losses"], rel=1e-4)
    assert reports[0]["checksum"] == pytest.approx(reports[1]["checksum"], rel=1e-9)
    saved = load_file(str(tmp_path / "final" / "model.safetensors"))
    for key in ref_weights:
        torch.testing.assert_close(saved[key], ref_weights[key], rtol=1e-4, atol=1e-5)


@pytest.mark.distributed
def test_neftune_noise_reaches_the_embeddings_under_zero3(tiny_model_dir, tmp_path, reference):
    """NEFTune's forward hook sits on the embeddings inside DeepSpeed's engine: the first step's loss (before
    any update) already differs from the noise-free run's, and both processes still train one model."""
    ref_report, _ = reference
    launch("zero3", JOB, tiny_model_dir, str(tmp_path), "2", "2", "neftune_noise_alpha=5")
    reports = rank_reports(tmp_path)
    assert reports[0]["losses"] == reports[1]["losses"]
    assert abs(reports[0]["losses"][0] - ref_report["losses"][0]) > 1e-3 * ref_report["losses"][0]
    assert reports[0]["checksum"] == pytest.approx(reports[1]["checksum"], rel=1e-9)


@pytest.mark.distributed
def test_a_moe_models_router_loss_joins_the_loss_under_ddp(tmp_path):
    """A tiny Qwen3-MoE under DDP (4 experts, 2 per token): both processes train one model, and the first
    step's loss (before any update) with router_aux_loss_coef=0.5 is the one with 0 plus 0.5 x the logged
    aux_loss, averaged over both processes' micro-batches as the loss is."""
    from tests.integration.test_trl_contracts import tiny_moe
    from trainers.cli.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    tiny_moe(tokenizer).save_pretrained(tmp_path / "moe")
    tokenizer.save_pretrained(tmp_path / "moe")
    runs = {}
    for coef in (0.0, 0.5):
        out = tmp_path / str(coef)
        launch("multi_gpu", JOB, str(tmp_path / "moe"), str(out), "2", "2", f"router_aux_loss_coef={coef}")
        runs[coef] = rank_reports(out)
        assert runs[coef][0]["checksum"] == pytest.approx(runs[coef][1]["checksum"], rel=1e-9)
    plain, routed = runs[0.0][0], runs[0.5][0]
    assert not plain["aux_losses"] and len(routed["aux_losses"]) == 5 and routed["aux_losses"][0] > 0
    assert routed["losses"][0] == pytest.approx(plain["losses"][0] + 0.5 * routed["aux_losses"][0], rel=1e-4)


@pytest.mark.distributed
def test_chat_template_path_resizes_a_partitioned_model_under_zero3(tiny_model_dir, tmp_path):
    """zero3.yaml loads the model already partitioned (zero3_init_flag); cloning a donor's template adds its
    tokens and resizes the (tied) embeddings to 320 rows there, each process holding half of the weights."""
    from transformers import AutoTokenizer

    from tests.integration.test_trl_contracts import donor_tokenizer_folder

    donor = donor_tokenizer_folder(tmp_path / "donor")
    launch("zero3", JOB, tiny_model_dir, str(tmp_path / "run"), "2", "2", f'chat_template_path="{donor}"')
    reports = rank_reports(tmp_path / "run")
    assert reports[0]["checksum"] == pytest.approx(reports[1]["checksum"], rel=1e-9)
    assert reports[0]["losses"][-1] < reports[0]["losses"][0]
    for report in reports:
        assert 0.45 < report["local_numel"] / report["total_numel"] < 0.55
    saved = load_file(str(tmp_path / "run" / "final" / "model.safetensors"))
    assert saved["model.embed_tokens.weight"].shape[0] == 320
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "run" / "final"))
    assert len(tokenizer.get_vocab()) == 320 and tokenizer.eos_token == "<|end|>"


SGD = {"SFT_JOB_OPTIMIZER": "sgd"}  # sft_job.py: optimizers=(SGD with momentum, a decaying LambdaLR)


@pytest.fixture(scope="module")
def sgd_reference(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("sgd-reference")
    launch("single_gpu", JOB, tiny_model_dir, str(out), "8", "1", num_processes=1, extra_env=SGD)
    return rank_reports(out, num_processes=1)[0], load_file(str(out / "final" / "model.safetensors"))


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["zero2", "zero3"])
def test_a_given_optimizer_and_scheduler_train_the_same_under_deepspeed(name, tiny_model_dir, tmp_path,
                                                                       sgd_reference):
    """transformers' optimizers=(SGD with momentum, a decaying LambdaLR) on a model instance: DeepSpeed steps
    that optimizer, on the scheduler's rates, to the losses and weights of one process with the same batch."""
    launch(name, JOB, tiny_model_dir, str(tmp_path), "2", "2", extra_env=SGD)
    (one, alone), reports = sgd_reference, rank_reports(tmp_path)
    assert one["learning_rates"] == pytest.approx([0.05 / (1 + step) for step in range(5)], rel=1e-5)
    assert one["losses"][-1] < one["losses"][0]
    for report in reports:
        assert report["zero_stage"] == int(name[4]) and "SGD" in report["optimizer_classes"]
        assert report["optimizer_classes"][1].startswith("DeepSpeedZero")  # Accelerate's wrapper, then ZeRO's
        assert report["learning_rates"] == pytest.approx(one["learning_rates"])
        assert report["losses"] == pytest.approx(one["losses"], rel=1e-4)
    assert reports[0]["checksum"] == pytest.approx(reports[1]["checksum"], rel=1e-9)
    saved = load_file(str(tmp_path / "final" / "model.safetensors"))
    for key in alone:
        torch.testing.assert_close(saved[key], alone[key], rtol=1e-4, atol=1e-5)


@pytest.mark.distributed
def test_fsdp2_on_cpu_fails_clearly(tiny_model_dir, tmp_path):
    result = launch("fsdp2", JOB, tiny_model_dir, str(tmp_path), "2", "2", check=False)
    assert result.returncode != 0
    assert "fsdp2.yaml" in result.stderr + result.stdout and "GPU" in result.stderr + result.stdout
