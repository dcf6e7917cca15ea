"""Every shipped template parses; every CPU-capable one trains SFT with 2 processes to the same result as one
process with the same global batch (the invariance the base trainer promises). One launch per template runs every
variant the tests below compare (tests/distributed/sft_job.py's RUNS, one trainer after the other in the same
processes); the 1-process references share one launch of single_gpu."""

import glob
import json
import os

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests import tiers
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


# template -> the runs its one launch makes (sft_job.py's RUNS), for every test below. "sgd" comes first: its model
# instance is loaded before any Accelerator of the launch exists, as in a script that builds its model first (once a
# ZeRO-3 Accelerator exists, transformers loads every model partitioned). "tensorboard" is last: the job's
# trainer.end() after it ends that run's tracker again, then the process group, as the script of a single run would.
LAUNCHES = {
    "single_gpu": ["one", "one_sgd"],  # the 1-process references: 1 process, per-device 8, no accumulation
    "multi_gpu": ["plain", "split_batches", "moe_plain", "moe_routed"],
    "zero1": ["plain"],
    "zero2": ["sgd", "ddp_option"],
    "zero3": ["sgd", "neftune", "chat_template", "tensorboard"],
    "zero3_offload": ["plain"],
}
# the fast tier runs only the smoke test here (ZeRO-3 against its 1-process reference): those runs alone
SMOKE_LAUNCHES = {"single_gpu": ["one"], "zero3": ["tensorboard"]}


def job_argument(run: str, folder) -> str:
    """sft_job.py's argument for ``run``: its name, or NAME=JSON for a run that needs a folder made here (in the
    launch's ``folder``): the tiny Qwen3-MoE the moe runs train, the donor tokenizer of chat_template."""
    if run.startswith("moe_"):
        from tests.integration.test_trl_contracts import tiny_moe
        from trainers.cli.tiny import build_tokenizer

        if not (folder / "moe").exists():
            tokenizer = build_tokenizer()
            tiny_moe(tokenizer).save_pretrained(folder / "moe")
            tokenizer.save_pretrained(folder / "moe")
        return f"{run}={json.dumps({'model': str(folder / 'moe')})}"
    if run == "chat_template":
        from tests.integration.test_trl_contracts import donor_tokenizer_folder

        donor = donor_tokenizer_folder(folder / "donor")
        return f"{run}={json.dumps({'chat_template_path': donor})}"
    return run


@pytest.fixture(scope="module")
def launched(tiny_model_dir, tmp_path_factory):
    """``launched(template)``: the folder and the finished launch (its output) of the template's one launch, made
    once for the module when a test first needs it; each run's reports and model are in folder/RUN."""
    done = {}

    def get(template: str):
        if template not in done:
            folder = tmp_path_factory.mktemp(template)
            arguments = [job_argument(run, folder) for run in (SMOKE_LAUNCHES if tiers.FAST else LAUNCHES)[template]]
            done[template] = folder, launch(template, JOB, tiny_model_dir, str(folder), *arguments,
                                            num_processes=1 if template == "single_gpu" else 2)
        return done[template]

    return get


@pytest.fixture(scope="module")
def runs(launched):
    """``runs(template, run)``: the reports of one run (one per rank) from the template's launch."""

    def reports(template: str, run: str) -> list[dict]:
        folder, _ = launched(template)
        return rank_reports(folder / run, num_processes=1 if template == "single_gpu" else 2)

    return reports


def saved_model(launched, template: str, run: str) -> dict:
    """The weights the run saved with save_model (its final/ folder)."""
    return load_file(str(launched(template)[0] / run / "final" / "model.safetensors"))


@pytest.fixture(scope="module")
def reference(launched, runs):
    """One process, per-device 8, no accumulation: the same global batch of 8 the 2-process runs use."""
    _, result = launched("single_gpu")
    assert result.returncode == 0
    return runs("single_gpu", "one")[0], saved_model(launched, "single_gpu", "one")


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.smoke) if name == "zero3" else name
                                  for name in CPU_TEMPLATES])  # zero3: the fast tier's ZeRO-3 SFT run
def test_two_processes_match_one(name, launched, reference):
    """(per-device 2, accumulation 2, 2 processes) == (8, 1, 1 process): same losses, same final weights,
    identical weights on both ranks; under ZeRO-3 each rank holds half of the parameters."""
    ref_report, ref_weights = reference
    # a DDP option changes nothing under DeepSpeed, and says so; under ZeRO-3 a tracker's end of training must
    # leave the process group to save_model's gathering (the job calls trainer.end() at its very end)
    run = {"zero2": "ddp_option", "zero3": "tensorboard"}.get(name, "plain")
    folder, result = launched(name)
    if name == "zero2":  # the launch's output: only its ddp_option run sets a DDP option
        assert "options (ddp_find_unused_parameters) change nothing in this run: it uses DEEPSPEED" in \
            result.stdout + result.stderr
    reports = []
    for path in sorted(glob.glob(str(folder / run / "report-*.json"))):  # every rank's, not only those expected
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
        assert glob.glob(str(folder / run / "**" / "events.out.tfevents.*"), recursive=True)
    saved = saved_model(launched, name, run)
    assert saved.keys() == ref_weights.keys()
    for key in ref_weights:
        torch.testing.assert_close(saved[key], ref_weights[key], rtol=1e-4, atol=1e-5)


@pytest.mark.distributed
def test_split_batches_splits_the_per_device_batch_among_processes(launched, runs, reference):
    """accelerator_config's split_batches: per_device_train_batch_size=4 is the batch of both processes together
    (2 each), so with 2 accumulation steps the global batch is 8, the reference's, with the same losses."""
    ref_report, ref_weights = reference
    reports = runs("multi_gpu", "split_batches")
    for report in reports:
        assert report["effective_batch_size"] == 8
        assert report["losses"] == pytest.approx(ref_report["losses"], rel=1e-4)
    assert reports[0]["checksum"] == pytest.approx(reports[1]["checksum"], rel=1e-9)
    saved = saved_model(launched, "multi_gpu", "split_batches")
    for key in ref_weights:
        torch.testing.assert_close(saved[key], ref_weights[key], rtol=1e-4, atol=1e-5)


@pytest.mark.distributed
def test_neftune_noise_reaches_the_embeddings_under_zero3(runs, reference):
    """NEFTune's forward hook sits on the embeddings inside DeepSpeed's engine: the first step's loss (before
    any update) already differs from the noise-free run's, and both processes still train one model."""
    ref_report, _ = reference
    reports = runs("zero3", "neftune")
    assert reports[0]["losses"] == reports[1]["losses"]
    assert abs(reports[0]["losses"][0] - ref_report["losses"][0]) > 1e-3 * ref_report["losses"][0]
    assert reports[0]["checksum"] == pytest.approx(reports[1]["checksum"], rel=1e-9)


@pytest.mark.distributed
def test_a_moe_models_router_loss_joins_the_loss_under_ddp(runs):
    """A tiny Qwen3-MoE under DDP (4 experts, 2 per token): both processes train one model, and the first
    step's loss (before any update) with router_aux_loss_coef=0.5 is the one with 0 plus 0.5 x the logged
    aux_loss, averaged over both processes' micro-batches as the loss is."""
    by_coef = {}
    for coef, run in ((0.0, "moe_plain"), (0.5, "moe_routed")):
        by_coef[coef] = runs("multi_gpu", run)
        assert by_coef[coef][0]["checksum"] == pytest.approx(by_coef[coef][1]["checksum"], rel=1e-9)
    plain, routed = by_coef[0.0][0], by_coef[0.5][0]
    assert not plain["aux_losses"] and len(routed["aux_losses"]) == 5 and routed["aux_losses"][0] > 0
    assert routed["losses"][0] == pytest.approx(plain["losses"][0] + 0.5 * routed["aux_losses"][0], rel=1e-4)


@pytest.mark.distributed
def test_chat_template_path_resizes_a_partitioned_model_under_zero3(launched, runs):
    """zero3.yaml loads the model already partitioned (zero3_init_flag); cloning a donor's template adds its
    tokens and resizes the (tied) embeddings to 320 rows there, each process holding half of the weights."""
    from transformers import AutoTokenizer

    reports = runs("zero3", "chat_template")
    assert reports[0]["checksum"] == pytest.approx(reports[1]["checksum"], rel=1e-9)
    assert reports[0]["losses"][-1] < reports[0]["losses"][0]
    for report in reports:
        assert 0.45 < report["local_numel"] / report["total_numel"] < 0.55
    saved = saved_model(launched, "zero3", "chat_template")
    assert saved["model.embed_tokens.weight"].shape[0] == 320
    tokenizer = AutoTokenizer.from_pretrained(str(launched("zero3")[0] / "chat_template" / "final"))
    assert len(tokenizer.get_vocab()) == 320 and tokenizer.eos_token == "<|end|>"


@pytest.fixture(scope="module")
def sgd_reference(launched, runs):
    """sft_job.py's one_sgd: optimizers=(SGD with momentum, a decaying LambdaLR), one process, per-device 8."""
    return runs("single_gpu", "one_sgd")[0], saved_model(launched, "single_gpu", "one_sgd")


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["zero2", "zero3"])
def test_a_given_optimizer_and_scheduler_train_the_same_under_deepspeed(name, launched, runs, sgd_reference):
    """transformers' optimizers=(SGD with momentum, a decaying LambdaLR) on a model instance: DeepSpeed steps
    that optimizer, on the scheduler's rates, to the losses and weights of one process with the same batch."""
    (one, alone), reports = sgd_reference, runs(name, "sgd")
    assert one["learning_rates"] == pytest.approx([0.05 / (1 + step) for step in range(5)], rel=1e-5)
    assert one["losses"][-1] < one["losses"][0]
    for report in reports:
        assert report["zero_stage"] == int(name[4]) and "SGD" in report["optimizer_classes"]
        assert report["optimizer_classes"][1].startswith("DeepSpeedZero")  # Accelerate's wrapper, then ZeRO's
        assert report["learning_rates"] == pytest.approx(one["learning_rates"])
        assert report["losses"] == pytest.approx(one["losses"], rel=1e-4)
    assert reports[0]["checksum"] == pytest.approx(reports[1]["checksum"], rel=1e-9)
    saved = saved_model(launched, name, "sgd")
    for key in alone:
        torch.testing.assert_close(saved[key], alone[key], rtol=1e-4, atol=1e-5)


@pytest.mark.distributed
def test_fsdp2_on_cpu_fails_clearly(tiny_model_dir, tmp_path):
    """A launch of its own: the job must fail to start."""
    result = launch("fsdp2", JOB, tiny_model_dir, str(tmp_path), "plain", check=False)
    assert result.returncode != 0
    assert "fsdp2.yaml" in result.stderr + result.stdout and "GPU" in result.stderr + result.stdout
