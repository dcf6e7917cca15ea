"""callbacks: transformers' TrainerCallback contract. The events fire in transformers' order with its arguments,
the TrainerControl requests are served, and transformers' own EarlyStoppingCallback stops training."""

import pytest
from transformers import EarlyStoppingCallback, TrainerCallback, TrainerControl

from trainers import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer
from trainers.errors import ConfigError
from trainers.cli.tiny import as_sft_rows, reverse_digits_rows
from tests.conftest import config_factory

ROWS = as_sft_rows(reverse_digits_rows(16, seed=1))
COMMON = {"model", "processing_class", "optimizer", "lr_scheduler", "train_dataloader", "eval_dataloader"}


config = config_factory(SFTConfig, per_device_train_batch_size=4, learning_rate=1e-3, max_steps=2)


class Recorder(TrainerCallback):
    """Every event, with the step it saw and the event-specific keyword arguments."""

    def __init__(self):
        self.events = []

    def __getattribute__(self, name):
        if not name.startswith("on_"):
            return object.__getattribute__(self, name)

        def record(args, state, control, **kwargs):
            assert COMMON <= set(kwargs) and isinstance(control, TrainerControl)
            assert kwargs["model"] is not None and kwargs["optimizer"] is not None
            extra = {k: v for k, v in kwargs.items() if k not in COMMON}
            object.__getattribute__(self, "events").append((name[3:], state.global_step, sorted(extra)))

        return record


def test_events_fire_in_transformers_order(tiny_model_dir, tmp_path):
    recorder = Recorder()
    # 16 rows, 4 per micro-batch, 2 micro-batches per step: 2 steps per epoch
    trainer = SFTTrainer(model=tiny_model_dir, train_dataset=ROWS, eval_dataset=ROWS[:4], callbacks=[recorder],
                         args=config(tmp_path, gradient_accumulation_steps=2, eval_strategy="steps", eval_steps=2,
                                     save_strategy="steps", save_steps=2))
    trainer.train()
    one_step = ["step_begin", "substep_end", "pre_optimizer_step", "optimizer_step", "step_end"]
    assert [e[0] for e in recorder.events] == (
        ["init_end", "train_begin", "epoch_begin"] + one_step + ["log"] + one_step
        + ["epoch_end", "log", "prediction_step", "log", "evaluate", "save", "log", "train_end"])  # one eval batch
    # the last "log": train()'s summary, logged before on_train_end as transformers does
    assert [e[1] for e in recorder.events if e[0] in ("step_end", "log", "save")] == [1, 1, 2, 2, 2, 2, 2]
    assert [e[2] for e in recorder.events if e[0] in ("log", "evaluate")] == [["logs"], ["logs"], ["logs"], ["metrics"],
                                                                               ["logs"]]


class Requests(TrainerCallback):
    """Asks for an evaluation at step 1, a log at step 2, a checkpoint at step 3 and the end at step 4."""

    def __init__(self):
        self.logs, self.metrics = [], []

    def on_step_end(self, args, state, control, **kwargs):
        control.should_evaluate = state.global_step == 1
        control.should_log = state.global_step == 2
        control.should_save = state.global_step == 3
        control.should_training_stop = state.global_step == 4

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.metrics.append(dict(metrics))


def test_control_requests_are_served(tiny_model_dir, tmp_path):
    requests = Requests()
    trainer = SFTTrainer(model=tiny_model_dir, train_dataset=ROWS, eval_dataset=ROWS[:4], callbacks=[requests],
                         args=config(tmp_path, max_steps=8, logging_strategy="no",
                                                 logging_first_step=False))
    output = trainer.train()
    assert output.global_step == trainer.state.global_step == 4  # stopped, though max_steps is 8
    history = trainer.state.log_history
    assert [r["step"] for r in history if "eval_loss" in r] == [1]
    assert [r["step"] for r in history if "loss" in r] == [2]  # logging_strategy="no" logs nothing else
    assert sorted(p.name for p in (tmp_path / "out").iterdir() if p.name.startswith("checkpoint")) == ["checkpoint-3"]
    assert requests.metrics[0]["eval_loss"] == pytest.approx(history[0]["eval_loss"], abs=1e-4)
    assert "loss" in requests.logs[1] and "step" not in requests.logs[1] and requests.logs[1]["epoch"] == 0.5


def test_transformers_early_stopping_stops_training(tiny_model_dir, tmp_path):
    # improvements smaller than the threshold count as none: eval 1 sets the best, evals 2 and 3 use up patience
    stopper = EarlyStoppingCallback(early_stopping_patience=2, early_stopping_threshold=100.0)
    trainer = SFTTrainer(model=tiny_model_dir, train_dataset=ROWS, eval_dataset=ROWS[:4], callbacks=[stopper],
                         args=config(tmp_path, max_steps=20, eval_strategy="steps", eval_steps=2,
                                     save_strategy="steps", save_steps=2, load_best_model_at_end=True))
    trainer.train()
    assert trainer.state.global_step == 6
    assert [r["step"] for r in trainer.state.log_history if "eval_loss" in r] == [2, 4, 6]
    assert trainer.state.best_global_step == 6 and trainer.state.max_steps == 20  # the loss still fell


def test_callbacks_are_checked_and_managed(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="callbacks: object is not a transformers.TrainerCallback"):
        SFTTrainer(model=tiny_model_dir, train_dataset=ROWS, args=config(tmp_path), callbacks=[object()])
    trainer = SFTTrainer(model=tiny_model_dir, train_dataset=ROWS, args=config(tmp_path), callbacks=[Recorder])
    recorder = trainer.pop_callback(Recorder)  # a class given: an instance was made
    assert isinstance(recorder, Recorder) and trainer.pop_callback(Recorder) is None
    trainer.add_callback(recorder)
    trainer.train()
    assert [e[0] for e in recorder.events].count("step_end") == 2
    trainer.remove_callback(recorder)
    assert trainer.callback_handler.callbacks == []


def test_grpo_fires_callbacks_with_its_metrics(tiny_model_dir, tmp_path):
    requests = Requests()
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
                          train_dataset=[{"prompt": f"say {i}"} for i in range(8)],
                          eval_dataset=[{"prompt": "say 9"}], callbacks=[requests],
                          args=GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4,
                                          num_generations=4, max_completion_length=4, max_steps=3, save_strategy="no",
                                          disable_tqdm=True, report_to="none", logging_strategy="no",
                                          logging_first_step=False))
    trainer.train()
    assert [r["step"] for r in trainer.state.log_history if "loss" in r] == [2]
    assert "eval_reward" in requests.metrics[0] and "reward" in requests.logs[1]
    assert (tmp_path / "out" / "checkpoint-3").is_dir()


@pytest.mark.parametrize("restore,stops_at", [(True, 6), (False, 8)])
def test_early_stopping_patience_resumes_with_restore_callback_states(tiny_model_dir, tmp_path, restore, stops_at):
    """Evaluations every 2 steps never improve by the threshold: patience 2 runs out at the third evaluation.
    Stopped after 2 of them (counter 1 in checkpoint-4), a resumed run stops at step 6 when the counter comes
    back, at step 8 when it starts again from 0."""
    def run(max_steps, resume):
        stopper = EarlyStoppingCallback(early_stopping_patience=2, early_stopping_threshold=100.0)
        trainer = SFTTrainer(model=tiny_model_dir, train_dataset=ROWS, eval_dataset=ROWS[:4], callbacks=[stopper],
                             args=config(tmp_path, max_steps=max_steps, eval_strategy="steps", eval_steps=2,
                                         save_strategy="steps", save_steps=2, load_best_model_at_end=True,
                                         restore_callback_states_from_checkpoint=restore))
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    first = run(4, None)
    assert first.state.stateful_callbacks["EarlyStoppingCallback"]["attributes"] == {
        "early_stopping_patience_counter": 1}
    resumed = run(20, str(tmp_path / "out" / "checkpoint-4"))
    assert resumed.state.global_step == stops_at
