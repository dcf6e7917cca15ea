"""transformers' evaluation and logging API on our trainers: trainer.log, evaluate() logging its metrics (with
eval_runtime and the rates), compute_metrics / preprocess_logits_for_metrics and their options, predict(),
log_metrics / save_metrics / save_state, and train()'s TrainOutput.metrics."""

import json
import math

import numpy as np
import pytest
import torch
from transformers import TrainerCallback

from trainers import SFTConfig, SFTTrainer
from trainers.errors import ConfigError

ROWS = [{"text": f"row {i} " + "abc " * (i + 1)} for i in range(8)]
EVAL = [{"text": "the quick brown fox " * (i + 1)} for i in range(5)]  # 5 rows: batches of 2, 2 and 1


def args(tmp_path, **overrides):
    return SFTConfig(**{"output_dir": str(tmp_path / "out"), "per_device_train_batch_size": 2, "max_steps": 2,
                        "per_device_eval_batch_size": 2, "learning_rate": 1e-3, "disable_tqdm": True,
                        "save_strategy": "no", "report_to": "none", **overrides})


class Seen:
    """A compute_metrics that keeps what it was given and returns a number computed from it."""

    def __init__(self):
        self.calls = []

    def __call__(self, eval_pred, compute_result=None):
        self.calls.append((eval_pred, compute_result))
        return {"calls": len(self.calls), "value": np.float32(0.5)}


def shifted_nll_and_accuracy(logits: np.ndarray, labels: np.ndarray) -> tuple[float, float]:
    """The usual metric a user writes: logits[:, t] predicts labels[:, t + 1]; -100 is not scored."""
    logits, labels = torch.from_numpy(logits[:, :-1]).float(), torch.from_numpy(labels[:, 1:])
    mask = labels != -100
    logps = torch.log_softmax(logits, -1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    accuracy = ((logits.argmax(-1) == labels) & mask).sum() / mask.sum()
    return float(-(logps * mask).sum() / mask.sum()), float(accuracy)


def test_compute_metrics_gets_every_rows_logits_and_labels_in_order(tiny_model_dir, tmp_path):
    seen = Seen()
    trainer = SFTTrainer(model=tiny_model_dir, args=args(tmp_path), train_dataset=ROWS, eval_dataset=EVAL,
                         compute_metrics=seen)
    metrics = trainer.evaluate()
    assert metrics["eval_calls"] == 1 and metrics["eval_value"] == 0.5 and type(metrics["eval_value"]) is float
    pred = seen.calls[0][0]
    tokens = [trainer.processing_class(row["text"])["input_ids"] for row in EVAL]
    longest = max(len(t) for t in tokens) + 1  # the EOS appended
    vocab = trainer.model.config.vocab_size
    assert pred.predictions.shape == (5, longest, vocab) and pred.label_ids.shape == (5, longest)
    for row, ids in enumerate(tokens):  # dataset order; each row's own tokens from position 1, then -100
        n = len(ids) + 1
        assert pred.label_ids[row, 1:n - 1].tolist() == ids[1:]
        assert pred.label_ids[row, 0] == -100 and (pred.label_ids[row, n:] == -100).all()
    # the user's own loss and accuracy from these arrays are the trainer's
    nll, accuracy = shifted_nll_and_accuracy(pred.predictions, pred.label_ids)
    assert nll == pytest.approx(metrics["eval_loss"], rel=1e-4)
    assert accuracy == pytest.approx(metrics["eval_mean_token_accuracy"], abs=1e-4)


def test_preprocess_logits_and_include_for_metrics(tiny_model_dir, tmp_path):
    seen = Seen()
    given = []

    def preprocess(logits, labels):  # [B, T, V], [B, T] -> [B, T]
        given.append((tuple(logits.shape), tuple(labels.shape)))
        return logits.argmax(-1)

    trainer = SFTTrainer(model=tiny_model_dir, args=args(tmp_path, include_for_metrics=["inputs", "loss"]),
                         train_dataset=ROWS, eval_dataset=EVAL, compute_metrics=seen,
                         preprocess_logits_for_metrics=preprocess)
    metrics = trainer.evaluate()
    pred = seen.calls[0][0]
    assert len(given) == 3 and given[2][0][0] == 1  # per batch, before anything is kept: 2 + 2 + 1 rows
    assert pred.predictions.shape == pred.label_ids.shape == pred.inputs.shape and pred.predictions.dtype == np.int64
    first = trainer.processing_class(EVAL[0]["text"])["input_ids"]
    assert pred.inputs[0, :len(first)].tolist() == first  # then the batch's padding, then -100 (transformers')
    assert set(pred.inputs[0, len(first) + 1:].tolist()) == {trainer.processing_class.pad_token_id, -100}
    assert pred.losses.shape == (5,) and pred.losses[0] == pred.losses[1] != pred.losses[4]  # the batch's mean
    weights = np.array([(pred.label_ids[i] != -100).sum() for i in range(5)])
    by_batch = [slice(0, 2), slice(2, 4), slice(4, 5)]
    total = sum(pred.losses[b][0] * weights[b].sum() for b in by_batch) / weights.sum()
    assert total == pytest.approx(metrics["eval_loss"], rel=1e-4)


def test_batch_eval_metrics_and_unconcatenated_batches(tiny_model_dir, tmp_path):
    seen = Seen()
    trainer = SFTTrainer(model=tiny_model_dir, args=args(tmp_path, batch_eval_metrics=True), train_dataset=ROWS,
                         eval_dataset=EVAL, compute_metrics=seen)
    metrics = trainer.evaluate()
    assert [c[1] for c in seen.calls] == [False, False, True] and metrics["eval_calls"] == 3  # the last one's
    assert [c[0].predictions.shape[0] for c in seen.calls] == [2, 2, 1]
    assert isinstance(seen.calls[0][0].predictions, torch.Tensor)  # per batch: tensors, as transformers

    seen = Seen()
    trainer = SFTTrainer(model=tiny_model_dir, args=args(tmp_path, eval_do_concat_batches=False),
                         train_dataset=ROWS, eval_dataset=EVAL, compute_metrics=seen)
    trainer.evaluate()
    predictions = seen.calls[0][0].predictions
    assert isinstance(predictions, list) and [p.shape[0] for p in predictions] == [2, 2, 1]


@pytest.mark.parametrize("options", [{"padding_free": True, "max_length": None}, {"packing": True, "max_length": 64}])
def test_predictions_are_per_row_with_padding_free_and_packed_evaluation(tiny_model_dir, tmp_path, options):
    seen = Seen()
    trainer = SFTTrainer(model=tiny_model_dir, args=args(tmp_path, **options), train_dataset=ROWS, eval_dataset=EVAL,
                         compute_metrics=seen)
    metrics = trainer.evaluate()
    pred = seen.calls[0][0]
    rows = 5 if "packing" not in options else len(trainer.eval_rows)  # packed evaluation: per packed row
    assert pred.predictions.shape[0] == pred.label_ids.shape[0] == rows
    nll, _ = shifted_nll_and_accuracy(pred.predictions, pred.label_ids)
    assert nll == pytest.approx(metrics["eval_loss"], rel=1e-4)


def test_predict_returns_predictions_and_metrics_without_logging(tiny_model_dir, tmp_path):
    class OnPredict(TrainerCallback):
        metrics = None

        def on_predict(self, args, state, control, metrics=None, **kwargs):
            OnPredict.metrics = metrics

    trainer = SFTTrainer(model=tiny_model_dir, args=args(tmp_path), train_dataset=ROWS, callbacks=[OnPredict()])
    output = trainer.predict(EVAL)
    assert output.predictions.shape[:2] == output.label_ids.shape and output.predictions.shape[0] == 5
    nll, _ = shifted_nll_and_accuracy(output.predictions, output.label_ids)
    assert nll == pytest.approx(output.metrics["test_loss"], rel=1e-4)
    assert OnPredict.metrics == output.metrics and trainer.state.log_history == []
    assert not trainer.has_eval_data()  # the trainer had no eval_dataset, and still has none

    trainer = SFTTrainer(model=tiny_model_dir, args=args(tmp_path, prediction_loss_only=True), train_dataset=ROWS,
                         eval_dataset=EVAL, compute_metrics=Seen())
    output = trainer.predict(EVAL)
    assert output.predictions is None and output.label_ids is None and "test_loss" in output.metrics
    assert "eval_calls" not in trainer.evaluate()  # the loss only: compute_metrics is not called


def test_compute_metrics_during_training_chooses_the_best_model(tiny_model_dir, tmp_path):
    def accuracy(eval_pred):
        return {"accuracy": shifted_nll_and_accuracy(eval_pred.predictions, eval_pred.label_ids)[1]}

    trainer = SFTTrainer(model=tiny_model_dir, train_dataset=ROWS, eval_dataset=EVAL, compute_metrics=accuracy,
                         args=args(tmp_path, max_steps=4, eval_strategy="steps", eval_steps=2, save_strategy="steps",
                                   save_steps=2, metric_for_best_model="accuracy", greater_is_better=True))
    trainer.train()
    evaluations = [r for r in trainer.state.log_history if "eval_loss" in r]
    assert [r["step"] for r in evaluations] == [2, 4]
    for record in evaluations:
        assert record["eval_accuracy"] == pytest.approx(record["eval_mean_token_accuracy"], abs=1e-4)
    best = max(evaluations, key=lambda r: r["eval_accuracy"])
    assert trainer.state.best_metric == best["eval_accuracy"]


def test_metric_options_are_checked_before_loading(tiny_model_dir, tmp_path):
    def no_compute_result(eval_pred):
        return {}

    with pytest.raises(ConfigError, match="compute_metrics must be a function"):
        SFTTrainer(model=tiny_model_dir, args=args(tmp_path), train_dataset=ROWS, compute_metrics={"accuracy": 1})
    with pytest.raises(ConfigError, match="batch_eval_metrics=True.*no compute_metrics"):
        SFTTrainer(model=tiny_model_dir, args=args(tmp_path, batch_eval_metrics=True), train_dataset=ROWS)
    with pytest.raises(ConfigError, match="include_for_metrics=\\['loss'\\].*no compute_metrics"):
        SFTTrainer(model=tiny_model_dir, args=args(tmp_path, include_for_metrics=["loss"]), train_dataset=ROWS)
    with pytest.raises(ConfigError, match="no `compute_result` parameter"):
        SFTTrainer(model=tiny_model_dir, args=args(tmp_path, batch_eval_metrics=True), train_dataset=ROWS,
                   compute_metrics=no_compute_result)
    with pytest.raises(ConfigError, match="SFTTrainer needs args of type SFTConfig"):
        SFTTrainer(model=tiny_model_dir, args=object(), train_dataset=ROWS, compute_metrics=Seen())
    with pytest.raises(ConfigError, match="include_for_metrics.*'inputs', 'loss'"):
        SFTConfig(include_for_metrics=["labels"])
    clash = SFTTrainer(model=tiny_model_dir, args=args(tmp_path), train_dataset=ROWS, eval_dataset=EVAL,
                       compute_metrics=lambda p: {"mean_token_accuracy": 1.0})
    with pytest.raises(ConfigError, match="'mean_token_accuracy'.*trainer's own 'eval_mean_token_accuracy'"):
        clash.evaluate()
    wrong = SFTTrainer(model=tiny_model_dir, args=args(tmp_path), train_dataset=ROWS, eval_dataset=EVAL,
                       compute_metrics=lambda p: 0.5)
    with pytest.raises(ConfigError, match="must return a dict.*float"):
        wrong.evaluate()


def test_log_and_evaluate_record_where_transformers_does(tiny_model_dir, tmp_path):
    logged = []

    class OnLog(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            logged.append(dict(logs))

    trainer = SFTTrainer(model=tiny_model_dir, args=args(tmp_path), train_dataset=ROWS, eval_dataset=EVAL,
                         callbacks=[OnLog()])
    trainer.log({"my_metric": 2.5})
    metrics = trainer.evaluate()
    history = trainer.state.log_history
    assert history[0] == {"step": 0, "epoch": 0.0, "my_metric": 2.5} and logged[0] == {"epoch": 0.0, "my_metric": 2.5}
    assert history[1] == {"step": 0, "epoch": 0.0, **{k: pytest.approx(v, rel=1e-3) for k, v in metrics.items()}}
    assert metrics["eval_runtime"] > 0
    assert metrics["eval_samples_per_second"] == pytest.approx(5 / metrics["eval_runtime"], rel=0.05)
    assert metrics["eval_steps_per_second"] == pytest.approx(3 / metrics["eval_runtime"], rel=0.05)
    with open(tmp_path / "out" / "metrics.jsonl") as f:
        lines = [json.loads(line) for line in f]
    assert lines[0]["my_metric"] == 2.5 and "eval_loss" in lines[1]

    output = trainer.train()  # the history so far stays at the head of metrics.jsonl
    assert trainer.state.log_history[:2] == history[:2]
    summary = output.metrics
    assert set(summary) == {"train_runtime", "train_samples_per_second", "train_steps_per_second", "total_flos",
                            "train_loss", "epoch"}
    assert summary["train_loss"] == output.training_loss and summary["epoch"] == trainer.state.epoch
    assert summary["train_samples_per_second"] == pytest.approx(2 * 2 / summary["train_runtime"], rel=0.01)
    trainer.log({"after": 1.0})  # the trackers are finished; the history and the file still get it
    assert trainer.state.log_history[-1] == {"step": 2, "epoch": trainer.state.epoch, "after": 1.0}


def test_total_flos_is_transformers_estimate_and_survives_resume(tiny_model_dir, tmp_path):
    """6 x non-embedding parameters (transformers' count) x input tokens, padding included; saved with the
    state, so a resumed run ends with the same total."""
    options = dict(include_num_input_tokens_seen="all", padding_free=False, save_strategy="steps", save_steps=1)
    trainer = SFTTrainer(model=tiny_model_dir, args=args(tmp_path, **options), train_dataset=ROWS)
    output = trainer.train()
    parameters = trainer.unwrapped_model.num_parameters(exclude_embeddings=True)
    assert parameters < trainer.unwrapped_model.num_parameters()  # the embedding is left out
    seen = trainer.state.num_input_tokens_seen  # every position of each padded batch
    assert output.metrics["total_flos"] == trainer.state.total_flos == 6 * parameters * seen > 0
    resumed = SFTTrainer(model=tiny_model_dir, args=args(tmp_path, **options), train_dataset=ROWS)
    resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-1"))
    assert resumed.state.total_flos == trainer.state.total_flos


def test_log_metrics_save_metrics_and_save_state(tiny_model_dir, tmp_path, capsys):
    trainer = SFTTrainer(model=tiny_model_dir, args=args(tmp_path), train_dataset=ROWS, eval_dataset=EVAL)
    train_metrics = trainer.train().metrics
    trainer.log_metrics("train", train_metrics)
    assert "***** train metrics *****" in capsys.readouterr().out
    eval_metrics = trainer.evaluate()
    trainer.save_metrics("train", train_metrics)
    trainer.save_metrics("eval", eval_metrics)
    trainer.save_state()
    out = tmp_path / "out"
    assert json.loads((out / "train_results.json").read_text())["train_loss"] == train_metrics["train_loss"]
    combined = json.loads((out / "all_results.json").read_text())
    assert {"train_loss", "eval_loss"} <= set(combined) and math.isfinite(combined["eval_loss"])
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == 2 and state["log_history"][-1]["eval_loss"] == pytest.approx(eval_metrics["eval_loss"], rel=1e-3)


def test_named_eval_datasets_are_each_evaluated_and_logged(tiny_model_dir, tmp_path):
    """transformers' dict of eval datasets: each evaluated and logged as eval_<name>_<metric>."""
    from trainers.errors import DatasetFormatError

    named = {"short": EVAL[:2], "long": EVAL[2:]}
    trainer = SFTTrainer(model=tiny_model_dir, train_dataset=ROWS, eval_dataset=named, compute_metrics=Seen(),
                         args=args(tmp_path, max_steps=2, eval_strategy="steps", eval_steps=2,
                                   metric_for_best_model="eval_long_loss"))
    trainer.train()
    records = [r for r in trainer.state.log_history if any(k.endswith("_loss") for k in r if k.startswith("eval"))]
    assert [(r["step"], sorted(k for k in r if k.endswith("_loss"))) for r in records] == [
        (2, ["eval_short_loss"]), (2, ["eval_long_loss"])]  # one record per dataset, in the dict's order
    assert records[1]["eval_long_calls"] == 2  # compute_metrics ran on each
    both = trainer.evaluate()
    assert both["eval_short_loss"] == pytest.approx(trainer.evaluate(eval_dataset=EVAL[:2])["eval_loss"], rel=1e-5)
    assert both["eval_long_loss"] == pytest.approx(trainer.evaluate(eval_dataset="long")["eval_loss"], rel=1e-5)
    assert trainer.state.best_metric == pytest.approx(records[1]["eval_long_loss"], rel=1e-5)
    given = trainer.evaluate(eval_dataset={"a": EVAL[:1], "b": EVAL[1:2]}, metric_key_prefix="test")
    assert {"test_a_loss", "test_b_loss"} <= set(given) and given["test_a_loss"] != given["test_b_loss"]
    with pytest.raises(ConfigError, match=r"eval_dataset='medium'.*\['long', 'short'\]"):
        trainer.evaluate(eval_dataset="medium")
    with pytest.raises(DatasetFormatError, match=r"eval_dataset\['bad'\]"):
        SFTTrainer(model=tiny_model_dir, train_dataset=ROWS, args=args(tmp_path),
                   eval_dataset={"good": EVAL, "bad": [{"nothing": "here"}]})
    with pytest.raises(DatasetFormatError, match="empty dict"):
        SFTTrainer(model=tiny_model_dir, train_dataset=ROWS, args=args(tmp_path), eval_dataset={})


def test_grpo_takes_named_eval_datasets(tiny_model_dir, tmp_path):
    from trainers import GRPOConfig, GRPOTrainer

    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=lambda prompts, **kw: [float(len(p)) for p in prompts],
                          train_dataset=[{"prompt": "ab"}] * 4,
                          eval_dataset={"two": [{"prompt": "cd"}], "five": [{"prompt": "abcde"}] * 3},
                          args=GRPOConfig(output_dir=str(tmp_path / "g"), per_device_train_batch_size=4,
                                          num_generations=4, max_completion_length=4, max_steps=1,
                                          disable_tqdm=True, save_strategy="no", report_to="none"))
    metrics = trainer.evaluate()
    assert metrics["eval_two_reward"] == 2.0 and metrics["eval_five_reward"] == 5.0
    assert [r.get("eval_two_reward", r.get("eval_five_reward")) for r in trainer.state.log_history] == [2.0, 5.0]


def nll_like_transformers(outputs, labels, num_items_in_batch=None):
    """A compute_loss_func as users write them: shifted cross-entropy, summed over the step's tokens (mean without)."""
    logits, labels = outputs.logits[:, :-1].float(), labels[:, 1:]
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100,
                                             reduction=reduction)
    return loss / num_items_in_batch if num_items_in_batch is not None else loss


def test_compute_loss_func_replaces_the_loss_as_transformers(tiny_model_dir, tmp_path):
    seen = []

    def loss_func(outputs, labels, num_items_in_batch=None):
        seen.append(None if num_items_in_batch is None else float(num_items_in_batch))
        return nll_like_transformers(outputs, labels, num_items_in_batch)

    runs = {}
    for name, func in (("builtin", None), ("user", loss_func)):
        trainer = SFTTrainer(model=tiny_model_dir, train_dataset=ROWS, eval_dataset=EVAL, compute_loss_func=func,
                             args=args(tmp_path / name, max_steps=3, gradient_accumulation_steps=2, seed=3,
                                       logging_first_step=True))
        trainer.train()
        runs[name] = trainer
    history = {name: [r for r in t.state.log_history if "loss" in r] for name, t in runs.items()}
    # the same loss (the step's token mean, over both micro-batches) and so the same training
    assert [r["loss"] for r in history["user"]] == pytest.approx([r["loss"] for r in history["builtin"]], rel=1e-5)
    assert [r["grad_norm"] for r in history["user"]] == pytest.approx([r["grad_norm"] for r in history["builtin"]],
                                                                       rel=1e-4)
    # num_items_in_batch: the whole step's trained tokens (its 4 rows' last tokens predict nothing)
    assert seen[0] == seen[1] == history["user"][0]["num_tokens"] - 4
    # evaluation: num_items_in_batch None, and eval_loss the rows' mean of the per-batch losses (transformers)
    seen.clear()
    metrics = runs["user"].evaluate()
    assert seen == [None, None, None]
    builtin = runs["builtin"].evaluate()
    assert metrics["eval_mean_token_accuracy"] == pytest.approx(builtin["eval_mean_token_accuracy"], abs=1e-4)
    assert metrics["eval_loss"] == pytest.approx(builtin["eval_loss"], rel=0.05)  # row- vs token-weighted mean


def test_compute_loss_func_is_checked(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="compute_loss_func must be a function"):
        SFTTrainer(model=tiny_model_dir, args=args(tmp_path), train_dataset=ROWS, compute_loss_func="nll")
    trainer = SFTTrainer(model=tiny_model_dir, args=args(tmp_path), train_dataset=ROWS,
                         compute_loss_func=lambda outputs, labels, num_items_in_batch=None: 0.5)
    with pytest.raises(ConfigError, match="one-element tensor, got float"):
        trainer.train()
