"""report_to: trackers through Accelerate get every logged metric; bad names and missing packages fail early;
the progress bar and console lines stay concise."""

import glob
import importlib.util

import pytest

from trainers import SFTConfig, SFTTrainer
from trainers.errors import ConfigError
from trainers.cli.tiny import as_sft_rows, reverse_digits_rows
from trainers.loop.trackers import flat_config, numeric_metrics, resolve_report_to
from tests.conftest import config_factory

ROWS = as_sft_rows(reverse_digits_rows(64, seed=1))


config = config_factory(SFTConfig, per_device_train_batch_size=8, learning_rate=1e-3, max_steps=3)


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="tensorboard not installed")
def test_tensorboard_receives_every_logged_loss(tiny_model_dir, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from transformers import TrainerCallback

    class UserMetric(TrainerCallback):  # a user's own metric through trainer.log (transformers' method)
        def on_step_end(self, args, state, control, **kwargs):
            trainer.log({"user_metric": 10.0 * state.global_step})

    trainer = SFTTrainer(model=tiny_model_dir, args=config(tmp_path, report_to="tensorboard", run_name="tb",
                                                          eval_strategy="steps", eval_steps=2, eval_on_start=True),
                         train_dataset=ROWS, eval_dataset=ROWS[:8], callbacks=[UserMetric()])
    trainer.train()
    trainer.log({"after_training": 1.0})  # the trackers are finished: the history keeps it
    assert trainer.state.log_history[-1]["after_training"] == 1.0
    files = glob.glob(str(tmp_path / "out" / "tb" / "**" / "events.out.tfevents.*"), recursive=True)
    assert files, list((tmp_path / "out").rglob("*"))
    scalars = {}
    for path in files:
        events = EventAccumulator(path)
        events.Reload()
        for tag in events.Tags()["scalars"]:
            scalars[tag] = [(e.step, e.value) for e in events.Scalars(tag)]
    logged = [(r["step"], r["loss"]) for r in trainer.state.log_history if "loss" in r]
    assert [s for s, _ in scalars["loss"]] == [s for s, _ in logged] == [1, 2, 3]
    assert [v for _, v in scalars["loss"]] == pytest.approx([v for _, v in logged], rel=1e-5)
    assert "learning_rate" in scalars and "tokens_per_second" in scalars
    evaluated = [(r["step"], r["eval_loss"]) for r in trainer.state.log_history if "eval_loss" in r]
    assert [s for s, _ in scalars["eval_loss"]] == [s for s, _ in evaluated] == [0, 2]  # eval_on_start, step 2
    assert [v for _, v in scalars["eval_loss"]] == pytest.approx([v for _, v in evaluated], rel=1e-5)
    assert scalars["user_metric"] == [(1, 10.0), (2, 20.0), (3, 30.0)] and "after_training" not in scalars
    assert "eval_runtime" in scalars


def test_unknown_tracker_is_an_error_naming_it():
    with pytest.raises(ConfigError, match=r"report_to.*'tensorbored'.*valid"):
        resolve_report_to("tensorbored")
    with pytest.raises(ConfigError, match="tensorbored"):
        resolve_report_to(["tensorboard", "tensorbored"])


def test_a_tracker_whose_package_is_missing_is_an_error_before_loading(tiny_model_dir, tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"'wandb'.*pip install \"trainers\[wandb\]\""):
        SFTTrainer(model=tiny_model_dir, args=config(tmp_path, report_to="wandb"), train_dataset=ROWS)


def test_none_and_all():
    assert resolve_report_to("none") == [] and resolve_report_to([]) == []
    assert set(resolve_report_to("all")) <= {"tensorboard", "trackio", "wandb", "mlflow"}


def test_tracker_values_are_scalars():
    assert flat_config({"a": 1, "b": None, "c": [1, 2], "d": {"x": 1}}) == {"a": 1, "b": "None", "c": "[1, 2]",
                                                                          "d": '{"x": 1}'}
    assert numeric_metrics({"step": 3, "loss": 1.5, "x": float("nan"), "flag": True, "s": "t"}) == {"loss": 1.5}


def test_console_lines_are_concise_and_the_file_has_everything(tiny_model_dir, tmp_path, caplog):
    import json
    import logging

    trainer = SFTTrainer(model=tiny_model_dir, args=config(tmp_path), train_dataset=ROWS)
    logger = logging.getLogger("trainers")
    logger.propagate = True
    try:
        with caplog.at_level(logging.INFO, logger="trainers"):
            trainer.train()
    finally:
        logger.propagate = False
    lines = list(dict.fromkeys(r.getMessage() for r in caplog.records if r.getMessage().startswith("step=")))
    assert len(lines) == 4 and "loss=" in lines[0] and "tokens_per_second=" in lines[0]
    assert "train_runtime=" in lines[-1] and "train_loss=" in lines[-1]  # train()'s summary, as transformers prints
    assert "mean_token_accuracy" not in lines[0]  # in metrics.jsonl, not on the console
    with open(tmp_path / "out" / "metrics.jsonl") as f:
        assert "mean_token_accuracy" in json.loads(f.readline())


def test_health_warnings_are_raised_once_during_training(tiny_model_dir, tmp_path, caplog):
    """A random tiny model with 4-token completions: every completion is truncated, so the run warns, once."""
    import logging

    from trainers import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=str(tmp_path / "grpo"), per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=4, learning_rate=1e-3, max_steps=5, logging_steps=1, save_strategy="no",
                      disable_tqdm=True, seed=0)
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=lambda completions, **kw: [float(len(c)) for c in
                                                                                        completions],
                          args=args, train_dataset=[{"prompt": p} for p in ["abc", "hello", "xyz", "12"]])
    logger = logging.getLogger("trainers")
    logger.propagate = True
    try:
        with caplog.at_level(logging.INFO, logger="trainers"):
            trainer.train()
    finally:
        logger.propagate = False
    warnings = list(dict.fromkeys(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING))
    truncated = [w for w in warnings if w.startswith("health:") and "truncated" in w]
    assert len(truncated) == 1, warnings
    assert "max_completion_length" in truncated[0]  # says what to try


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="tensorboard not installed")
def test_train_keeps_the_process_group_and_end_releases_it(tiny_model_dir, tmp_path, monkeypatch):
    """train() finishes the trackers but keeps the process group, which save_model and evaluate still need
    under DDP and ZeRO (it used to call Accelerate's end_training, which destroys the group); end() releases it."""
    trainer = SFTTrainer(model=tiny_model_dir, args=config(tmp_path, report_to="tensorboard", run_name="tb"),
                         train_dataset=ROWS, eval_dataset=ROWS[:8])
    destroyed, finished = [], []
    monkeypatch.setattr(type(trainer.accelerator.state), "destroy_process_group",
                        lambda self, group=None: destroyed.append(group))
    trainer.train()
    tracker = trainer.accelerator.trackers[0]
    monkeypatch.setattr(type(tracker), "finish", lambda self: finished.append(self.name))
    assert destroyed == []
    assert trainer.evaluate()["eval_loss"] > 0
    trainer.end()
    assert destroyed == [None] and finished == ["tensorboard"]
