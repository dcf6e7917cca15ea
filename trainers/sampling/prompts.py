"""GRPO's prompts: the training and evaluation datasets' ``prompt`` column tokenized and checked before training
(each prompt with room for max_completion_length in the model's context, the accuracy reward's references, the
tool loop's conversational rows), a stream's chunks as they are read, and the placeholder rows when an
environment owns the data. A mixin of GRPOTrainer: what it sets (``train_rows``, ``train_prompt_ids``,
``eval_rows``, ``eval_prompt_ids``) is the trainer's data state."""

from __future__ import annotations

from trainers.agents.tool_loop import EMPTY_PROMPT
from trainers.errors import ConfigError, DatasetFormatError
from trainers.generation.prompts import PromptRow, tokenize_prompt_rows, tokenize_prompts
from trainers.logs import logger
from trainers.model.modeling import context_length
from trainers.sampling.reward_functions import accuracy_reward, check_accuracy_references
from trainers.data.streaming import (
    IndexedBatches,
    PerThread,
    is_stream,
    note_map_style_workers,
    refuse_dispatch_batches,
    stream_batches,
)


class Placeholder(list):
    """train_dataset=None with an environment_factory: prepare_data makes a round's worth of empty prompts."""


class SamplingPrompts:
    """The prompt datasets of a GRPOTrainer (module docstring)."""

    @staticmethod
    def _placeholder_rows(environment_factory, args) -> Placeholder:
        """No train_dataset with an environment_factory: the environment owns the data, reset() gives each prompt
        (TRL's rule, TRL's errors)."""
        if isinstance(environment_factory, dict):
            raise ConfigError("A dict environment_factory (several environments) needs a train_dataset with an "
                              "'environment' column to route each row to its environment. Give a dataset, or a "
                              "single environment factory.")
        if args is None or args.max_steps <= 0:
            raise ConfigError("Training without a train_dataset (the environment owns the data and returns the "
                              "prompt from reset()) needs max_steps > 0 to set the run's length: "
                              "GRPOConfig(max_steps=...).")
        return Placeholder()

    def _prompt_kwargs(self) -> dict | None:
        """chat_template_kwargs for tokenizing the dataset's prompts: with tools, every tool's schema (the prompts'
        lengths then bound what a round renders; the round renders each prompt with its own tools)."""
        if self.tool_loop is None:
            return self.args.chat_template_kwargs
        schemas = {s["function"]["name"]: s for group in self.tool_loop.schemas.values() for s in group}
        return {**(self.args.chat_template_kwargs or {}), "tools": list(schemas.values()) or None}

    def _prompts(self, dataset, name: str) -> tuple[list[dict], list[list[int]]]:
        rows, ids = tokenize_prompts(dataset, name, self.processing_class, self._prompt_kwargs())
        if any(r.func is accuracy_reward for r in self.rewards):
            check_accuracy_references(rows, name)
        if self.tool_loop is not None:
            self.tool_loop.check_rows(rows, name)
        return rows, ids

    def _prompt_chunk(self, raw: list[dict], first: int) -> list[PromptRow]:
        """A chunk of a streamed train_dataset (its raw rows ``first``, ``first + 1``, ...) as prompts, checked as
        ``_prompts`` checks a dataset; it may run in a worker thread, with that thread's copy of the tokenizer."""
        ids = tokenize_prompt_rows(raw, "train_dataset", self._tokenizers.get(), self._prompt_kwargs(), first)
        if any(r.func is accuracy_reward for r in self.rewards):
            check_accuracy_references(raw, f"train_dataset (the chunk from row {first})")
        if self.tool_loop is not None:
            self.tool_loop.check_rows(raw, "train_dataset", first)
        return [PromptRow(row, row_ids) for row, row_ids in zip(raw, ids)]

    def read_train_prompts(self, train_dataset) -> None:
        """The training prompts: a dataset tokenized and checked now (``train_rows``, ``train_prompt_ids``), or a
        stream read in order during training, a chunk tokenized at a time; ``prompt_batches`` gives each round's
        prompts (trainers/data/streaming.py)."""
        args = self.args
        if isinstance(train_dataset, Placeholder):  # a round's worth of empty prompts, cycled (TRL's)
            train_dataset = [{"prompt": list(EMPTY_PROMPT)} for _ in range(self.prompts_per_round)]
        self._given_train_dataset = train_dataset  # trainer.train_dataset: as given, as TRL keeps it
        if is_stream(train_dataset) and args.dataloader_num_workers:
            # TRL's rule: a stream is read by one worker, whose order keeps each prompt's group together
            if self.accelerator.is_main_process:
                logger.warning(f"Iterable datasets require `dataloader_num_workers=0` to preserve prompt grouping; "
                               f"overriding the provided value ({args.dataloader_num_workers}).")
            args.dataloader_num_workers = 0
        if is_stream(train_dataset):  # read in order during training, a chunk of prompts tokenized at a time
            self.train_rows = self.train_prompt_ids = self.prompt_sampler = None
            # a copy of the tokenizer for each worker thread (dataloader_num_workers): one thread at a time may use
            # a fast tokenizer
            self._tokenizers = PerThread(self.processing_class)
            self.prompt_batches = stream_batches(args, self.accelerator, train_dataset, self._prompt_chunk, self.prompts_per_round)
        else:
            self.train_rows, self.train_prompt_ids = self._prompts(train_dataset, "train_dataset")
            self.prompt_sampler = self.batch_sampler([len(ids) for ids in self.train_prompt_ids],
                                                     self.prompts_per_round, "generation round")
            self.prompt_batches = IndexedBatches(
                [PromptRow(row, ids) for row, ids in zip(self.train_rows, self.train_prompt_ids)], self.prompt_sampler)
            note_map_style_workers(args, self.accelerator)

    def prompt_lengths(self) -> list[int]:
        """The token counts of every prompt known before training (the train and eval datasets; a stream's are
        not known)."""
        return [len(ids) for ids in (self.train_prompt_ids or []) + (self.eval_prompt_ids or [])]

    def _check_budget(self, name: str, prompt_ids: list[list[int]], first: int = 0) -> None:
        """With token_budget, every training prompt plus max_completion_length fits in it (rows counted from
        ``first`` in errors: a chunk of a stream)."""
        budget = self.forward_token_budget
        longest = max(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]), default=None)
        if budget is None or longest is None:
            return
        need = len(prompt_ids[longest]) + self.args.max_completion_length
        if need > budget:
            raise ConfigError(
                f"{type(self.args).__name__}: token_budget={budget} cannot hold {name} row {first + longest} (its prompt has "
                f"{len(prompt_ids[longest])} tokens) with max_completion_length={self.args.max_completion_length} "
                f"tokens of completion: set token_budget >= {need}.")

    def _check_context(self, model, name: str, prompt_ids: list[list[int]], first: int = 0) -> None:
        """Every prompt leaves room for max_completion_length tokens in the model's context (rows counted from
        ``first`` in errors: a chunk of a stream)."""
        context = context_length(model)
        for index, ids in enumerate(prompt_ids if context else [], start=first):
            if len(ids) + self.args.max_completion_length > context:
                raise DatasetFormatError(
                    f"{name} row {index}: the prompt has {len(ids)} tokens; with max_completion_length="
                    f"{self.args.max_completion_length} that exceeds the model's context of {context} tokens. "
                    f"Shorten the prompt or lower max_completion_length.")

    def tokenize_eval(self, dataset, name: str) -> None:
        """Validate and tokenize ``dataset`` as the evaluation prompts (all but the model's context check)."""
        if is_stream(dataset):  # given to evaluate(): TRL's rule there too
            refuse_dispatch_batches(self.args)
        self.eval_rows, self.eval_prompt_ids = self._prompts(dataset, name)
        self.eval_given = dataset  # trainer.eval_dataset

    def check_eval_fit(self, model, name: str) -> None:
        self._check_context(model, name, self.eval_prompt_ids)

