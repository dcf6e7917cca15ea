"""SFTTrainer: supervised fine-tuning on text, conversations, prompt/completion pairs or token ids."""

from __future__ import annotations

import torch
from transformers.integrations.neftune import activate_neftune, deactivate_neftune
from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

from trainers.loop.base import BaseTrainer
from trainers.data.formats import DatasetFormatError, as_dataset
from trainers.errors import ConfigError
from trainers.logs import logger
from trainers.model.losses import SFT_TOKEN_LOSSES, BatchCounts, aggregate_token_mean
from trainers.model.modeling import (
    context_length,
    generation_eos_ids,
    prompt_learning_config,
    token_logprobs,
    virtual_token_count,
    vocabulary_size,
)
from trainers.data.samplers import local_slice
from trainers.sft.batch import SFTBatch
from trainers.sft.config import SFTConfig
from trainers.sft.predictions import Predictions, check_metric_functions
from trainers.sft.packing import pack_samples
from trainers.sft.tokenize import (
    IGNORE,
    Collator,
    detect_format,
    given_samples,
    prepared_view,
    resolve_completion_only_loss,
    tokenize_row,
    training_sample,
    transformers_labels,
    truncate,
)
from trainers.loop.stats import Stats
from trainers.data.streaming import (
    IndexedBatches,
    PerThread,
    first_row_columns,
    is_stream,
    load_data_position,
    note_map_style_workers,
    save_data_position,
    stream_batches,
    stream_dispatch_batches,
)


def transformed(dataset) -> bool:
    """Whether ``dataset`` is a ``datasets.Dataset`` with a transform (``set_transform`` / ``with_transform``:
    datasets' 'custom' format), as TRL tells."""
    from datasets import Dataset

    return isinstance(dataset, Dataset) and dataset.format["type"] == "custom"


class SFTTrainer(BaseTrainer):
    """Fine-tunes a causal LM on supervised data; the loss is the token-level NLL (or DFT, loss_type) over trained
    tokens.

    Example::

        trainer = SFTTrainer(model="path/to/model", args=SFTConfig(output_dir="out"), train_dataset=dataset)
        trainer.train()
        trainer.save_model("out/final")
    """

    config_class = SFTConfig
    _tag_names = ("trainers", "sft")  # the model card tags added to the model (TRL: ["trl", "sft"])

    def __init__(self, model, args: SFTConfig | None = None, data_collator=None, train_dataset=None,
                 eval_dataset=None, processing_class=None, compute_loss_func=None, compute_metrics=None,
                 callbacks=None, optimizers=(None, None), optimizer_cls_and_kwargs=None,
                 preprocess_logits_for_metrics=None, peft_config=None, formatting_func=None,
                 quantization_config=None):
        # (TRL's argument order; quantization_config is ours.) The batches are built from the trainer's own
        # tokenized rows (padding-free or length-grouped), which a TRL collator does not read.
        if data_collator is not None:
            raise ConfigError("SFTTrainer(data_collator=...) is not supported: the trainer builds its batches from "
                              "its tokenized rows (padding_free, packing, pad_to_multiple_of, completion_only_loss "
                              "and assistant_only_loss choose how). Leave data_collator unset.")
        # TRL's formatting_func: row -> text, applied before tokenization (also to datasets given to evaluate())
        if formatting_func is not None and not callable(formatting_func):
            raise ConfigError(f"formatting_func must be a function (row -> str), got {type(formatting_func).__name__}.")
        self.formatting_func = formatting_func
        # transformers' compute_metrics(EvalPrediction) -> dict, over the logits of every evaluation
        # (trainers/sft/predictions.py); preprocess_logits_for_metrics(logits, labels) shrinks each batch's logits
        # first
        if args is None or isinstance(args, SFTConfig):  # another type gets BaseTrainer's error
            check_metric_functions(compute_metrics, preprocess_logits_for_metrics, args or self.config_class())
        self.compute_metrics = compute_metrics
        self.preprocess_logits_for_metrics = preprocess_logits_for_metrics
        self._predictions: Predictions | None = None  # the last evaluation's, when it kept them
        self._predicting = False  # predict() runs the evaluation
        # transformers' compute_loss_func(outputs, labels, num_items_in_batch) -> loss, in place of the NLL
        if compute_loss_func is not None and not callable(compute_loss_func):
            raise ConfigError(f"compute_loss_func must be a function (outputs, labels, num_items_in_batch) -> loss, "
                              f"got {type(compute_loss_func).__name__}.")
        if compute_loss_func is not None and getattr(args, "loss_type", "nll") == "dft":  # TRL's rule and words
            raise ConfigError(
                "You passed a `compute_loss_func` together with `loss_type='dft'` to the `SFTTrainer`. When using "
                "`loss_type='dft'`, the loss function is internally set to the DFT loss, so passing a "
                "`compute_loss_func` is not allowed.")
        self.compute_loss_func = compute_loss_func
        super().__init__(model, args, train_dataset, eval_dataset, processing_class, peft_config, quantization_config,
                         callbacks, optimizers, optimizer_cls_and_kwargs)

    def train(self, resume_from_checkpoint: bool | str | None = None):
        """BaseTrainer.train, with NEFTune's embedding noise on while it runs when neftune_noise_alpha is set."""
        if self.args.neftune_noise_alpha is None:
            return super().train(resume_from_checkpoint)
        # transformers' own hook: it adds noise only in training mode, so evaluation (eval mode) sees none
        handle = activate_neftune(self.model_wrapped, self.args.neftune_noise_alpha, self.accelerator)
        try:
            return super().train(resume_from_checkpoint)
        finally:
            deactivate_neftune(self.model_wrapped, handle, self.accelerator)

    # ------------------------------------------------------------------ data

    def prepare_data(self, train_dataset, eval_dataset) -> None:
        args, tokenizer = self.args, self.processing_class
        if args.padding_free and not args.packing and args.max_length is not None:
            # TRL's rule and words, raised where TRL raises it (the trainer; its SFTConfig accepts the values): such
            # rows are not truncated, so max_length would silently not hold
            raise ConfigError(
                "When `padding_free=True` without packing, `max_length` is not enforced. Either enable packing "
                "(e.g., `packing=True, packing_strategy='bfd'`), provide already truncated inputs, or set "
                "`max_length=None`.")
        # TRL's completion_only_loss: None means "the training rows are prompt/completion pairs"
        self.completion_only_loss = resolve_completion_only_loss(args.completion_only_loss,
                                                                 first_row_columns(train_dataset))
        if args.eos_token is not None:
            if args.eos_token not in tokenizer.get_vocab():
                raise ConfigError(f"SFTConfig: `eos_token={args.eos_token!r}` is not in the tokenizer's vocabulary.")
            tokenizer.eos_token = args.eos_token
        if args.skip_prepare_dataset and self.formatting_func is not None:
            raise ConfigError("formatting_func makes text to tokenize, and dataset_kwargs={'skip_prepare_dataset': "
                              "True} uses already tokenized rows as given: drop one of them.")
        self.collator = Collator(tokenizer.pad_token_id, padding_free=args.padding_free,
                                 pad_to_multiple_of=args.pad_to_multiple_of)
        global_batch = self.effective_batch_size
        if is_stream(train_dataset):  # read in order during training, prepared a chunk at a time
            stream_dispatch_batches(args, self.accelerator)
            self.train_rows, self.sampler = None, None
            # a copy of the tokenizer for each worker thread (dataloader_num_workers): one thread at a time may use
            # a fast tokenizer
            self._tokenizers = PerThread(self.processing_class)
            self.train_batches = stream_batches(
                args, self.accelerator, train_dataset, lambda raw, first: self._prepare_chunk(raw, first, "train_dataset", args.packing),
                global_batch)
        else:
            self.train_rows = self._tokenize(train_dataset, "train_dataset", args.packing)
            self.sampler = self.batch_sampler([len(r["input_ids"]) for r in self.train_rows], global_batch,
                                              "global batch")
            self.train_batches = IndexedBatches(self.train_rows, self.sampler)
            note_map_style_workers(args, self.accelerator)
        self._given_train_dataset, self._train_view = train_dataset, None  # trainer.train_dataset
        self.eval_rows = self._tokenize(eval_dataset, "eval_dataset", self.eval_packing) \
            if eval_dataset is not None else None

    @property
    def eval_packing(self) -> bool:
        return self.args.packing if self.args.eval_packing is None else self.args.eval_packing

    def _tokenize(self, dataset, name: str, pack: bool) -> list[dict]:
        """A (map-style) dataset as training samples: tokenized (dataset_num_proc processes), then ``_samples``;
        with skip_prepare_dataset, the rows as given."""
        args = self.args
        if transformed(dataset) and not args.skip_prepare_dataset:  # TRL's rule and words
            raise DatasetFormatError(
                f"{name}: SFTTrainer cannot prepare a dataset that uses `Dataset.with_transform()`. The preparation "
                "pipeline calls `Dataset.map()`, which reads through the transform and can bake a random or stateful "
                "transform into the tokenized columns. Pass `dataset_kwargs={'skip_prepare_dataset': True}` and make "
                "the transform return trainer-ready examples, including tokenized fields, or materialize "
                "deterministic transforms with `Dataset.map()` before constructing the trainer.")
        dataset = as_dataset(dataset, name)
        if args.skip_prepare_dataset:
            return given_samples(self._given_rows(dataset, name), name)
        dataset = self._formatted(dataset, name)
        kwargs = self._row_kwargs(dataset.column_names, name)
        with self.accelerator.main_process_first():
            tokenized = dataset.map(lambda row: tokenize_row(row, **kwargs), remove_columns=dataset.column_names,
                                    num_proc=args.dataset_num_proc, desc=f"tokenizing {name}")
        samples, dropped = self._samples(tokenized["input_ids"], tokenized["labels"], pack)
        if not any(t != IGNORE for sample in samples for t in sample["target_ids"]):
            raise DatasetFormatError(f"No row of {name} has a token to train on (check max_length and the loss masks).")
        if dropped and self.accelerator.is_main_process:
            logger.warning(f"{dropped} rows of {name} have no label left (all -100) after truncation to "
                           f"max_length={args.max_length}: they are dropped, as TRL drops them.")
        return samples

    def _given_rows(self, dataset, name: str) -> list[dict]:
        """skip_prepare_dataset's rows, read through the dataset's transform (set_transform / with_transform) if it
        has one: once, here (TRL's data loader applies it each time it loads a row)."""
        if not transformed(dataset):
            return dataset.to_list()  # a plain read (to_list ignores a format, which holds tensors or arrays)
        if self.accelerator.is_main_process:
            logger.warning(f"{name} has a transform (set_transform / with_transform): with skip_prepare_dataset its "
                           f"rows are read through it once, now, and trained as read; TRL applies it each time it "
                           f"loads a row, so a random transform gives other rows each epoch there.")
        rows = []
        for start in range(0, len(dataset), 1000):
            batch = dataset[start:start + 1000]  # a dict of columns, as the transform returns them
            rows += [dict(zip(batch, values)) for values in zip(*batch.values())]
        return rows

    def _row_kwargs(self, columns, name: str) -> dict:
        """tokenize_row's arguments for a dataset with these ``columns`` (its format detected from them)."""
        args = self.args
        fmt = detect_format(columns, args.dataset_text_field, name)
        if args.assistant_only_loss and fmt != "conversational":
            raise ConfigError(f"assistant_only_loss=True needs a 'messages' column; {name} is in the {fmt} format.")
        return dict(tokenizer=self.processing_class, fmt=fmt, text_field=args.dataset_text_field,
                    eos_token=self.processing_class.eos_token, completion_only_loss=self.completion_only_loss,
                    assistant_only_loss=args.assistant_only_loss)

    def _samples(self, input_ids: list[list[int]], labels: list[list[int]], pack: bool) -> tuple[list[dict], int]:
        """Tokenized rows -> training samples: truncated, shifted, packed (``pack``). Returns them and how many
        rows were dropped: TRL's rule, when rows are truncated to max_length without packing, drops those whose
        labels are all -100 after truncation (a label on the first token alone keeps a row, which then trains
        nothing); rows are otherwise kept, with or without a token to train on. A row with no token is dropped."""
        args = self.args
        length = args.truncation_length(pack)
        drop_masked = args.max_length is not None and not pack
        samples, dropped = [], 0
        for ids, row_labels in zip(input_ids, labels):
            sample = truncate({"input_ids": ids, "labels": row_labels}, length, args.truncation_mode)
            if not sample["input_ids"] or (drop_masked and all(label == IGNORE for label in sample["labels"])):
                dropped += 1
                continue
            samples.append(training_sample(sample))
        if pack and samples:
            samples = pack_samples(samples, args.max_length, args.packing_strategy)
        return samples, dropped

    def _prepare_chunk(self, raw: list[dict], first: int, name: str, pack: bool) -> list[dict]:
        """A chunk of a streamed dataset (raw rows ``first``, ``first + 1``, ... of a pass over it) as training
        samples, made as ``_tokenize`` makes them and packed within the chunk; errors name the row. It may run in
        a worker thread (dataloader_num_workers), with that thread's copy of the tokenizer."""
        if self.args.skip_prepare_dataset:
            return given_samples(raw, name, first)
        if self.formatting_func is not None and "input_ids" not in raw[0]:
            self._check_formatting(list(raw[0]), name)
            raw = [{self.args.dataset_text_field: self._format_row(row, index, name)}
                   for index, row in enumerate(raw, start=first)]
        kwargs = self._row_kwargs(list(raw[0]), f"{name} (row {first} on)")
        kwargs["tokenizer"] = self._tokenizers.get()
        input_ids, labels = [], []
        for index, row in enumerate(raw, start=first):
            try:
                tokenized = tokenize_row(row, **kwargs)
            except DatasetFormatError as error:
                raise DatasetFormatError(f"{name} row {index}: {error}") from error
            input_ids.append(tokenized["input_ids"])
            labels.append(tokenized["labels"])
        return self._samples(input_ids, labels, pack)[0]

    def _formatted(self, dataset, name: str):
        """The dataset as formatting_func's texts in the dataset_text_field column (TRL's language-modeling type)."""
        func, field = self.formatting_func, self.args.dataset_text_field
        if func is None:
            return dataset
        if "input_ids" in dataset.column_names:  # as TRL: the rows are already tokens
            if self.accelerator.is_main_process:
                logger.warning(f"{name} is already tokenized (it has input_ids): formatting_func is not applied.")
            return dataset
        self._check_formatting(dataset.column_names, name)
        with self.accelerator.main_process_first():
            return dataset.map(lambda row, index: {field: self._format_row(row, index, name)}, with_indices=True,
                               remove_columns=dataset.column_names, desc=f"formatting {name}")

    def _check_formatting(self, columns, name: str) -> None:
        """formatting_func makes one text of a row: refused where the loss should cover the completion only."""
        completion_only = self.args.completion_only_loss
        pairs = {"prompt", "completion"} <= set(columns)
        if completion_only or (completion_only is None and pairs):  # None means True for prompt/completion rows
            why = f"completion_only_loss={completion_only}" + (f" with {name}'s prompt/completion rows" if pairs else "")
            raise ConfigError(
                f"formatting_func turns each row into one text, with no completion to restrict the loss to ({why}). "
                "Format the rows before passing them, or set completion_only_loss=False (as TRL requires).")

    def _format_row(self, row: dict, index: int, name: str) -> str:
        text = self.formatting_func(row)
        if not isinstance(text, str):
            raise DatasetFormatError(f"formatting_func returned {type(text).__name__} for row {index} of {name}; "
                                     f"it must return the row's text as a string.")
        return text

    def after_load(self, model) -> None:
        # as TRL: the model's configs agree with the tokenizer on the pad token (its EOS when it has none)
        model.config.get_text_config().pad_token_id = self.processing_class.pad_token_id
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.pad_token_id = self.processing_class.pad_token_id
        if self.args.eos_token is not None:
            # The saved model must stop where it was trained to (TRL does the same): the configs get the new EOS;
            # the generation config keeps its old ones too, since any of them ends generation.
            eos = self.processing_class.eos_token_id
            model.config.get_text_config().eos_token_id = eos
            old = generation_eos_ids(model)
            if getattr(model, "generation_config", None) is not None and eos not in old:
                model.generation_config.eos_token_id = [eos, *old]
        self._check_prompt_learning(model)
        if self.train_rows is not None:  # the eval datasets: check_eval_fit
            self._check_fit(model, "train_dataset", self.train_rows)
        else:  # a stream: each chunk when it is first used (the one read already: now)
            self.train_batches.validate = lambda rows, first: self._check_fit(
                model, f"train_dataset (the chunk from row {first})", rows)

    def _check_prompt_learning(self, model) -> None:
        """A PEFT prompt-learning adapter (peft_config, or a PeftModel given as model) trains on padded rows only:
        PEFT drops position ids under it (prompt tuning, P-tuning) or keeps a cache (prefix tuning), so packed or
        padding-free rows would attend across samples. Its virtual tokens' outputs are left out of the loss
        (trainers.model.modeling.token_logprobs)."""
        config = prompt_learning_config(model)
        args = self.args
        if config is None or not (args.packing or args.padding_free or self.eval_packing):
            return
        option = "packing=True" if args.packing else "padding_free=True" if args.padding_free else "eval_packing=True"
        raise ConfigError(
            f"SFTTrainer: `{option}` does not work with a PEFT prompt-learning adapter ({config.peft_type.value}, "
            f"from peft_config or the PeftModel given as model): PEFT ignores the position ids that keep packed "
            f"samples apart, so they would attend to each other. Turn {option.split('=')[0]} off, or use an adapter "
            f"such as LoRA.")

    def _check_fit(self, model, name: str, rows: list[dict]) -> None:
        """Every token id is in the model's vocabulary and every row fits its context."""
        vocab = vocabulary_size(model)
        top = max((max(r["input_ids"] + [t for t in r["target_ids"] if t >= 0]) for r in rows), default=0)
        if top >= vocab:
            raise DatasetFormatError(f"{name} holds token id {top}, but the model's vocabulary has {vocab} tokens.")
        context = context_length(model)
        context = context and context - virtual_token_count(model)  # prompt tuning's virtual tokens come first
        longest = max(range(len(rows)), key=lambda i: len(rows[i]["input_ids"]), default=None)
        if context and longest is not None and len(rows[longest]["input_ids"]) > context:
            raise ConfigError(
                f"{name}: a {'packed row' if 'position_ids' in rows[longest] else 'sample'} has "
                f"{len(rows[longest]['input_ids'])} tokens, more than the model's context of {context}. "
                f"Set max_length <= {context} (now {self.args.max_length}).")

    def tokenize_eval(self, dataset, name: str) -> None:
        self.eval_rows = self._tokenize(dataset, name, self.eval_packing)

    def check_eval_fit(self, model, name: str) -> None:
        self._check_fit(model, name, self.eval_rows)

    def optimizer_steps_per_epoch(self) -> int:
        # a stream's length is unknown: as transformers, one "epoch" spans max_steps (state.epoch reaches 1 at the end)
        return self.sampler.steps_per_epoch if self.sampler is not None else self.args.max_steps

    # ------------------------------------------------------------------ TRL's dataset attributes

    @property
    def train_dataset(self):
        """The training data as TRL keeps it: the prepared rows as a ``datasets.Dataset`` (``input_ids``, ``labels``
        with -100 where no loss is taken, ``seq_lengths`` for packed rows; e.g. to see which rows survived
        truncation), built on first use; a stream as given (it is prepared a chunk at a time during training)."""
        if self.train_rows is None:
            return self._given_train_dataset
        if self._train_view is None:
            self._train_view = prepared_view(self.train_rows)
        return self._train_view

    @property
    def eval_dataset(self):
        """The evaluation data as TRL keeps it: prepared, as ``train_dataset``; a dict of them for named eval sets."""
        if self.eval_sets:
            return {name: prepared_view(rows["eval_rows"]) for name, rows in self.eval_sets.items()}
        return None if self.eval_rows is None else prepared_view(self.eval_rows)

    # ------------------------------------------------------------------ resume

    def save_extra_state(self, folder: str) -> None:
        save_data_position(self.train_batches, folder, self.accelerator.process_index)

    def load_extra_state(self, folder: str) -> None:
        load_data_position(self.train_batches, folder, self.accelerator.process_index)

    def _to_device(self, collated: dict) -> SFTBatch:
        """A Collator's output as a batch on this process's device."""
        return SFTBatch.from_collated(collated, self.accelerator.device)

    def micro_batch(self, step: int, accumulation_index: int) -> SFTBatch:
        acc = self.accelerator
        rows = local_slice(self.train_batches.batch(step), accumulation_index, acc.process_index,
                           self.per_process_train_batch_size, acc.num_processes)
        return self._to_device(self.collator(rows))

    # ------------------------------------------------------------------ loss

    def _forward(self, model, batch: SFTBatch, with_router_loss: bool = False, with_logits: bool = False) -> dict:
        return token_logprobs(model, batch.input_ids, batch.target_ids, attention_mask=batch.attention_mask,
                              position_ids=batch.position_ids, with_accuracy=True, with_router_loss=with_router_loss,
                              with_logits=with_logits)

    def compute_loss(self, model, batch: SFTBatch, counts: BatchCounts) -> tuple[torch.Tensor, Stats]:
        mask = batch.loss_mask  # [B, T]
        if self.compute_loss_func is not None:  # the user's loss over the whole step's tokens, as transformers
            num_items = torch.tensor(counts.tokens, device=mask.device)  # every process and micro-batch
            loss, out = self._user_loss(model, batch, num_items)
        else:
            out = self._forward(model, batch, with_router_loss=bool(self.router_aux_loss_coef))
            # the per-token loss of loss_type (NLL or DFT), averaged over the step's trained tokens either way
            loss = aggregate_token_mean(SFT_TOKEN_LOSSES[self.args.loss_type](out["logps"]), mask, counts)
        correct = (out["correct"] & mask.bool()).sum()
        stats: Stats = {"mean_token_accuracy": (correct, mask.sum())}
        if self.compute_loss_func is not None:
            return loss, stats  # as TRL: the function's loss alone (a MoE model's aux_loss is in its outputs)
        return self.add_router_loss(loss, out, counts, stats), stats

    def _user_loss(self, model, batch: SFTBatch, num_items_in_batch: torch.Tensor | None) -> tuple[torch.Tensor, dict]:
        """compute_loss_func(outputs, labels, num_items_in_batch) on the model's outputs (logits, and aux_loss for
        a MoE model) and transformers' labels; num_items_in_batch is None in evaluation, as in transformers."""
        router = bool(self.router_aux_loss_coef)
        out = self._forward(model, batch, with_router_loss=router, with_logits=True)
        outputs = MoeCausalLMOutputWithPast(logits=out["logits"], aux_loss=out["aux_loss"]) if router \
            else CausalLMOutputWithPast(logits=out["logits"])
        loss = self.compute_loss_func(outputs, transformers_labels(batch.target_ids),
                                      num_items_in_batch=num_items_in_batch)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ConfigError(f"compute_loss_func must return the loss as a one-element tensor, got "
                              f"{type(loss).__name__}{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}.")
        return loss.reshape(()), out

    def eval_rows_per_batch(self) -> int:
        return self.per_process_eval_batch_size

    def evaluation_stats(self) -> Stats:
        """Token-level loss (loss_type's: NLL or DFT, as TRL evaluates) and accuracy over eval_dataset. Every process
        runs the same number of forward passes (ZeRO-3 gathers weights collectively); a process with no rows left
        repeats row 0 with zero weight. With compute_metrics (or in predict()) each batch's logits are also collected
        for it."""
        args, acc = self.args, self.accelerator
        n, size = len(self.eval_rows), self.eval_rows_per_batch()
        per_process = -(-n // acc.num_processes)
        mine = list(range(acc.process_index, n, acc.num_processes))
        collect = not args.prediction_loss_only and (self._predicting or self.compute_metrics is not None)
        predictions = self._predictions = Predictions(
            acc, args, self.compute_metrics, self.preprocess_logits_for_metrics, keep_all=self._predicting,
        ) if collect else None
        # predictions are per row: a padding-free batch (one flattened row) is evaluated padded instead (same loss)
        collator = self.collator if not (collect and self.collator.padding_free) else \
            Collator(self.processing_class.pad_token_id, pad_to_multiple_of=args.pad_to_multiple_of)
        # eval_loss: loss_type's per-token loss averaged over tokens; with compute_loss_func, its per-batch losses
        # averaged over rows (transformers)
        token_loss = SFT_TOKEN_LOSSES[args.loss_type]
        loss_sum, loss_count = torch.zeros((), device=acc.device), torch.zeros((), device=acc.device)
        correct = torch.zeros((), device=acc.device)
        tokens = torch.zeros((), device=acc.device)
        for start in range(0, per_process, size):
            chunk = mine[start : start + size]
            batch = self._to_device(collator([self.eval_rows[i] for i in chunk or [0]]))
            weight = 1.0 if chunk else 0.0
            mask = batch.loss_mask * weight  # [B, T]
            if self.compute_loss_func is not None:
                batch_loss, out = self._user_loss(self.model_wrapped, batch, None)
                rows = float(len(chunk))
                loss_sum += batch_loss.detach().float() * rows
                loss_count += rows
            else:
                out = self._forward(self.model_wrapped, batch, with_logits=collect)
                batch_sum = (token_loss(out["logps"]) * mask).sum()
                batch_loss = batch_sum / mask.sum().clamp(min=1)
                loss_sum += batch_sum
                loss_count += mask.sum()
            correct += (out["correct"] * mask).sum()
            tokens += mask.sum()
            if predictions is not None:
                predictions.add(chunk, batch, out["logits"], batch_loss, last=start + size >= per_process)
            self.callback_handler.fire("prediction_step")
        return {"loss": (loss_sum, loss_count), "mean_token_accuracy": (correct, tokens)}

    def computed_metrics(self) -> dict:
        predictions = self._predictions
        if predictions is None:
            return {}
        if not self._predicting:
            self._predictions = None  # every row's logits can be large: kept only for predict() to return
        return predictions.metrics()

    def predict(self, test_dataset, ignore_keys: list[str] | None = None, metric_key_prefix: str = "test"):
        """transformers' Trainer.predict: a PredictionOutput of the logits (or what preprocess_logits_for_metrics
        makes of them) and labels of every row of ``test_dataset``, in its order (with eval packing: per packed
        row), padded with -100, and the metrics evaluate() would give (``test_loss``, compute_metrics' ...). Not
        logged; fires on_predict. ``ignore_keys`` changes nothing: only the logits are ever collected."""
        from transformers.trainer_utils import PredictionOutput

        self._predicting = True
        try:
            metrics = self.evaluate_metrics(test_dataset, metric_key_prefix)
        finally:
            self._predicting = False
        predictions, label_ids = self._predictions.arrays() if self._predictions is not None else (None, None)
        self.callback_handler.fire("predict", metrics=metrics)
        return PredictionOutput(predictions=predictions, label_ids=label_ids, metrics=metrics)
