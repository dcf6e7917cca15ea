"""DPO with 2 processes under the DDP and ZeRO-3 templates: the same training as one process with the same
global batch, and under ZeRO-3 a reference model partitioned like the policy. KTO under ZeRO-3: its KL
reference point is one value over both processes."""

import os

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import REPO, launch, rank_reports

JOB = os.path.join(REPO, "tests", "distributed", "dpo_job.py")


@pytest.fixture(scope="module")
def one_process(tiny_model_dir, tmp_path_factory):
    """One process, per-device 8, no accumulation: the global batch of 8 the 2-process runs use."""
    out = tmp_path_factory.mktemp("dpo-one")
    launch("single_gpu", JOB, tiny_model_dir, str(out), "8", "1", num_processes=1)
    return rank_reports(out, num_processes=1)[0], load_file(str(out / "final" / "model.safetensors"))


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["multi_gpu", "zero3"])
def test_two_processes_train_as_one(name, tiny_model_dir, tmp_path, one_process):
    """(per-device 2, accumulation 2, 2 processes) == (8, 1, 1 process): the same losses and metrics, the same
    final weights, one model on both ranks; under ZeRO-3 each rank holds half of the reference."""
    reference_report, reference_weights = one_process
    launch(name, JOB, tiny_model_dir, str(tmp_path), "2", "2")
    reports = rank_reports(tmp_path)
    for report in reports:
        assert report["zero_stage"] == (3 if name == "zero3" else 0)
        for record, expected in zip(report["history"], reference_report["history"], strict=True):
            assert record == pytest.approx(expected, rel=1e-4, abs=1e-6)
        share = report["reference_local_numel"] / report["total_numel"]
        assert (0.45 < share < 0.55) if name == "zero3" else share == 1.0
    assert reports[0]["checksum"] == pytest.approx(reports[1]["checksum"], rel=1e-9)
    assert reference_report["history"][-1]["rewards/margins"] != 0.0  # it trained
    saved = load_file(str(tmp_path / "final" / "model.safetensors"))
    for key in reference_weights:
        torch.testing.assert_close(saved[key], reference_weights[key], rtol=1e-4, atol=1e-5)


@pytest.mark.distributed
def test_kto_shares_its_kl_reference_point_between_processes_under_zero3(tiny_model_dir, tmp_path):
    """KTO's KL estimate is averaged over the processes (a collective per micro-batch, as TRL gathers it): both
    ranks log the same kl and train one model, its reference partitioned."""
    launch("zero3", JOB, tiny_model_dir, str(tmp_path), "4", "1", "kto")
    reports = rank_reports(tmp_path)
    assert [r["history"] for r in reports][0] == [r["history"] for r in reports][1]
    assert all("kl" in record and record["loss"] == record["loss"] for record in reports[0]["history"])
    assert reports[0]["checksum"] == pytest.approx(reports[1]["checksum"], rel=1e-9)
    assert all(0.45 < r["reference_local_numel"] / r["total_numel"] < 0.55 for r in reports)
