"""The preference trainers with 2 processes under the shipped templates. DPO under DDP and ZeRO-1/2/3, the reward
model under DDP and ZeRO-3: the same training as one process with the same global batch, and under ZeRO-3 a
reference model partitioned like the policy. KTO under ZeRO-3: its KL reference point is one value over both
processes."""

import os

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import REPO, launch, rank_reports

JOB = os.path.join(REPO, "tests", "distributed", "dpo_job.py")


@pytest.fixture(scope="module")
def one_process(tiny_model_dir, tmp_path_factory):
    """Per method: one process, per-device 8, no accumulation: the global batch of 8 the 2-process runs use."""
    runs = {}

    def run(method: str):
        if method not in runs:
            out = tmp_path_factory.mktemp(f"{method}-one")
            launch("single_gpu", JOB, tiny_model_dir, str(out), "8", "1", method, num_processes=1)
            runs[method] = rank_reports(out, num_processes=1)[0], load_file(str(out / "final" / "model.safetensors"))
        return runs[method]

    return run


@pytest.mark.distributed
@pytest.mark.parametrize("method,name", [("dpo", "multi_gpu"), ("dpo", "zero1"), ("dpo", "zero2"), ("dpo", "zero3"),
                                         ("dpo_precompute", "zero3"), ("reward", "multi_gpu"), ("reward", "zero3")])
def test_two_processes_train_as_one(method, name, tiny_model_dir, tmp_path, one_process):
    """(per-device 2, accumulation 2, 2 processes) == (8, 1, 1 process): the same losses and metrics, the same
    final weights, one model on both ranks; under ZeRO-3 each rank holds half of the reference (DPO) or of the
    model (the reward model and DPO with precompute_ref_log_probs, which have no reference during training:
    each process precomputes half of the reference's log-probs and gathers the rest, and trains as DPO does)."""
    reference_report, reference_weights = one_process("dpo" if method == "dpo_precompute" else method)
    launch(name, JOB, tiny_model_dir, str(tmp_path), "2", "2", method)
    reports = rank_reports(tmp_path)
    stage = {"multi_gpu": 0, "zero1": 1, "zero2": 2, "zero3": 3}[name]
    for report in reports:
        assert report["zero_stage"] == stage
        for record, expected in zip(report["history"], reference_report["history"], strict=True):
            assert record == pytest.approx(expected, rel=1e-4, abs=1e-6)
        share = report["reference_local_numel"] / report["total_numel"]
        assert (0.45 < share < 0.55) if stage == 3 else share == 1.0
    assert reports[0]["checksum"] == pytest.approx(reports[1]["checksum"], rel=1e-9)
    trained = reference_report["history"][-1]
    assert trained["margin" if method == "reward" else "rewards/margins"] != 0.0  # it trained
    saved = load_file(str(tmp_path / "final" / "model.safetensors"))
    assert saved.keys() == reference_weights.keys()
    for key in reference_weights:  # ZeRO's other reduction order: rounding (1.3e-5 seen), far below 3 steps' moves
        torch.testing.assert_close(saved[key], reference_weights[key], rtol=1e-4, atol=5e-5, msg=key)


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
