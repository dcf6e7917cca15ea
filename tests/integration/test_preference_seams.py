"""What the base gives every trainer, seen from DPO, KTO and the reward model: callbacks fire in transformers' order
with each trainer's metrics, a tracker (TensorBoard) receives every logged value, and ``trainers report`` plots
them."""

import glob

import pytest
from transformers import TrainerCallback

from trainers import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer, RewardConfig, RewardTrainer
from trainers.cli.report import write_report

PAIRS = [{"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1)} for a in range(4) for b in range(4)]
# KTO trains rows in dataset order (TRL's default, train_sampling_strategy="sequential"): both labels in each step
UNPAIRED = [{"prompt": p["prompt"], "completion": p[side], "label": side == "chosen"}
            for p in PAIRS for side in ("chosen", "rejected")]
# each trainer: its classes, metrics its training records must have, and the plots its report must draw
TRAINERS = {
    "dpo": (DPOTrainer, DPOConfig, ["rewards/chosen", "rewards/margins", "rewards/accuracies", "logps/rejected"],
            ["implicit_rewards", "pair_accuracy", "logps"]),
    "kto": (KTOTrainer, KTOConfig, ["kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen"],
            ["implicit_rewards", "logps"]),
    "reward": (RewardTrainer, RewardConfig, ["accuracy", "margin", "mean_reward", "min_reward", "max_reward"],
               ["pair_accuracy", "scores"]),
}


class Events(TrainerCallback):
    """The events in order, and what on_log and on_evaluate were given."""

    def __init__(self):
        self.names, self.logs, self.metrics = [], [], []

    def on_step_end(self, args, state, control, **kwargs):
        self.names.append("step_end")

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.names.append("log")
        self.logs.append(dict(logs))

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.names.append("evaluate")
        self.metrics.append(dict(metrics))

    def on_train_end(self, args, state, control, **kwargs):
        self.names.append("train_end")


def tensorboard_scalars(folder: str) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars = {}
    for path in glob.glob(f"{folder}/**/events.out.tfevents.*", recursive=True):
        events = EventAccumulator(path)
        events.Reload()
        for tag in events.Tags()["scalars"]:
            scalars[tag] = [(e.step, e.value) for e in events.Scalars(tag)]
    return scalars


@pytest.fixture(scope="module", params=sorted(TRAINERS))
def run(request, tiny_model_dir, tmp_path_factory):
    """A 2-step run of one trainer: logging every step, evaluating at step 2, TensorBoard, a recording callback."""
    trainer_class, config_class, metrics, plots = TRAINERS[request.param]
    output_dir = str(tmp_path_factory.mktemp(request.param) / "out")
    events = Events()
    rows = UNPAIRED if request.param == "kto" else PAIRS
    trainer = trainer_class(model=tiny_model_dir, train_dataset=rows, eval_dataset=rows[:8], callbacks=[events],
                            args=config_class(output_dir=output_dir, per_device_train_batch_size=4,
                                              learning_rate=1e-3, max_steps=2, logging_steps=1, eval_strategy="steps",
                                              eval_steps=2, per_device_eval_batch_size=4, save_strategy="no",
                                              report_to="tensorboard", run_name="tb", disable_tqdm=True, seed=0))
    trainer.train()
    return trainer, events, metrics, plots, output_dir


def test_callbacks_get_each_trainers_metrics_in_order(run):
    trainer, events, metrics, _, _ = run
    # step 1: its log; step 2: its log, the evaluation's log and on_evaluate; then train()'s summary log
    assert events.names == ["step_end", "log", "step_end", "log", "log", "evaluate", "log", "train_end"]
    trained = [logs for logs in events.logs if "loss" in logs]
    assert [logs["step"] if "step" in logs else None for logs in trained] in ([1, 2], [None, None])
    for logs in trained:
        assert set(metrics) <= set(logs) and logs["loss"] == logs["loss"]  # present and not NaN
    assert {f"eval_{name}" for name in metrics if name != "kl"} | {"eval_loss"} <= set(events.metrics[0])


def test_tensorboard_receives_every_logged_value(run):
    trainer, _, metrics, _, output_dir = run
    scalars = tensorboard_scalars(f"{output_dir}/tb")
    assert [r["step"] for r in trainer.state.log_history if "loss" in r] == [1, 2]
    for name in ["loss", *metrics, "eval_loss"]:
        # every record that has it: the steps', and (as TRL) train()'s summary repeating the trainer's metrics
        logged = [(r["step"], r[name]) for r in trainer.state.log_history if name in r]
        assert [s for s, _ in scalars[name]] == [s for s, _ in logged], name
        assert [v for _, v in scalars[name]] == pytest.approx([v for _, v in logged], rel=1e-5), name


def test_report_plots_each_trainers_metrics(run):
    trainer, _, _, plots, output_dir = run
    report = write_report(output_dir)
    assert set(plots) | {"loss", "learning_rate", "html"} <= set(report)
    assert not {"reward", "completion_length", "clip_ratio"} & set(report)  # GRPO's plots need GRPO's metrics
    with open(report["html"], encoding="utf-8") as f:
        page = f.read()
    assert f"<td>trainer</td><td>{type(trainer).__name__}</td>" in page
    assert "<td>steps</td><td>2 of 2</td>" in page
