"""DPOTrainer: direct preference optimization (arXiv:2305.18290) and TRL 1.16's variants, on the shared base.

One optimizer step, as the base loop runs it (trainers/loop/base.py): ``micro_batch`` collates this process's pairs
(chosen and rejected sequences in one [2B, T] batch, trainers/dpo/data.py), ``compute_loss`` runs the policy
once over both (the chunked output head: no full-vocabulary logits), takes the reference's log-probs
(precomputed, a frozen copy, or with PEFT the policy with its adapters off), and sums the loss types of
``loss_type`` (trainers/dpo/losses.py), averaged over the step's pairs; ``after_optimizer_step`` moves the
reference toward the policy with ``sync_ref_model``.
"""

from __future__ import annotations

import torch

from trainers.loop.base import BaseTrainer
from trainers.dpo.config import DPOConfig
from trainers.dpo.data import PairBatch, collate_pairs, pair_length, tokenize_pair
from trainers.dpo.losses import LossOptions, PairScores, combined_loss
from trainers.errors import ConfigError
from trainers.logs import logger
from trainers.model.losses import BatchCounts
from trainers.model.modeling import token_logprobs
from trainers.preference.data import PreferenceData, check_fit, evaluation_totals, kept_rows, reference_scores
from trainers.model.reference import FrozenReference
from trainers.loop.stats import Stats


def sequence_logps(token_logps: torch.Tensor, mask: torch.Tensor, ld_alpha: float | None) -> torch.Tensor:
    """Each sequence's completion log-prob: the sum over its completion tokens, or with ld_alpha (LD-DPO) the
    tokens past the shorter completion of its pair weighted by it. token_logps, mask: [2B, T] -> [2B]."""
    if ld_alpha is None:
        return (token_logps * mask).sum(-1)
    position = mask.cumsum(-1)  # [2B, T]: 1, 2, ... along each completion
    lengths = mask.sum(-1)
    chosen, rejected = lengths.chunk(2)
    shared = torch.minimum(chosen, rejected).repeat(2).unsqueeze(-1)  # [2B, 1]
    inside = mask * (position <= shared)
    return (token_logps * inside).sum(-1) + ld_alpha * (token_logps * (mask - inside)).sum(-1)


class DPOTrainer(PreferenceData, FrozenReference, BaseTrainer):
    """Trains a policy on preference pairs. ``ref_model``: the reference (None: a frozen copy of the model, or
    with ``peft_config`` the model with its adapters off, or none with precompute_ref_log_probs). Arguments in
    TRL's order."""

    config_class = DPOConfig
    _tag_names = ("trainers", "dpo")

    def __init__(self, model, ref_model=None, args: DPOConfig | None = None, data_collator=None, train_dataset=None,
                 eval_dataset=None, processing_class=None, compute_metrics=None, callbacks=None,
                 optimizers=(None, None), quantization_config=None, peft_config=None):
        if data_collator is not None:
            raise ConfigError("DPOTrainer(data_collator=...) is not supported: the trainer collates its tokenized "
                              "pairs itself (max_length, truncation_mode and pad_to_multiple_of choose how).")
        if compute_metrics is not None:
            raise ConfigError("DPOTrainer(compute_metrics=...) is not supported (deprecated in TRL's DPO): the "
                              "evaluation logs the loss and the rewards/* and logps/* metrics.")
        if ref_model is not None and ref_model is model:  # TRL's rule
            raise ConfigError("`model` and `ref_model` cannot be the same object. If you want `ref_model` to be the "
                              "same as `model`, you must pass a copy of it, or `None` if you use peft.")
        if ref_model is not None and peft_config is not None:
            raise ConfigError("DPOTrainer: with peft_config the reference is the model with its adapters off; pass "
                              "ref_model=None.")
        self._ref_source, self._model_source = ref_model, model
        super().__init__(model, args, train_dataset, eval_dataset, processing_class, peft_config, quantization_config,
                         callbacks, optimizers)

    # ------------------------------------------------------------------ data

    def prepare_data(self, train_dataset, eval_dataset) -> None:
        args = self.args
        if args.padding_free and self.accelerator.is_main_process:
            logger.warning("DPOConfig.padding_free=True is turned off, as TRL 1.16 does: the pairs train padded.")
        pad = args.pad_token or self.processing_class.pad_token or self.processing_class.eos_token
        if pad not in self.processing_class.get_vocab():
            raise ConfigError(f"DPOConfig: the pad token {pad!r} is not in the tokenizer's vocabulary.")
        self.pad_id = self.processing_class.convert_tokens_to_ids(pad)
        self.read_rows(train_dataset, eval_dataset, pair_length)

    def _prepare(self, raw: list[dict], name: str, first: int, tokenizer) -> list[dict]:
        """Rows as token ids (``tokenize_pair``); with keep_start, a row whose prompt alone reaches max_length is
        dropped, as TRL drops it, with a warning that counts them."""
        pairs = [tokenize_pair(row, tokenizer, f"{name} row {first + index}") for index, row in enumerate(raw)]
        limit = self.args.max_length
        if limit is not None and self.args.truncation_mode == "keep_start":
            pairs = kept_rows(pairs, lambda pair: len(pair["prompt_ids"]) < limit, name,
                              f"have a prompt of max_length={limit} tokens or more, so no completion token would "
                              f"remain", self.accelerator.is_main_process)
        return pairs

    def _check_fit(self, model, name: str, pairs: list[dict]) -> None:
        """Every token id is in the model's vocabulary and every sequence fits its context."""
        top = max(max(p["prompt_ids"] + p["chosen_ids"] + p["rejected_ids"]) for p in pairs)
        longest = max(min(pair_length(p), self.args.max_length or pair_length(p)) for p in pairs)
        check_fit(model, name, top, longest, self.args.max_length)

    def _collate(self, pairs: list[dict]) -> PairBatch:
        args = self.args
        return collate_pairs(pairs, self.pad_id, args.max_length, args.truncation_mode, args.pad_to_multiple_of,
                             self.accelerator.device)

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

    def _precompute_reference(self, pairs: list[dict], batch_size: int) -> None:
        """precompute_ref_log_probs: every pair's reference log-probs, kept in its row (``ref_chosen_logps``,
        ``ref_rejected_logps``); each process computes its share and receives the others' (``reference_scores``)."""
        def score(chunk: list[dict]) -> list[tuple[float, float]]:
            batch = self._collate([{k: v for k, v in p.items() if not k.startswith("ref_")} for p in chunk])
            with self.reference() as reference:
                logps = self._logps(reference, batch)["sums"].float().tolist()  # [2B]: chosen, then rejected
            return [(logps[i], logps[len(chunk) + i]) for i in range(len(chunk))]

        self.model_wrapped.eval()
        with torch.no_grad(), self.accelerator.autocast():
            scores = reference_scores(self.accelerator, pairs, self.args.precompute_ref_batch_size or batch_size,
                                      score)
        self.model_wrapped.train()
        for pair, (chosen, rejected) in zip(pairs, scores):
            pair["ref_chosen_logps"], pair["ref_rejected_logps"] = chosen, rejected

    # ------------------------------------------------------------------ loss

    def _logps(self, model, batch: PairBatch, with_stats: bool = False, with_logits: bool = False) -> dict:
        """One forward over both sides: per-token log-probs [2B, T], their sums [2B] (``sequence_logps``), and
        with ``with_stats`` the entropy, argmax hits and vocabulary-mean logits."""
        out = token_logprobs(model, batch.input_ids, batch.target_ids, attention_mask=batch.attention_mask,
                             with_entropy=with_stats, with_accuracy=with_stats,
                             with_router_loss=with_stats and bool(self.router_aux_loss_coef), with_logits=with_logits,
                             with_mean_logit=with_stats)
        out["logps"] = out["logps"] * batch.completion_mask  # [2B, T]: 0 off the completions (don't-care values)
        out["sums"] = sequence_logps(out["logps"], batch.completion_mask, self.args.ld_alpha)
        return out

    def _scores(self, model, batch: PairBatch, with_stats: bool, sft_scale: float | None = None
                ) -> tuple[PairScores, dict]:
        """The micro-batch's PairScores under ``model`` and its reference, and the policy forward's outputs."""
        out = self._logps(model, batch, with_stats=with_stats, with_logits=self.args.use_weighting)
        if batch.ref_logps is not None:
            reference = batch.ref_logps
        else:
            with torch.no_grad(), self.reference() as ref_model:
                reference = self._logps(ref_model, batch)["sums"].detach()
        chosen, rejected = out["sums"].chunk(2)
        ref_chosen, ref_rejected = reference.float().chunk(2)
        lengths = batch.completion_mask.sum(-1)
        token_logps, mask = out["logps"].chunk(2)[0], batch.completion_mask.chunk(2)[0]
        scores = PairScores(chosen, rejected, ref_chosen, ref_rejected, *lengths.chunk(2), token_logps, mask,
                            sft_scale)
        return scores, out

    def _wpo_weights(self, out: dict, batch: PairBatch) -> torch.Tensor:
        """use_weighting (WPO): each pair's weight, the product of its two completions' length-normalized
        exp(log p - log Σ_v p_v²), detached, as TRL: [B]."""
        with torch.no_grad():
            log_sum_sq = torch.stack([torch.logsumexp(2 * row.float().log_softmax(-1), -1) for row in out["logits"]])
            mask = batch.completion_mask
            mean = ((out["logps"] - log_sum_sq) * mask).sum(-1) / mask.sum(-1).clamp(min=1)
            chosen, rejected = torch.exp(mean).chunk(2)
            return chosen * rejected

    def _pair_loss(self, model, batch: PairBatch, with_stats: bool = True, sft_scale: float | None = None
                   ) -> tuple[torch.Tensor, Stats, dict]:
        """Per-pair losses [B] and the micro-batch's statistics (sums and counts, reduced over processes later).
        ``sft_scale``: pairs per chosen token of the set sft's token mean is over (None: this micro-batch)."""
        args = self.args
        scores, out = self._scores(model, batch, with_stats, sft_scale)
        weights = self._wpo_weights(out, batch) if args.use_weighting else None
        per_pair = combined_loss(scores, LossOptions.from_config(args), args.loss_type, args.weights, weights)
        pairs = float(batch.pairs)
        chosen_rewards = args.beta * scores.chosen_logratios.detach()
        rejected_rewards = args.beta * scores.rejected_logratios.detach()
        stats: Stats = {
            "rewards/chosen": (chosen_rewards.sum(), pairs),
            "rewards/rejected": (rejected_rewards.sum(), pairs),
            "rewards/accuracies": ((chosen_rewards > rejected_rewards).float().sum(), pairs),
            "rewards/margins": ((chosen_rewards - rejected_rewards).sum(), pairs),
            "logps/chosen": (scores.chosen.detach().sum(), pairs),
            "logps/rejected": (scores.rejected.detach().sum(), pairs),
        }
        if with_stats:
            mask = batch.completion_mask
            stats["entropy"] = ((out["entropy"].detach() * mask).sum(), mask.sum())
            chosen_mask, rejected_mask = mask.chunk(2)
            stats["mean_token_accuracy"] = ((out["correct"].chunk(2)[0] * chosen_mask).sum(), chosen_mask.sum())
            chosen_logits, rejected_logits = (out["mean_logit"] * mask).chunk(2)  # [B, T] each
            stats["logits/chosen"] = (chosen_logits.sum(), chosen_mask.sum())
            stats["logits/rejected"] = (rejected_logits.sum(), rejected_mask.sum())
        return per_pair, stats, out

    def compute_loss(self, model, batch: PairBatch, counts: BatchCounts) -> tuple[torch.Tensor, Stats]:
        # counts: the step's pairs (sequences) and chosen tokens, over every micro-batch and process; sft's token
        # mean is over all of them (TRL's is per micro-batch), so the split of the step does not change the loss
        with self.accelerator.autocast():
            per_pair, stats, out = self._pair_loss(model, batch, sft_scale=counts.sequences / max(counts.tokens, 1.0))
        loss = per_pair.sum() / max(counts.sequences, 1.0)  # the mean over the step's pairs (every process)
        return self.add_router_loss(loss, out, counts, stats), stats

    def after_optimizer_step(self, metrics: dict) -> None:
        self.sync_reference()  # TR-DPO (sync_ref_model)

    # ------------------------------------------------------------------ evaluation

    def evaluation_stats(self) -> Stats:
        """eval_loss (the mean over pairs of the combined loss) and the rewards and logps metrics over the eval
        pairs (``evaluation_totals``)."""
        def measure(pairs: list[dict]) -> Stats:
            batch = self._collate(pairs)
            with self.accelerator.autocast():
                per_pair, stats, _ = self._pair_loss(self.model_wrapped, batch)
            return stats | {"loss": (per_pair.detach().sum(), float(batch.pairs))}

        return evaluation_totals(self.accelerator, self.eval_rows, self.eval_rows_per_batch(), measure,
                                 lambda: self.callback_handler.fire("prediction_step"))
