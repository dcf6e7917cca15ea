"""compute_metrics and predict() under 2 processes (multi_gpu.yaml: DDP, zero2.yaml and zero3.yaml, over gloo on CPU)
see every eval row once, in dataset order, as a 1-process run does: the processes' uneven shares are gathered and
put back in order. A compute_loss_func's num_items_in_batch counts every process's tokens: its NLL trains as the
built-in one."""

import os

import pytest

from tests.conftest import REPO, launch, rank_reports
from tests.distributed.metrics_job import run

JOB = os.path.join(REPO, "tests", "distributed", "metrics_job.py")


def scored(argmax: list, alone: dict) -> list:
    """The predicted tokens at the positions before a scored label (logits[t] predicts labels[t + 1])."""
    return [[p for p, label in zip(row[:-1], labels[1:]) if label != -100]
            for row, labels in zip(argmax, alone["label_ids"])]


@pytest.mark.distributed
@pytest.mark.parametrize("template", ["multi_gpu", "zero2", "zero3"])
def test_compute_metrics_and_predict_see_every_row_in_order_on_two_processes(tiny_model_dir, tmp_path, template):
    launch(template, JOB, tiny_model_dir, str(tmp_path), timeout=300)
    alone = run(tiny_model_dir, str(tmp_path / "alone"))
    assert alone["eval_rows"] == 5 and len(alone["label_ids"]) == 5
    for report in rank_reports(tmp_path):
        assert report["eval_rows"] == 5
        assert report["label_ids"] == alone["label_ids"] == report["predict_labels"]
        # where a token is scored (padding differs: each process pads its batch to its own rows)
        assert scored(report["argmax"], alone) == scored(alone["argmax"], alone) == scored(report["predict_argmax"], alone)
        assert report["eval_loss"] == pytest.approx(alone["eval_loss"], rel=1e-4)
        assert report["test_loss"] == pytest.approx(alone["eval_loss"], rel=1e-4)
        # each row carries its own process's batch loss: rows 0 and 2 were rank 0's first batch, 1 and 3 rank 1's
        losses = report["losses"]
        assert len(losses) == 5 and losses[0] == losses[2] != losses[1] == losses[3]
    assert alone["losses"][0] == alone["losses"][1] != alone["losses"][2]  # alone: rows 0 and 1 were one batch
    for report in rank_reports(tmp_path):
        assert len(report["losses_user"]) == 2
        assert report["losses_user"] == pytest.approx(report["losses_builtin"], rel=1e-5)
