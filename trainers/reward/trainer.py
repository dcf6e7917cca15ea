"""RewardTrainer: a reward model (a sequence classifier with one score) trained on preference pairs with the
Bradley-Terry loss, as TRL 1.16's: -log sigmoid(score(chosen) - score(rejected) - margin), plus, with
center_rewards_coefficient, that coefficient times (score(chosen) + score(rejected))^2. The saved model is a
reward model ``GRPOTrainer(reward_funcs=<its folder>)`` loads as it is.

Rows hold ``chosen`` and ``rejected`` (each the whole sequence, or the completion after a ``prompt`` column), as
text or messages, and optionally a ``margin``. A micro-batch's B pairs are one forward of their 2B sequences,
packed into rows as long as the longest (``ScoreBatch``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from trainers.loop.base import BaseTrainer
from trainers.data.formats import chat_ids, row_chat_kwargs
from trainers.errors import ConfigError, DatasetFormatError, ModelLoadError
from trainers.model.losses import BatchCounts
from trainers.data.packing import pack_bfd
from trainers.preference.data import PreferenceData, check_columns, check_fit, evaluation_totals, kept_rows
from trainers.reward.config import RewardConfig
from trainers.loop.stats import Extreme, Stats


def tokenize_preference(row: dict, tokenizer, eos: str, where: str) -> dict:
    """A row -> ``{"chosen_ids", "rejected_ids"}`` (and ``margin``), as TRL: text completions end with EOS, a
    prompt goes before each completion, and the whole is tokenized (messages through the chat template)."""
    conversational = check_columns(row, where, ("chosen", "rejected"), ("prompt",))
    chosen, rejected, prompt = row["chosen"], row["rejected"], row.get("prompt")
    if conversational:
        kwargs = row_chat_kwargs(row)
        prompt = prompt or []
        out = {"chosen_ids": chat_ids(tokenizer, prompt + chosen, **kwargs),
               "rejected_ids": chat_ids(tokenizer, prompt + rejected, **kwargs)}
    else:
        prompt = prompt or ""
        chosen = chosen if chosen.endswith(eos) else chosen + eos
        rejected = rejected if rejected.endswith(eos) else rejected + eos
        out = {"chosen_ids": tokenizer(prompt + chosen)["input_ids"],
               "rejected_ids": tokenizer(prompt + rejected)["input_ids"]}
    if row.get("margin") is not None:
        if not isinstance(row["margin"], (int, float)):
            raise DatasetFormatError(f"{where} column 'margin' must be a number, got {row['margin']!r:.40}.")
        out["margin"] = float(row["margin"])
    return out


@dataclass(frozen=True)
class ScoreBatch:
    """B pairs' 2B sequences (the chosen ones, then the rejected ones) packed into R rows of W positions, best-fit
    decreasing, positions restarting per sequence (no attention between sequences), so short sequences do not
    pay for the longest one's padding; each sequence's score is read at its last token."""

    input_ids: torch.Tensor  # [R, W]
    position_ids: torch.Tensor  # [R, W]: restarting per sequence
    last: tuple[torch.Tensor, torch.Tensor]  # ([2B] rows, [2B] columns): each sequence's last token
    margin: torch.Tensor | None  # [B] float, or None
    loss_mask: torch.Tensor  # [B, 1]: each pair counts once in the step's means
    num_input_tokens: torch.Tensor  # 0-d: the real tokens
    num_padded_tokens: int  # R x W


def score_head(model: torch.nn.Module) -> torch.nn.Module:
    """The sequence classifier's score head (``score``, PEFT's modules_to_save copy of it included): it scores
    every position, and the model reads its last token's. A classifier without one (an encoder's pooled
    ``classifier``) is refused."""
    heads = [(name, module) for name, module in model.named_modules() if name.split(".")[-1] == "score"]
    if not heads:
        raise ConfigError(f"RewardTrainer needs a decoder sequence classifier with a `score` head, as transformers' "
                          f"*ForSequenceClassification of causal LMs have (Llama, Qwen2, Mistral, ...); "
                          f"{type(model).__name__} has none.")
    return min(heads, key=lambda item: len(item[0]))[1]


class RewardTrainer(PreferenceData, BaseTrainer):
    """Trains a reward model on preference pairs. ``model``: a path (loaded as a sequence classifier with
    ``num_labels=1``, as TRL loads it, a causal LM's folder included) or such a model. Arguments in TRL's
    order."""

    config_class = RewardConfig
    _tag_names = ("trainers", "reward-trainer")

    def __init__(self, model, args: RewardConfig | None = None, data_collator=None, train_dataset=None,
                 eval_dataset=None, processing_class=None, compute_metrics=None, callbacks=None,
                 optimizers=(None, None), optimizer_cls_and_kwargs=None, preprocess_logits_for_metrics=None,
                 quantization_config=None, peft_config=None):
        for name, value in (("data_collator", data_collator), ("compute_metrics", compute_metrics),
                            ("preprocess_logits_for_metrics", preprocess_logits_for_metrics)):
            if value is not None:
                raise ConfigError(f"RewardTrainer({name}=...) is not supported: the trainer collates its tokenized "
                                  f"pairs and logs accuracy, margin and the rewards' min / mean / max itself.")
        super().__init__(model, args, train_dataset, eval_dataset, processing_class, peft_config, quantization_config,
                         callbacks, optimizers, optimizer_cls_and_kwargs)

    # ------------------------------------------------------------------ the model

    def load_model(self, model):
        """A sequence classifier with one score (TRL's ``AutoModelForSequenceClassification``, ``num_labels=1``)."""
        from transformers import AutoModelForSequenceClassification

        if not isinstance(model, str):
            if getattr(model.config, "num_labels", None) != 1:  # TRL's rule
                raise ConfigError(f"The model has `num_labels={model.config.num_labels}`, but reward models require "
                                  f"`num_labels=1` to output a single scalar reward per sequence. Please instantiate "
                                  f"your model with `num_labels=1` or pass a model name as a string.")
            score_head(model)  # before training: the packed forward reads it
            return model
        kwargs = {"dtype": torch.float32, **dict(self.args.model_init_kwargs or {}), "num_labels": 1}
        kwargs.setdefault("trust_remote_code", self.args.trust_remote_code)
        try:
            loaded = AutoModelForSequenceClassification.from_pretrained(model, **kwargs)
        except (OSError, ValueError) as error:
            raise ModelLoadError(f"Could not load {model!r} as a sequence classifier (num_labels=1): {error}"
                                 ) from error
        score_head(loaded)
        return loaded

    def after_prepare(self) -> None:
        self.score_head = score_head(self.unwrapped_model)  # PEFT's copy of it included; read by every forward

    # ------------------------------------------------------------------ data

    def prepare_data(self, train_dataset, eval_dataset) -> None:
        args, tokenizer = self.args, self.processing_class
        if args.eos_token is not None:
            if args.eos_token not in tokenizer.get_vocab():
                raise ConfigError(f"RewardConfig: `eos_token={args.eos_token!r}` is not in the tokenizer's vocabulary.")
            tokenizer.eos_token = args.eos_token
        pad = args.pad_token or tokenizer.pad_token or tokenizer.eos_token
        if pad not in tokenizer.get_vocab():
            raise ConfigError(f"RewardConfig: the pad token {pad!r} is not in the tokenizer's vocabulary.")
        self.pad_id = tokenizer.convert_tokens_to_ids(pad)
        self.read_rows(train_dataset, eval_dataset, lambda r: max(len(r["chosen_ids"]), len(r["rejected_ids"])))

    def _prepare(self, raw: list[dict], name: str, first: int, tokenizer) -> list[dict]:
        eos = tokenizer.eos_token or ""
        pairs = [tokenize_preference(row, tokenizer, eos, f"{name} row {first + i}") for i, row in enumerate(raw)]
        if len({"margin" in p for p in pairs}) > 1:
            raise DatasetFormatError(f"{name}: some rows have a 'margin' and some do not; give every row one.")
        limit = self.args.max_length
        if limit is not None:
            pairs = kept_rows(pairs, lambda p: max(len(p["chosen_ids"]), len(p["rejected_ids"])) <= limit, name,
                              f"have a sequence longer than max_length={limit}", self.accelerator.is_main_process)
        return pairs

    def _check_fit(self, model, name: str, pairs: list[dict]) -> None:
        top = max(max(p["chosen_ids"] + p["rejected_ids"]) for p in pairs)
        longest = max(max(len(p["chosen_ids"]), len(p["rejected_ids"])) for p in pairs)
        check_fit(model, name, top, longest, self.args.max_length)

    def _collate(self, pairs: list[dict]) -> ScoreBatch:
        """The pairs' sequences packed into rows as long as the longest (``ScoreBatch``)."""
        sequences = [p["chosen_ids"] for p in pairs] + [p["rejected_ids"] for p in pairs]
        width = max(len(ids) for ids in sequences)
        if self.args.pad_to_multiple_of:
            width = -(-width // self.args.pad_to_multiple_of) * self.args.pad_to_multiple_of
        bins = pack_bfd([len(ids) for ids in sequences], width)
        input_ids = torch.full((len(bins), width), self.pad_id, dtype=torch.long)
        positions = torch.zeros((len(bins), width), dtype=torch.long)
        rows, columns = [0] * len(sequences), [0] * len(sequences)
        for row, members in enumerate(bins):
            start = 0
            for index in sorted(members):
                ids = sequences[index]
                input_ids[row, start:start + len(ids)] = torch.tensor(ids)
                positions[row, start:start + len(ids)] = torch.arange(len(ids))
                rows[index], columns[index] = row, start + len(ids) - 1
                start += len(ids)
        device = self.accelerator.device
        margin = torch.tensor([p["margin"] for p in pairs], device=device) if "margin" in pairs[0] else None
        tokens = torch.tensor(float(sum(len(ids) for ids in sequences)), device=device)
        return ScoreBatch(input_ids.to(device), positions.to(device),
                          (torch.tensor(rows, device=device), torch.tensor(columns, device=device)), margin,
                          torch.ones((len(pairs), 1), device=device), tokens, input_ids.numel())

    # ------------------------------------------------------------------ loss

    def _pair_loss(self, model, batch: ScoreBatch) -> tuple[torch.Tensor, Stats, dict]:
        """Per-pair losses [B] and the micro-batch's statistics."""
        kwargs = {"output_router_logits": True} if self.router_aux_loss_coef else {}
        # the score head scores every position of the packed rows; the model's own reading (each row's last
        # non-pad token) does not know the packing, so each sequence's last token is read here
        per_position = []
        hook = self.score_head.register_forward_hook(
            lambda module, args, output: per_position.append(output))
        try:
            outputs = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False, **kwargs)
        finally:
            hook.remove()
        scores = per_position[-1][batch.last[0], batch.last[1], 0].float()  # [R, W, 1] -> [2B]
        chosen, rejected = scores.chunk(2)  # [B], [B]
        difference = chosen - rejected if batch.margin is None else chosen - rejected - batch.margin
        per_pair = -F.logsigmoid(difference)
        if self.args.center_rewards_coefficient is not None:
            per_pair = per_pair + self.args.center_rewards_coefficient * (chosen + rejected) ** 2
        pairs, detached = float(chosen.shape[0]), scores.detach()
        stats: Stats = {
            "accuracy": ((chosen > rejected).float().sum().detach(), pairs),
            "margin": ((chosen - rejected).detach().sum(), pairs),
            "mean_reward": (detached.sum(), 2 * pairs),
            "min_reward": Extreme(detached.min(), "min"),
            "max_reward": Extreme(detached.max(), "max"),
        }
        return per_pair, stats, {"aux_loss": getattr(outputs, "aux_loss", None)}

    def compute_loss(self, model, batch: ScoreBatch, counts: BatchCounts) -> tuple[torch.Tensor, Stats]:
        with self.accelerator.autocast():
            per_pair, stats, out = self._pair_loss(model, batch)
        loss = per_pair.sum() / max(counts.sequences, 1.0)  # the mean over the step's pairs (every process)
        return self.add_router_loss(loss, out, counts, stats), stats

    # ------------------------------------------------------------------ evaluation

    def evaluation_stats(self) -> Stats:
        """eval_loss, accuracy, margin and mean_reward over the eval pairs, min_reward and max_reward the lowest
        and highest score of any (``evaluation_totals``)."""
        def measure(pairs: list[dict]) -> Stats:
            with self.accelerator.autocast():
                per_pair, stats, _ = self._pair_loss(self.model_wrapped, self._collate(pairs))
            return stats | {"loss": (per_pair.detach().sum(), float(per_pair.shape[0]))}

        return evaluation_totals(self.accelerator, self.eval_rows, self.eval_rows_per_batch(), measure,
                                 lambda: self.callback_handler.fire("prediction_step"))
