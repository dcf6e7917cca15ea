"""Step records and train()'s closing record, as transformers writes them and TRL's trainers fill them.

transformers logs a step record at each multiple of ``logging_steps`` only (not at the last step), and TRL's trainers
merge into the next record (train()'s closing one included) the metrics accumulated since their last record, then
clear them. So with 3 steps: ``logging_steps=1`` gives 3 step records and a closing record without trainer metrics;
``logging_steps=2`` a record at step 2 and a closing record with step 3's metrics; ``logging_strategy="no"`` a closing
record with the mean over the run. One base loop does this for every trainer; the fast tier checks two of them (a
sampling trainer and a preference trainer), the whole suite all seven.
"""

import pytest

from tests.resume_job import build

# transformers' closing record: TrainOutput's metrics, logged with the step
CLOSING = {"train_runtime", "train_samples_per_second", "train_steps_per_second", "total_flos", "train_loss",
           "epoch", "step"}
LOOP = {"loss", "learning_rate", "grad_norm", "nonfinite_steps", "step_time", "tokens_per_second", "num_tokens",
        "step", "epoch"}  # the base loop's own entries of a step record


def run(method, model, out, **extra) -> tuple[list[dict], dict]:
    """A 3-step run of ``method`` (tests/resume_job.py's trainers): its step records and its closing record."""
    trainer = build(method, model, str(out), 3, 1000, {"save_strategy": "no", **extra})
    trainer.train()
    history = trainer.state.log_history
    assert set(CLOSING) <= set(history[-1]) and not any("train_runtime" in r for r in history[:-1])
    return history[:-1], history[-1]


def trainer_metrics(record: dict) -> dict:
    return {name: value for name, value in record.items() if name not in LOOP and name not in CLOSING}


@pytest.mark.parametrize("method", ["grpo", "dpo", *(pytest.param(m, marks=pytest.mark.slow)
                                                     for m in ("rloo", "distill", "sft", "reward", "kto"))])
def test_step_records_and_the_closing_record_follow_trl(method, tiny_model_dir, tmp_path):
    every, closing = run(method, tiny_model_dir, tmp_path / "every", logging_steps=1)
    assert [r["step"] for r in every] == [1, 2, 3]
    metrics = [trainer_metrics(r) for r in every]
    assert all(metrics) and not trainer_metrics(closing)  # logged at the last step: nothing is pending
    if method in ("grpo", "rloo"):  # one generation round per 2 steps (steps_per_generation=2): 2 rewards, once each
        assert [r["step"] for r in every if "reward" in r] == [1, 3]

    records, closing = run(method, tiny_model_dir, tmp_path / "by_two", logging_steps=2)
    assert [r["step"] for r in records] == [2]  # no record forced at the last step
    assert trainer_metrics(closing) == pytest.approx(metrics[2], rel=1e-5)  # step 3's, pending since step 2

    records, closing = run(method, tiny_model_dir, tmp_path / "none", logging_strategy="no")
    assert records == []
    names = dict.fromkeys(name for m in metrics for name in m)
    means = {name: sum(m[name] for m in metrics if name in m) / sum(name in m for m in metrics) for name in names}
    assert trainer_metrics(closing) == pytest.approx(means, rel=1e-5)  # the run's mean


def test_a_learning_rate_of_zero_trains_without_moving_the_weights(tiny_model_dir, tmp_path):
    """transformers and TRL accept learning_rate=0 (a loss or a metric measured through the normal loop)."""
    trainer = build("sft", tiny_model_dir, str(tmp_path), 2, 1000, {"save_strategy": "no", "learning_rate": 0.0})
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train()
    assert all(r["learning_rate"] == 0.0 for r in trainer.state.log_history[:-1])
    assert trainer.state.log_history[-1]["train_loss"] > 0
    for name, p in trainer.model.named_parameters():
        assert p.detach().equal(before[name]), name
