"""RLOO with 2 processes under the DDP and ZeRO-3 templates: a group split across the processes gets the
leave-one-out advantages of the whole group's KL-penalized rewards, one round KL, one model."""

import os

import pytest
import torch

from tests.conftest import REPO, launch, rank_reports
from trainers.rloo.objective import leave_one_out_advantages

JOB = os.path.join(REPO, "tests", "distributed", "rloo_job.py")


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["multi_gpu", "zero3"])
def test_a_split_group_gets_the_whole_groups_leave_one_out_advantages(name, tiny_model_dir, tmp_path):
    launch(name, JOB, tiny_model_dir, str(tmp_path))
    reports = rank_reports(tmp_path)
    assert [r["zero_stage"] for r in reports] == [3 if name == "zero3" else 0] * 2
    for index in range(3):  # each round: ranks 0 and 1 hold 2 completions each of one prompt's group of 4
        rewards = torch.tensor(reports[0]["rewards"][index] + reports[1]["rewards"][index])
        rounds = [r["rounds"][index] for r in reports]
        kl = torch.tensor(rounds[0]["kl"] + rounds[1]["kl"])
        expected = leave_one_out_advantages(rewards - 0.1 * kl, 4)
        held = rounds[0]["advantages"] + rounds[1]["advantages"]
        assert held == pytest.approx(expected.tolist(), rel=1e-5, abs=1e-6)
        token_mean = float(kl.sum()) / (rounds[0]["tokens"] + rounds[1]["tokens"])
        assert rounds[0]["metrics"]["kl"] == rounds[1]["metrics"]["kl"] == pytest.approx(token_mean, rel=1e-5)
    assert any(abs(k) > 0 for r in reports for k in r["rounds"][-1]["kl"])  # the policy moved from the reference
    assert reports[0]["checksum"] == pytest.approx(reports[1]["checksum"], rel=1e-9)
    assert [r["loss"] for r in reports[0]["history"]] == [r["loss"] for r in reports[1]["history"]]
