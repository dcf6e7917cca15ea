"""The preference trainers with 2 processes under the shipped templates. DPO under DDP and ZeRO-1/2/3, the reward
model under DDP and ZeRO-3: the same training as one process with the same global batch, and under ZeRO-3 a
reference model partitioned like the policy. KTO under ZeRO-3: its KL reference point is one value over both
processes. One launch per template runs every variant the tests below compare (tests/distributed/dpo_job.py's RUNS,
one trainer after the other in the same processes); the 1-process references share one launch of single_gpu."""

import os

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import REPO, launch, rank_reports

JOB = os.path.join(REPO, "tests", "distributed", "dpo_job.py")


# template -> the runs its one launch makes (dpo_job.py's RUNS), for every test below
LAUNCHES = {
    "single_gpu": ["dpo_one_process", "reward_one_process"],  # the 1-process references, per-device 8
    "multi_gpu": ["dpo", "reward"],
    "zero1": ["dpo"],
    "zero2": ["dpo"],
    "zero3": ["dpo", "dpo_precompute", "reward", "kto"],
}


@pytest.fixture(scope="module")
def launched(tiny_model_dir, tmp_path_factory):
    """``launched(template)``: the folder of the template's one launch (every run in LAUNCHES, each in folder/RUN),
    made once for the module when a test first needs it."""
    folders = {}

    def get(template: str):
        if template not in folders:
            folders[template] = tmp_path_factory.mktemp(template)
            launch(template, JOB, tiny_model_dir, str(folders[template]), *LAUNCHES[template],
                   num_processes=1 if template == "single_gpu" else 2)
        return folders[template]

    return get


@pytest.fixture(scope="module")
def one_process(launched):
    """Per method: one process, per-device 8, no accumulation: the global batch of 8 the 2-process runs use."""

    def run(method: str):
        folder = launched("single_gpu") / f"{method}_one_process"
        return rank_reports(folder, num_processes=1)[0], load_file(str(folder / "final" / "model.safetensors"))

    return run


def without_ties(record: dict, reference: dict) -> dict:
    """A step's metrics without DPO's rewards/accuracies where the reference run's rewards/margins is ~0: at the first
    step the policy is its reference, every pair's reward is 0 up to rounding, and which of a pair's two rewards is
    larger (a count: 1/8 apart) is the rounding's (ZeRO-3's precomputed reference log-probs tipped one pair on an
    Intel host)."""
    if abs(reference.get("rewards/margins", 1.0)) < 1e-4:
        return {key: value for key, value in record.items() if key != "rewards/accuracies"}
    return record


@pytest.mark.distributed
@pytest.mark.parametrize("method,name", [("dpo", "multi_gpu"), ("dpo", "zero1"), ("dpo", "zero2"), ("dpo", "zero3"),
                                         ("dpo_precompute", "zero3"), ("reward", "multi_gpu"), ("reward", "zero3")])
def test_two_processes_train_as_one(method, name, launched, one_process):
    """(per-device 2, accumulation 2, 2 processes) == (8, 1, 1 process): the same losses and metrics, the same
    final weights, one model on both ranks; under ZeRO-3 each rank holds half of the reference (DPO) or of the
    model (the reward model and DPO with precompute_ref_log_probs, which have no reference during training:
    each process precomputes half of the reference's log-probs and gathers the rest, and trains as DPO does)."""
    reference_report, reference_weights = one_process("dpo" if method == "dpo_precompute" else method)
    folder = launched(name) / method
    reports = rank_reports(folder)
    stage = {"multi_gpu": 0, "zero1": 1, "zero2": 2, "zero3": 3}[name]
    for report in reports:
        assert report["zero_stage"] == stage
        for record, expected in zip(report["history"], reference_report["history"], strict=True):
            expected = without_ties(expected, expected)
            assert without_ties(record, expected) == pytest.approx(expected, rel=1e-4, abs=1e-6)
        share = report["reference_local_numel"] / report["total_numel"]
        assert (0.45 < share < 0.55) if stage == 3 else share == 1.0
    assert reports[0]["checksum"] == pytest.approx(reports[1]["checksum"], rel=1e-9)
    trained = reference_report["history"][-1]
    assert trained["margin" if method == "reward" else "rewards/margins"] != 0.0  # it trained
    saved = load_file(str(folder / "final" / "model.safetensors"))
    assert saved.keys() == reference_weights.keys()
    for key in reference_weights:  # ZeRO's other reduction order: rounding (1.3e-5 seen), far below 3 steps' moves
        torch.testing.assert_close(saved[key], reference_weights[key], rtol=1e-4, atol=5e-5, msg=key)


@pytest.mark.distributed
def test_kto_shares_its_kl_reference_point_between_processes_under_zero3(launched):
    """KTO's KL estimate is averaged over the processes (a collective per micro-batch, as TRL gathers it): both
    ranks log the same kl and train one model, its reference partitioned."""
    reports = rank_reports(launched("zero3") / "kto")
    assert [r["history"] for r in reports][0] == [r["history"] for r in reports][1]
    assert all("kl" in record and record["loss"] == record["loss"] for record in reports[0]["history"])
    assert reports[0]["checksum"] == pytest.approx(reports[1]["checksum"], rel=1e-9)
    assert all(0.45 < r["reference_local_numel"] / r["total_numel"] < 0.55 for r in reports)
