"""Evaluation, shared by both trainers: the eval datasets (one, or transformers' dict of named ones) and
``evaluate()``. A mixin of BaseTrainer: it uses the trainer's accelerator, model, callbacks and ``log()``, and the
subclass's ``tokenize_eval`` / ``check_eval_fit`` / ``evaluation_stats`` / ``eval_rows_per_batch``.

The evaluation rows live in the attributes EVAL_STATE names (SFT: ``eval_rows``; GRPO: also the prompt ids). A
dataset given to ``evaluate()``, and each named eval dataset in turn, is swapped into them for its evaluation.
"""

from __future__ import annotations

import contextlib
import time

import torch
from transformers.trainer_utils import speed_metrics

from trainers.errors import ConfigError, DatasetFormatError
from trainers.loop.stats import Extreme, reduce_extremes, reduce_pairs


class Evaluation:
    """evaluate(), evaluate_metrics() and the eval datasets behind them (see the module docstring)."""

    def has_eval_data(self) -> bool:
        return getattr(self, "eval_rows", None) is not None or bool(self.eval_sets)

    EVAL_STATE: tuple[str, ...] = ("eval_rows",)  # the attributes tokenize_eval sets

    def tokenize_eval(self, dataset, name: str) -> None:
        """Validate and tokenize ``dataset`` into the EVAL_STATE attributes (all but the checks that need the model);
        ``name`` names it in errors."""
        raise NotImplementedError

    def check_eval_fit(self, model, name: str) -> None:
        """The checks on the current evaluation rows that need the model (its vocabulary, its context)."""
        raise NotImplementedError

    def load_eval_dataset(self, dataset, name: str = "eval_dataset") -> None:
        """Validate and tokenize ``dataset`` into the evaluation rows (``evaluate(eval_dataset=...)``)."""
        self.tokenize_eval(dataset, name)
        self.check_eval_fit(self.unwrapped_model, name)

    @contextlib.contextmanager
    def _eval_set(self, eval_set: dict | None = None):
        """Evaluation rows swapped in for the duration (``eval_set``: EVAL_STATE values; None: as they are), then
        the trainer's own back."""
        kept = {name: getattr(self, name, None) for name in self.EVAL_STATE}
        try:
            for name, value in (eval_set or {}).items():
                setattr(self, name, value)
            yield
        finally:
            for name, value in kept.items():
                setattr(self, name, value)

    def _tokenized_eval_set(self, dataset, name: str, check: bool = False) -> dict:
        """One eval dataset's rows as EVAL_STATE values (``check``: with the checks that need the model)."""
        with self._eval_set():
            self.load_eval_dataset(dataset, name) if check else self.tokenize_eval(dataset, name)
            return {attr: getattr(self, attr) for attr in self.EVAL_STATE}

    def evaluate(self, eval_dataset=None, ignore_keys: list[str] | None = None,
                 metric_key_prefix: str = "eval") -> dict:
        """Evaluation metrics over eval_dataset, named ``<metric_key_prefix>_<metric>``, logged (log_history,
        metrics.jsonl, the trackers during training, on_log) and given to on_evaluate; the model returns to training
        mode after. As in transformers, an ``eval_dataset`` given here is evaluated instead of the trainer's, which
        is kept for later evaluations. ``ignore_keys`` changes nothing: only the logits are ever collected."""
        if isinstance(eval_dataset, str):  # one of the trainer's named eval datasets (transformers)
            with self._eval_set(self._named_eval_set(eval_dataset)):
                return self._evaluate_and_log(metric_key_prefix)
        if isinstance(eval_dataset, dict):  # several given here: all checked before any is evaluated
            sets = {name: self._tokenized_eval_set(dataset, f"eval_dataset[{name!r}]", check=True)
                    for name, dataset in named_eval_datasets(eval_dataset).items()}
        else:
            sets = self.eval_sets if eval_dataset is None else {}
        if sets:  # several: each evaluated, logged and given to on_evaluate as <prefix>_<name>_<metric>
            metrics = {}
            for name, eval_set in sets.items():
                with self._eval_set(eval_set):
                    metrics.update(self._evaluate_and_log(f"{metric_key_prefix}_{name}"))
            return metrics
        return self._evaluate_and_log(metric_key_prefix, eval_dataset)

    def _evaluate_and_log(self, metric_key_prefix: str, eval_dataset=None) -> dict:
        metrics = self.evaluate_metrics(eval_dataset, metric_key_prefix)
        self.log(metrics)  # then on_evaluate, before the best metric is updated: transformers' order
        self.callback_handler.fire("evaluate", metrics=metrics)
        return metrics

    def evaluate_metrics(self, eval_dataset=None, metric_key_prefix: str = "eval") -> dict:
        """evaluate()'s metrics, neither logged nor given to callbacks (predict() uses it too)."""
        if eval_dataset is not None:
            with self._eval_set():
                self.load_eval_dataset(eval_dataset)
                return self.evaluate_metrics(metric_key_prefix=metric_key_prefix)
        if getattr(self, "eval_rows", None) is None:
            raise ConfigError("evaluate() needs an eval_dataset: give one to the trainer or to evaluate().")
        started = time.time()
        self.model.eval()
        with torch.no_grad():
            stats = self.evaluation_stats()
        self.model.train()
        prefix = f"{metric_key_prefix}_"
        metrics = reduce_pairs(self.accelerator, {k: v for k, v in stats.items() if not isinstance(v, Extreme)},
                               prefix=prefix)
        extremes = {name: [entry] for name, entry in stats.items() if isinstance(entry, Extreme)}
        metrics.update({prefix + name: value for name, value in reduce_extremes(self.accelerator, extremes).items()})
        self.derive_metrics(metrics, prefix)
        for name, value in self.computed_metrics().items():  # compute_metrics' (SFT), prefixed as transformers does
            key = name if name.startswith(prefix) else prefix + name
            if key in metrics:
                raise ConfigError(f"compute_metrics returned {name!r}, which is also the trainer's own {key!r}; "
                                  f"give it another name.")
            metrics[key] = value
        rows = len(self.eval_rows)
        per_process = -(-rows // self.accelerator.num_processes)
        steps = -(-per_process // self.eval_rows_per_batch())  # forward batches, each process the same number
        metrics.update(speed_metrics(metric_key_prefix, started, num_samples=rows, num_steps=steps))
        return metrics

    def _named_eval_set(self, name: str) -> dict:
        if name not in self.eval_sets:
            known = f"its named eval datasets are {sorted(self.eval_sets)}" if self.eval_sets else \
                "the trainer has no named eval datasets (a dict as eval_dataset)"
            raise ConfigError(f"evaluate(eval_dataset={name!r}): {known}.")
        return self.eval_sets[name]

    def derive_metrics(self, metrics: dict, prefix: str) -> None:
        """Add the metrics made from others (KTO's rewards/margins) to reduced ``metrics`` named ``<prefix><name>``;
        the training loop calls it on each step's metrics (prefix '') after ``after_optimizer_step``."""

    def computed_metrics(self) -> dict:
        """What the user's compute_metrics made of the last evaluation (SFT), before prefixing; {} if nothing."""
        return {}


def named_eval_datasets(eval_dataset) -> dict:
    """transformers' several eval datasets: a dict {name: dataset}, checked; {} for anything else."""
    if not isinstance(eval_dataset, dict):
        return {}
    if not eval_dataset:
        raise DatasetFormatError("eval_dataset is an empty dict: give {name: dataset, ...} or a single dataset.")
    for name, dataset in eval_dataset.items():
        if not isinstance(name, str) or not name:
            raise DatasetFormatError(f"eval_dataset: a dict of eval datasets needs non-empty string names (they "
                                     f"name the metrics, eval_<name>_loss), got {name!r}.")
        if dataset is None:
            raise DatasetFormatError(f"eval_dataset[{name!r}] is None.")
    return eval_dataset
