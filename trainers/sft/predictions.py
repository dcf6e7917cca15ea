"""What ``compute_metrics`` sees: transformers' evaluation-loop contract over SFT's evaluation batches.

Per batch, as transformers does it: the logits and labels are padded with -100 to the longest row of any
process, ``preprocess_logits_for_metrics(logits, labels)`` runs on each process, then every process's rows are
gathered. Unlike a dataloader batch, our evaluation gives process p the rows p, p + N, p + 2N, ... (N processes),
so the gathered rows are put back in dataset order (with packed evaluation: packed-row order), and a process's
stand-in rows (it had none left) are dropped. The batches then concatenate along the rows, padded with -100
along the length (``eval_do_concat_batches=False``: a list of batches), and become numpy arrays for
``EvalPrediction``, or stay tensors for ``batch_eval_metrics``.

Labels are transformers' unshifted labels (``trainers.sft.tokenize.transformers_labels``): ``labels[t]`` is the
token position ``t`` is trained to be (-100 where it is not trained), so ``logits[:, t]`` predicts
``labels[:, t + 1]``. Position 0 is always -100 here (nothing predicts it; transformers' collators leave the token
id there, which a shifted metric never reads).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
from transformers.trainer_pt_utils import EvalLoopContainer
from transformers.trainer_utils import EvalPrediction, denumpify_detensorize

from trainers.errors import ConfigError
from trainers.logs import logger
from trainers.sft.batch import SFTBatch
from trainers.sft.tokenize import transformers_labels

PAD = -100  # transformers' padding_index for predictions, labels and inputs


def check_metric_functions(compute_metrics, preprocess_logits_for_metrics, args) -> None:
    """Errors before training for what compute_metrics and its options could not do."""
    name = type(args).__name__
    for arg, value in (("compute_metrics", compute_metrics),
                       ("preprocess_logits_for_metrics", preprocess_logits_for_metrics)):
        if value is not None and not callable(value):
            raise ConfigError(f"{arg} must be a function, got {type(value).__name__}.")
    if compute_metrics is None:
        for option, value in (("batch_eval_metrics", args.batch_eval_metrics),
                              ("include_for_metrics", args.include_for_metrics)):
            if value:
                raise ConfigError(f"{name}: `{option}={value!r}` changes what compute_metrics receives, and no "
                                  f"compute_metrics was given to the trainer.")
        return
    if args.prediction_loss_only:
        logger.warning(f"{name}: prediction_loss_only=True: compute_metrics is not called (the loss and token "
                       f"accuracy only).")
    if args.batch_eval_metrics:
        try:
            parameters = inspect.signature(compute_metrics).parameters
        except (TypeError, ValueError):  # a callable whose signature Python cannot read: trust it
            return
        if "compute_result" not in parameters and not any(p.kind == p.VAR_KEYWORD for p in parameters.values()):
            raise ConfigError(f"{name}: with batch_eval_metrics=True, compute_metrics is called once per batch "
                              f"as compute_metrics(eval_prediction, compute_result=<is it the last batch>); "
                              f"it has no `compute_result` parameter.")


def _apply(tree, fn: Callable):
    """fn on every tensor of a tensor, or a tuple / list / dict of them (what preprocess_logits_for_metrics returns)."""
    if isinstance(tree, (tuple, list)):
        return type(tree)(_apply(t, fn) for t in tree)
    if isinstance(tree, dict):
        return {k: _apply(v, fn) for k, v in tree.items()}
    return fn(tree)


class Predictions:
    """Collects one evaluation's predictions and labels (and inputs / losses if asked), and runs compute_metrics."""

    def __init__(self, accelerator, args, compute_metrics: Callable | None,
                 preprocess_logits_for_metrics: Callable | None, keep_all: bool = False):
        self.accelerator = accelerator
        self.compute_metrics = compute_metrics
        self.preprocess = preprocess_logits_for_metrics
        self.include = set(args.include_for_metrics)
        self.per_batch = bool(args.batch_eval_metrics) and compute_metrics is not None
        self.keep = keep_all or not self.per_batch  # predict() returns every batch, batch metrics or not
        concat = args.eval_do_concat_batches
        self.preds, self.labels, self.inputs, self.losses = (EvalLoopContainer(concat, PAD) for _ in range(4))
        self.batch_metrics: dict = {}  # compute_metrics' return for the last batch (batch_eval_metrics)

    def add(self, rows: list[int], batch: SFTBatch, logits: torch.Tensor, loss: torch.Tensor, last: bool) -> None:
        """One evaluation batch of this process. rows: the eval rows it holds (empty: a stand-in batch whose rows
        are dropped after the gather); logits [B, T, V]; loss: the batch's mean token loss."""
        acc = self.accelerator
        size = logits.shape[0]
        ids = torch.tensor(rows if rows else [-1] * size, device=logits.device)  # [B]
        labels = acc.pad_across_processes(transformers_labels(batch.target_ids), dim=1, pad_index=PAD)  # [B, T*]
        logits = acc.pad_across_processes(logits, dim=1, pad_index=PAD)  # [B, T*, V]
        preds = self.preprocess(logits, labels) if self.preprocess is not None else logits
        parts: dict[str, Any] = {"preds": preds, "labels": labels}
        if "inputs" in self.include:
            parts["inputs"] = acc.pad_across_processes(batch.input_ids, dim=1, pad_index=PAD)
        if "loss" in self.include:
            parts["losses"] = loss.detach().float().reshape(1).repeat(size)  # transformers: the mean, per row
        # Processes may hold different numbers of rows (the last batches): pad the rows too, then gather.
        ids = acc.gather(acc.pad_across_processes(ids, dim=0, pad_index=-1))
        parts = _apply(parts, lambda t: acc.gather(acc.pad_across_processes(t, dim=0, pad_index=PAD)))
        real = torch.nonzero(ids >= 0).squeeze(1)
        order = real[torch.argsort(ids[real])]  # dataset order (the rows of one gathered batch are contiguous)
        parts = _apply(parts, lambda t: t[order])
        if self.per_batch:
            self.batch_metrics = self.compute_metrics(self._prediction(parts), compute_result=last)
        if self.keep:
            parts = _apply(parts, lambda t: t.cpu())  # device memory holds one batch at a time
            self.preds.add(parts["preds"])
            self.labels.add(parts["labels"])
            if "inputs" in parts:
                self.inputs.add(parts["inputs"])
            if "losses" in parts:
                self.losses.add(parts["losses"])

    def _prediction(self, parts: dict) -> EvalPrediction:
        return EvalPrediction(predictions=parts["preds"], label_ids=parts["labels"], inputs=parts.get("inputs"),
                              losses=parts.get("losses"))

    def arrays(self) -> tuple[Any, Any]:
        """(predictions, label_ids) over the whole evaluation, as numpy arrays (or lists of them)."""
        return self.preds.get_arrays(), self.labels.get_arrays()

    def metrics(self) -> dict:
        """compute_metrics' result over the whole evaluation (the last batch's with batch_eval_metrics), as plain
        numbers; {} without compute_metrics."""
        if self.compute_metrics is None:
            return {}
        if self.per_batch:
            return denumpify_detensorize(dict(self.batch_metrics or {}))
        preds, labels = self.arrays()
        parts = {"preds": preds, "labels": labels}
        if "inputs" in self.include:
            parts["inputs"] = self.inputs.get_arrays()
        if "loss" in self.include:
            parts["losses"] = self.losses.get_arrays()
        result = self.compute_metrics(self._prediction(parts))
        if not isinstance(result, dict):
            raise ConfigError(f"compute_metrics must return a dict of metric name -> number, got "
                              f"{type(result).__name__}.")
        return denumpify_detensorize(result)
