"""load_best_model_at_end and save_only_model with 2 processes under ZeRO-3 (sharded weights and optimizer)."""

import json
import os

import pytest
from transformers import AutoModelForCausalLM

from tests.conftest import REPO, launch, rank_reports

JOB = os.path.join(REPO, "tests", "distributed", "best_model_job.py")


@pytest.mark.distributed
def test_best_model_and_model_only_checkpoints_under_zero3(tiny_model_dir, tmp_path):
    launch("zero3", JOB, tiny_model_dir, str(tmp_path))
    reports = rank_reports(tmp_path)
    for report in reports:
        evals = report["evals"]
        assert len(evals) == 3 and evals[0] > evals[-1]
        assert report["best_metric"] == pytest.approx(evals[0], rel=1e-5)
        # the sharded engine went back to step 2's weights on both ranks
        assert report["eval_after"] == pytest.approx(report["best_metric"], rel=1e-6)
        assert "save_only_model=True` with `load_best_model_at_end=True` does not work under DeepSpeed" in \
            report["refused"]
    assert sorted(os.listdir(tmp_path / "best")) == ["checkpoint-2", "metrics.jsonl", "training_args.json"]
    # the model-only checkpoint of the last step holds the full (gathered) weights, loadable as a model
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "only" / "checkpoint-6")
    sums = {name: float(p.detach().double().sum()) for name, p in model.named_parameters()}
    assert sums == pytest.approx(reports[0]["final_weights"], rel=1e-6)
    with open(tmp_path / "only" / "checkpoint-3" / "trainer_state.json") as f:
        assert json.load(f)["model_only"] is True
