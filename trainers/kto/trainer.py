"""KTOTrainer: Kahneman-Tversky optimization (arXiv:2402.01306) on the shared base, as TRL 1.16's.

Rows are unpaired: a ``prompt``, a ``completion`` and a boolean ``label`` (desirable or not); paired rows
(``chosen``/``rejected``) are unpaired first, as TRL does. One optimizer step, as the base loop runs it: each
micro-batch's rows are forwarded with a gradient; with loss_type='kto' their mismatched pairs too (each
prompt with its neighbour's completion, without a gradient), whose log-ratio against the reference, averaged
over the micro-batch and the processes and clamped at 0, is the KL reference point z0. A desirable row's loss
is lambda_D (1 - sigmoid(beta (r - z0))), an undesirable one's lambda_U (1 - sigmoid(beta (z0 - r))), r its
log-ratio; averaged over the step's rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainers.parallel import distributed as dist
from trainers.loop.base import BaseTrainer
from trainers.data.formats import row_chat_kwargs
from trainers.errors import ConfigError, DatasetFormatError
from trainers.kto.config import KTOConfig
from trainers.logs import logger
from trainers.model.losses import BatchCounts
from trainers.model.modeling import token_logprobs
from trainers.preference.data import (
    PaddedCompletions,
    PreferenceData,
    check_columns,
    check_fit,
    evaluation_totals,
    extract_prompt,
    kept_rows,
    padded_completions,
    reference_scores,
    tokenize_completions,
)
from trainers.model.reference import FrozenReference
from trainers.loop.stats import Stats

UNPAIR_BLOCK = 1000  # TRL unpairs a paired dataset in batched map calls of datasets' default 1,000 rows


def unpaired(rows: list[dict]) -> list[dict]:
    """Paired rows (chosen/rejected, the prompt explicit or implicit) as TRL's unpair_preference_dataset makes
    them: per block of 1,000 rows, every chosen completion (label True), then every rejected one (False)."""
    out = []
    for start in range(0, len(rows), UNPAIR_BLOCK):
        block = rows[start:start + UNPAIR_BLOCK]
        for side, label in (("chosen", True), ("rejected", False)):
            out += [{**{k: v for k, v in row.items() if k not in ("chosen", "rejected")}, "completion": row[side],
                     "label": label} for row in block]
    return out


def tokenize_row(row: dict, tokenizer, where: str) -> dict:
    """``{"prompt", "completion", "label"}`` -> ``{"prompt_ids", "completion_ids", "label"}`` as TRL
    (``tokenize_completions``)."""
    conversational = check_columns(row, where, ("prompt", "completion"), ())
    label = row.get("label")
    if not (isinstance(label, bool) or (isinstance(label, int) and label in (0, 1))):  # TRL reads it as a bool
        raise DatasetFormatError(f"{where} column 'label' must be True (desirable) or False (undesirable), got "
                                 f"{label!r:.40}.")
    kwargs = row_chat_kwargs(row) if conversational else {}
    prompt_ids, (completion_ids,) = tokenize_completions(tokenizer, row["prompt"], [row["completion"]],
                                                         conversational, kwargs)
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "label": bool(label)}


def with_kl_completions(rows: list[dict], chunk: int) -> list[dict]:
    """TRL's mismatched pairs: within each run of ``chunk`` consecutive rows (a micro-batch, in sequential
    order), row i gets row i - 1's completion (the first, the run's last)."""
    for start in range(0, len(rows), chunk):
        run = rows[start:start + chunk]
        for row, previous in zip(run, run[-1:] + run[:-1]):
            row["kl_completion_ids"] = previous["completion_ids"]
    return rows


@dataclass(frozen=True)
class KTOBatch:
    """B rows: their sequences, their mismatched pairs' (loss_type='kto'), labels and precomputed reference
    log-probs."""

    rows: PaddedCompletions  # [B, T]
    kl_rows: PaddedCompletions | None  # [B, T']: each prompt with another row's completion
    labels: torch.Tensor  # [B] bool
    ref_logps: torch.Tensor | None  # [B]
    ref_kl_logps: torch.Tensor | None  # [B]
    loss_mask: torch.Tensor  # [B, 1]: each row counts once in the step's mean
    num_input_tokens: torch.Tensor  # 0-d: the rows' real tokens (not the mismatched pairs', as TRL counts)
    num_padded_tokens: int


class KTOTrainer(PreferenceData, FrozenReference, BaseTrainer):
    """Trains a policy on completions labelled desirable or undesirable. ``ref_model`` as DPO's (None: a frozen
    copy, or with ``peft_config`` the model with its adapters off). Arguments in TRL's order."""

    config_class = KTOConfig
    _tag_names = ("trainers", "kto")

    def __init__(self, model, ref_model=None, args: KTOConfig | None = None, data_collator=None, train_dataset=None,
                 eval_dataset=None, processing_class=None, compute_metrics=None, callbacks=None,
                 optimizers=(None, None), quantization_config=None, peft_config=None):
        for name, value in (("data_collator", data_collator), ("compute_metrics", compute_metrics)):
            if value is not None:
                raise ConfigError(f"KTOTrainer({name}=...) is not supported: the trainer collates its tokenized rows "
                                  f"and logs its own metrics.")
        if ref_model is not None and ref_model is model:  # TRL's rule
            raise ConfigError("`model` and `ref_model` cannot be the same object. In most cases you should omit "
                              "`ref_model` and we'll initialize it to a copy of `model` for you.")
        self._ref_source, self._model_source = ref_model, model
        super().__init__(model, args, train_dataset, eval_dataset, processing_class, peft_config, quantization_config,
                         callbacks, optimizers)

    # ------------------------------------------------------------------ data

    def prepare_data(self, train_dataset, eval_dataset) -> None:
        args, tokenizer = self.args, self.processing_class
        if args.uses_kl and args.train_sampling_strategy != "sequential":  # TRL's rule and words
            raise ConfigError(
                f"Loss type `'{args.loss_type}'` estimates the KL divergence term and requires "
                f"`train_sampling_strategy='sequential'` because the KL completion for each example is precomputed "
                f"against its neighbors in a fixed-order batch; any other strategy breaks that pairing. Got "
                f"`train_sampling_strategy='{args.train_sampling_strategy}'`.")
        if args.uses_kl and self.per_process_train_batch_size <= 1:
            raise ConfigError("Actual (not effective) batch size must be > 1. KTO will not work properly because the "
                              "KL term will be equivalent to the implied reward.")
        pad = tokenizer.pad_token or tokenizer.eos_token
        self.pad_id = tokenizer.convert_tokens_to_ids(pad)
        self.read_rows(train_dataset, eval_dataset, lambda r: len(r["prompt_ids"]) + len(r["completion_ids"]))
        if self.train_rows is not None:  # a stream's balance is not known before training
            self._warn_if_unbalanced(self.train_rows)

    def _prepare(self, raw: list[dict], name: str, first: int, tokenizer) -> list[dict]:
        """Rows (a stream's chunk: unpaired and paired off within it) as token ids with their mismatched pairs."""
        if "chosen" in raw[0] and "rejected" in raw[0]:  # paired: unpaired as TRL does
            if "prompt" not in raw[0]:
                for row in raw:
                    row["prompt"], row["chosen"], row["rejected"] = extract_prompt(row["chosen"], row["rejected"])
            raw = unpaired(raw)
        rows = [tokenize_row(row, tokenizer, f"{name} row {first + index}") for index, row in enumerate(raw)]
        limit = self.args.max_length
        if limit is not None:
            rows = kept_rows(rows, lambda row: len(row["prompt_ids"]) < limit, name,
                             f"have a prompt of max_length={limit} tokens or more, so no completion token would "
                             f"remain", self.accelerator.is_main_process)
        return with_kl_completions(rows, self.per_process_train_batch_size) if self.args.uses_kl else rows

    def _warn_if_unbalanced(self, rows: list[dict]) -> None:
        """TRL's advice: desirable_weight x desirable rows should be about undesirable_weight x undesirable rows
        (within 1 to 4/3)."""
        args = self.args
        desirable = max(sum(row["label"] for row in rows), 1)
        undesirable = max(len(rows) - desirable, 1)
        if desirable == undesirable or not self.accelerator.is_main_process:
            return
        low = undesirable * args.undesirable_weight / desirable  # the desirable_weight that balances them
        high = low * 1.33
        if not (low <= args.desirable_weight <= high):
            logger.warning(f"train_dataset has {desirable} desirable and {undesirable} undesirable rows: set "
                           f"desirable_weight to between {low:.2f} and {high:.2f} (or undesirable_weight so that "
                           f"desirable_weight x {desirable} is about undesirable_weight x {undesirable}), as the KTO "
                           f"paper advises.")

    def _check_fit(self, model, name: str, rows: list[dict]) -> None:
        top = max(max(row["prompt_ids"] + row["completion_ids"]) for row in rows)
        longest = max(len(row["prompt_ids"]) + len(row["completion_ids"]) for row in rows)
        check_fit(model, name, top, min(longest, self.args.max_length or longest), self.args.max_length)

    def _collate(self, rows: list[dict]) -> KTOBatch:
        args, device = self.args, self.accelerator.device
        prompts = [row["prompt_ids"] for row in rows]
        main = padded_completions(prompts, [row["completion_ids"] for row in rows], self.pad_id, args.max_length,
                                  "keep_start", args.pad_to_multiple_of).to(device)
        kl = padded_completions(prompts, [row["kl_completion_ids"] for row in rows], self.pad_id, args.max_length,
                                "keep_start", args.pad_to_multiple_of).to(device) if args.uses_kl else None
        precomputed = all("ref_logps" in row for row in rows)
        ref = torch.tensor([row["ref_logps"] for row in rows], device=device) if precomputed else None
        ref_kl = torch.tensor([row["ref_kl_logps"] for row in rows], device=device) \
            if precomputed and args.uses_kl else None
        return KTOBatch(main, kl, torch.tensor([row["label"] for row in rows], device=device), ref, ref_kl,
                        torch.ones((len(rows), 1), device=device), main.attention_mask.sum(),
                        main.input_ids.numel())

    # ------------------------------------------------------------------ models

    def after_load(self, model) -> None:
        super().after_load(model)  # PreferenceData's: pad id, the rows' fit, dropout
        self.load_reference(model, self._ref_source, self._model_source, self.args.precompute_ref_log_probs)

    def after_prepare(self) -> None:
        self.prepare_reference()
        if self.args.precompute_ref_log_probs:
            self._precompute_reference(self.train_rows, self.per_process_train_batch_size)
            for rows in self.eval_row_sets():  # named eval datasets too: evaluated after training as they were
                self._precompute_reference(rows, self.per_process_eval_batch_size)

    def _precompute_reference(self, rows: list[dict], batch_size: int) -> None:
        """precompute_ref_log_probs: every row's (and its mismatched pair's) reference log-prob, kept in the row;
        each process computes its share and receives the others' (``reference_scores``)."""
        def score(chunk: list[dict]) -> list[tuple[float, float | None]]:
            batch = self._collate([{k: v for k, v in r.items() if not k.startswith("ref_")} for r in chunk])
            logps = self._sums(reference, batch.rows).tolist()
            kl = self._sums(reference, batch.kl_rows).tolist() if batch.kl_rows is not None else [None] * len(chunk)
            return list(zip(logps, kl))

        self.model_wrapped.eval()
        with torch.no_grad(), self.accelerator.autocast(), self.reference() as reference:
            scores = reference_scores(self.accelerator, rows, self.args.precompute_ref_batch_size or batch_size,
                                      score)
        self.model_wrapped.train()
        for row, (logps, kl) in zip(rows, scores):
            row["ref_logps"] = logps
            if kl is not None:
                row["ref_kl_logps"] = kl

    # ------------------------------------------------------------------ loss

    def _forward(self, model, rows: PaddedCompletions, with_stats: bool = False) -> dict:
        """log-probs of the completion tokens [R, T] (0 elsewhere) and their sums [R]; ``with_stats``: the
        entropy and the vocabulary-mean logit [R, T] too."""
        out = token_logprobs(model, rows.input_ids, rows.target_ids, attention_mask=rows.attention_mask,
                             with_entropy=with_stats, with_router_loss=with_stats and bool(self.router_aux_loss_coef),
                             with_mean_logit=with_stats)
        out["sums"] = (out["logps"] * rows.completion_mask).sum(-1)
        return out

    def _sums(self, model, rows: PaddedCompletions) -> torch.Tensor:
        return self._forward(model, rows)["sums"].float()

    def _kl(self, model, batch: KTOBatch) -> torch.Tensor:
        """The KL reference point z0: the mismatched pairs' mean log-ratio, over this micro-batch and then over
        the processes (one collective), detached, clamped at 0; 0 without it (apo_zero_unpaired)."""
        if batch.kl_rows is None:
            return torch.zeros((), device=batch.labels.device)
        with torch.no_grad():
            policy = self._sums(model, batch.kl_rows)
            if batch.ref_kl_logps is not None:
                reference = batch.ref_kl_logps.float()
            else:
                with self.reference() as ref_model:
                    reference = self._sums(ref_model, batch.kl_rows)
        local = (policy - reference).mean()
        return (dist.all_reduce_sum(self.accelerator, local) / self.accelerator.num_processes).clamp(min=0)

    def _row_loss(self, model, batch: KTOBatch) -> tuple[torch.Tensor, Stats, dict]:
        """Per-row losses [B] and the micro-batch's statistics."""
        args = self.args
        kl = self._kl(model, batch)
        out = self._forward(model, batch.rows, with_stats=True)
        if batch.ref_logps is not None:
            ref_logps = batch.ref_logps.float()
        else:
            with torch.no_grad(), self.reference() as ref_model:
                ref_logps = self._sums(ref_model, batch.rows)
        logratios = out["sums"].float() - ref_logps  # [B]
        desirable = batch.labels
        if args.loss_type == "kto":
            chosen = 1 - torch.sigmoid(args.beta * (logratios - kl))
            rejected = 1 - torch.sigmoid(args.beta * (kl - logratios))
        else:  # apo_zero_unpaired
            chosen = 1 - torch.sigmoid(args.beta * logratios)
            rejected = torch.sigmoid(args.beta * logratios)
        per_row = torch.where(desirable, args.desirable_weight * chosen, args.undesirable_weight * rejected)
        rewards, sums = args.beta * logratios.detach(), out["sums"].detach().float()
        mask = batch.rows.completion_mask
        chosen_count, rejected_count = desirable.sum().float(), (~desirable).sum().float()
        stats: Stats = {
            "kl": (kl.detach(), 1.0),
            "rewards/chosen": (rewards[desirable].sum(), chosen_count),
            "logps/chosen": (sums[desirable].sum(), chosen_count),
            "rewards/rejected": (rewards[~desirable].sum(), rejected_count),
            "logps/rejected": (sums[~desirable].sum(), rejected_count),
            "entropy": ((out["entropy"].detach() * mask).sum(), mask.sum()),
            # the vocabulary-mean logit over the desirable (undesirable) rows' completion tokens, as TRL
            "logits/chosen": ((out["mean_logit"] * mask)[desirable].sum(), mask[desirable].sum()),
            "logits/rejected": ((out["mean_logit"] * mask)[~desirable].sum(), mask[~desirable].sum()),
        }
        return per_row, stats, out

    def compute_loss(self, model, batch: KTOBatch, counts: BatchCounts) -> tuple[torch.Tensor, Stats]:
        with self.accelerator.autocast():
            per_row, stats, out = self._row_loss(model, batch)
        loss = per_row.sum() / max(counts.sequences, 1.0)  # the mean over the step's rows (every process)
        return self.add_router_loss(loss, out, counts, stats), stats

    def after_optimizer_step(self, metrics: dict) -> None:
        self.sync_reference()  # TR-DPO (sync_ref_model)

    def derive_metrics(self, metrics: dict, prefix: str) -> None:
        """rewards/margins, as TRL: the chosen reward minus the rejected one (when there are both). Without
        desirable (or undesirable) rows there are no chosen (or rejected) metrics, as TRL logs none, rather than
        NaN (which trackers drop)."""
        for name in ("rewards/chosen", "logps/chosen", "logits/chosen", "rewards/rejected", "logps/rejected",
                     "logits/rejected"):
            value = metrics.get(prefix + name)
            if value is not None and value != value:  # NaN: no such rows on any process
                del metrics[prefix + name]
        chosen, rejected = metrics.get(f"{prefix}rewards/chosen"), metrics.get(f"{prefix}rewards/rejected")
        if chosen is not None and rejected is not None:
            metrics[f"{prefix}rewards/margins"] = chosen - rejected

    # ------------------------------------------------------------------ evaluation

    def evaluation_stats(self) -> Stats:
        """eval_loss (the mean over rows), kl, rewards and logps over the eval rows (``evaluation_totals``)."""
        def measure(rows: list[dict]) -> Stats:
            with self.accelerator.autocast():
                per_row, stats, _ = self._row_loss(self.model_wrapped, self._collate(rows))
            return stats | {"loss": (per_row.detach().sum(), float(per_row.shape[0]))}

        return evaluation_totals(self.accelerator, self.eval_rows, self.eval_rows_per_batch(), measure,
                                 lambda: self.callback_handler.fire("prediction_step"))
