"""ZeRO-3 must partition model states: each of N ranks holds at most 1/N of them, plus a small stated margin.

Model states here: parameters, fp32 master weights, gradients and Adam's two moments, counted from the
tensors each rank actually holds (benchmarks/memory_probe.py). In fp32 DeepSpeed keeps a master copy beside the
parameters, so the full set is 4 + 4 + 4 + 8 = 20 bytes per parameter; each of 2 ranks may hold half.
"""

import os

import pytest

from tests.conftest import REPO, launch, rank_reports

JOB = os.path.join(REPO, "benchmarks", "memory_job.py")
GB = 1024 ** 3
MARGIN = 0.05  # 5%: replicated small tensors below the persistence threshold (norms), partition padding


def per_rank_states(template, model, out):
    launch(template, JOB, "--model", model, "--method", "sft", "--steps", "1", "--per_device", "2",
           "--seq_len", "32", "--bf16", "false", "--out", str(out))
    return rank_reports(out, "memory")


@pytest.mark.distributed
def test_zero3_holds_one_nth_of_the_model_states_per_rank(tiny_model_dir, tmp_path):
    reports = per_rank_states("zero3", tiny_model_dir, tmp_path / "zero3")
    params = reports[0]["num_parameters"]
    full = 20 * params  # bytes of all model states on one process
    for report in reports:
        assert report["zero_stage"] == 3 and report["num_processes"] == 2
        states = report["model_states_gb"]
        held = sum(v for k, v in states.items() if k != "gathered_parameters") * GB
        assert held <= full / 2 * (1 + MARGIN), (held, full / 2, states)
        assert held >= full / 2 * (1 - MARGIN), "the accounting must see every kind of state"
        for kind, bytes_per_param in (("parameters", 4), ("master_weights", 4), ("gradients", 4),
                                      ("optimizer_states", 8)):
            assert states[kind] * GB <= bytes_per_param * params / 2 * (1 + MARGIN), kind


@pytest.mark.distributed
def test_the_accounting_sees_replication_under_ddp(tiny_model_dir, tmp_path):
    """Control: DDP replicates, so a rank holds all parameters and Adam states (12 bytes/param after zero_grad)."""
    reports = per_rank_states("multi_gpu", tiny_model_dir, tmp_path / "ddp")
    params = reports[0]["num_parameters"]
    for report in reports:
        held = sum(report["model_states_gb"].values()) * GB
        assert held == pytest.approx(12 * params, rel=0.02)
