"""Reward functions: the contract, resolving a spec (a callable, a built-in's name, ``module:function``, a reward
model) to one, reward models used as reward functions, and calling them all on a batch of completions. The built-in
rewards themselves are in trainers/sampling/reward_functions.py.

The contract (TRL's): ``f(prompts, completions, completion_ids, **columns) -> list[float | None]``, one value
per completion. ``prompts``/``completions`` are strings, or lists of messages for conversational data; every
other dataset column arrives as a keyword argument (one value per completion), plus ``trainer_state`` and
TRL's two logging hooks, ``log_metric(name, value)`` and ``log_extra(column, values)``. ``None`` means "not
applicable to this sample": it is left out of the weighted sum. A function may be ``async``: the async ones
of a call run concurrently.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
import numbers
import os
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from trainers.agents.runner import EventLoopThread
from trainers.errors import ConfigError, ModelLoadError, RewardFunctionError
from trainers.logs import logger
from trainers.model.modeling import check_model_path
from trainers.sampling.reward_functions import (
    BUILTIN_REWARDS,
    accuracy_reward,
    code_execution_reward,
    format_reward,
    soft_overlong_penalty,
)

# ----------------------------------------------------------------------------------------------------------------
# Reward models
# ----------------------------------------------------------------------------------------------------------------


class RewardModel:
    """A sequence-classification model used as a reward function: the score is logit 0 of prompt+completion.

    Conversational samples are rendered with the reward tokenizer's chat template (and the trainer's
    ``chat_template_kwargs``, as in TRL). A text completion is scored with the reward tokenizer's EOS appended:
    RewardTrainer (ours and TRL's) trains on sequences ending in EOS and reads the score there, so without it the
    score is read at a position the model was never trained on; a truncated completion is judged as if it ended
    where it was cut (as OpenRLHF puts an EOS at the end of every sequence it scores). TRL scores the decoded text
    without EOS: a reward model trained on the demo's arithmetic ranked held-out pairs 92% right with the EOS and
    40% without (docs/reward.md).
    """

    def __init__(self, model, tokenizer, name: str, chat_template_kwargs: dict | None = None):
        self.model, self.tokenizer, self.__name__ = model, tokenizer, name
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        # The model scores the last non-pad token, found by its config's pad id: it must be the tokenizer's (as TRL)
        self.model.config.get_text_config().pad_token_id = self.tokenizer.pad_token_id

    @torch.no_grad()
    def __call__(self, prompts: list, completions: list, **kwargs) -> list[float]:
        eos = self.tokenizer.eos_token or ""
        texts = []
        for prompt, completion in zip(prompts, completions):
            if isinstance(prompt, list):
                texts.append(self.tokenizer.apply_chat_template(prompt + completion, tokenize=False,
                                                                **self.chat_template_kwargs))
            else:
                texts.append(prompt + completion + ("" if completion.endswith(eos) else eos))
        device = next(self.model.parameters()).device
        inputs = self.tokenizer(texts, return_tensors="pt", padding=True, padding_side="right",
                                add_special_tokens=False).to(device)
        return self.model(**inputs).logits[:, 0].float().tolist()


def load_reward_model(path_or_model: Any, tokenizer=None, chat_template_kwargs: dict | None = None,
                      model_init_kwargs: dict | None = None, trust_remote_code: bool = False) -> RewardModel:
    """A reward model from anything ``from_pretrained`` accepts (a folder, a Hub id, a Hub id in the local cache
    offline), loaded as TRL does: ``AutoModelForSequenceClassification`` with ``num_labels=1`` and the config's
    ``model_init_kwargs``; or a model instance. Its tokenizer: ``tokenizer``, else the model's own."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    if isinstance(path_or_model, str):
        kwargs = dict(model_init_kwargs or {})
        kwargs.setdefault("trust_remote_code", trust_remote_code)
        model = AutoModelForSequenceClassification.from_pretrained(path_or_model, num_labels=1, **kwargs)
        if tokenizer is None:
            try:
                tokenizer = AutoTokenizer.from_pretrained(path_or_model, revision=kwargs.get("revision"),
                                                          trust_remote_code=kwargs["trust_remote_code"])
            except (OSError, ValueError) as error:
                raise RewardFunctionError(f"reward model '{path_or_model}' loaded, but its tokenizer did not "
                                          f"({error}); pass it in reward_processing_classes.") from error
            # Without tokenizer files transformers builds an empty tokenizer (its special tokens only) from the
            # model's config, whose ids would all be unknown to the model: refused instead of scoring nonsense
            if len(tokenizer.get_vocab()) <= len(tokenizer.added_tokens_decoder):
                raise RewardFunctionError(f"reward model '{path_or_model}' loaded, but its tokenizer did not (no "
                                          f"tokenizer files there); pass it in reward_processing_classes.")
        name = os.path.basename(path_or_model.rstrip("/"))  # "org/name" -> "name", as TRL names it
    else:
        model = path_or_model
        source = getattr(model.config, "_name_or_path", "")
        if tokenizer is None:
            if not source:
                raise RewardFunctionError("A reward model instance needs a tokenizer: pass reward_processing_classes.")
            tokenizer = AutoTokenizer.from_pretrained(source)
        name = os.path.basename(source.rstrip("/")) or type(model).__name__
    model.eval().requires_grad_(False)
    return RewardModel(model, tokenizer, name, chat_template_kwargs)


# ----------------------------------------------------------------------------------------------------------------
# Resolving and calling reward functions
# ----------------------------------------------------------------------------------------------------------------


def _named_reward_model(spec: str, processing_class, chat_template_kwargs: dict | None,
                        model_init_kwargs: dict | None, trust_remote_code: bool) -> RewardModel:
    """Any other string is a reward model, as in TRL: a local folder, or a Hub id (from the local Hugging Face
    cache, or downloaded). One that is none of these gets an error naming everything a string may be."""
    from huggingface_hub import constants

    try:
        check_model_path(spec)  # a local-looking path that is missing, or a folder without config.json
        return load_reward_model(spec, processing_class, chat_template_kwargs, model_init_kwargs, trust_remote_code)
    except RewardFunctionError:  # the model loaded; its message says what else failed
        raise
    except (ModelLoadError, OSError, ValueError) as error:  # ValueError: a config no sequence classifier takes
        hub = ("a Hub id in the local Hugging Face cache (HF_HUB_OFFLINE=1: the Hub was not asked)"
               if constants.HF_HUB_OFFLINE else "a Hub id (the local Hugging Face cache, then the Hub)")
        raise RewardFunctionError(
            f"reward function '{spec}' is neither a built-in ({sorted(BUILTIN_REWARDS)}), a 'module:function', "
            f"nor a reward model that AutoModelForSequenceClassification.from_pretrained(num_labels=1) loads, as a "
            f"local folder or {hub}: {error}") from error


@dataclass
class Reward:
    """A resolved reward function and the name its metrics are logged under (``rewards/<name>/mean``)."""

    name: str
    func: Callable


def resolve_reward(spec: Any, max_completion_length: int, processing_class=None,
                   chat_template_kwargs: dict | None = None, model_init_kwargs: dict | None = None,
                   trust_remote_code: bool = False) -> Reward:
    """A callable, a built-in name, ``module:function``, a reward server's URL (``trainers reward-serve``), a reward
    model (a folder or Hub id, as TRL loads any other string), or a model instance -> Reward."""
    from transformers import PreTrainedModel

    if isinstance(spec, PreTrainedModel):
        model = load_reward_model(spec, processing_class, chat_template_kwargs)
        return Reward(model.__name__, model)
    if isinstance(spec, str):
        if spec == "accuracy":
            return Reward("accuracy", accuracy_reward)
        if spec == "format":
            return Reward("format", format_reward)
        if spec == "overlong":
            return Reward("overlong", soft_overlong_penalty(max_completion_length))
        if spec == "code_execution":
            return Reward("code_execution", code_execution_reward())
        if spec.startswith(("http://", "https://")):  # trainers reward-serve
            from trainers.sampling.remote_reward import RemoteRewardModel
            remote = RemoteRewardModel(spec, chat_template_kwargs=chat_template_kwargs)
            return Reward(remote.__name__, remote)
        if ":" in spec and not os.path.isdir(spec):  # a Hub id has no ':'; a folder may
            module_name, _, attr = spec.partition(":")
            try:
                func = getattr(importlib.import_module(module_name), attr)
            except (ImportError, AttributeError) as error:
                raise RewardFunctionError(f"reward function '{spec}' could not be imported: {error}") from error
            return Reward(attr, func)
        model = _named_reward_model(spec, processing_class, chat_template_kwargs, model_init_kwargs,
                                    trust_remote_code)
        return Reward(model.__name__, model)
    if callable(spec):
        inner = spec
        while isinstance(inner, functools.partial):  # named after the wrapped function, as in TRL
            inner = inner.func
        return Reward(getattr(inner, "__name__", type(inner).__name__), spec)
    raise RewardFunctionError(f"reward_funcs entries must be callables, names or models; got {type(spec).__name__}.")


@dataclass
class RewardLogs:
    """What reward functions logged through TRL's ``log_metric`` and ``log_extra`` hooks during one scoring call."""

    metrics: dict = field(default_factory=lambda: defaultdict(list))  # name -> [float], one per log_metric call
    extra: dict = field(default_factory=lambda: defaultdict(list))  # column -> one value per completion

    def log_metric(self, name: str, value: float) -> None:
        """Log a scalar (averaged over every call in a logging step, on every process), as in TRL."""
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if not isinstance(name, str) or isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise RewardFunctionError(f"log_metric({name!r}, {value!r}): give a metric name (str) and a number.")
        self.metrics[name].append(float(value))

    def log_extra(self, column: str, values: list) -> None:
        """Add a column to the logged completions (``log_completions``): one value per completion."""
        if not isinstance(column, str) or not hasattr(values, "__len__"):
            raise RewardFunctionError(f"log_extra({column!r}, ...): give a column name (str) and a list of values.")
        self.extra[column].extend(values)

    def check(self, n: int) -> None:
        for column, values in self.extra.items():
            if len(values) != n:
                raise RewardFunctionError(f"log_extra column {column!r} got {len(values)} values for {n} "
                                          f"completions; log one value per completion.")


# async reward functions run here, as TRL runs them: on a loop of their own that outlives each call
_event_loop = EventLoopThread("reward-functions")


def _finish(value: Any) -> Any:
    """A function's output, awaited if it is async."""
    if inspect.isawaitable(value):
        (value,) = _event_loop.run([value])
        if isinstance(value, BaseException):
            raise value
    return value


def _first_failing_sample(call, n: int) -> int | None:
    """Index of the first sample on which ``call`` raises when called one sample at a time (None if none does)."""
    for index in range(n):
        try:
            _finish(call(slice(index, index + 1)))
        except Exception:
            return index
    return None


def _check_values(reward: Reward, values: Any, n: int) -> torch.Tensor:
    """One function's output as [n] float32, NaN for None; anything but numbers and None is an error."""
    if values is None or not hasattr(values, "__len__"):
        raise RewardFunctionError(f"reward function '{reward.name}' returned {type(values).__name__}, "
                                  f"expected a list of {n} floats (or None).")
    values = list(values)
    if len(values) != n:
        raise RewardFunctionError(f"reward function '{reward.name}' returned {len(values)} rewards for "
                                  f"{n} completions; it must return one per completion.")
    out = []
    for index, value in enumerate(values):
        if value is None:
            out.append(float("nan"))
            continue
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        # numbers.Real takes numpy scalars and bools (True = 1.0, as in TRL). NaN is refused: it is what a reward
        # computation gone wrong looks like, and None already says "not applicable".
        if not isinstance(value, numbers.Real) or math.isnan(float(value)):
            raise RewardFunctionError(f"reward function '{reward.name}' returned {value!r} for sample {index}; "
                                      f"rewards must be numbers, or None where a sample is not applicable.")
        out.append(float(value))
    return torch.tensor(out, dtype=torch.float32)


def call_rewards(rewards: list[Reward], prompts: list, completions: list, completion_ids: list, columns: dict,
                 extra: dict | None = None, logs: RewardLogs | None = None) -> torch.Tensor:
    """Call every reward function on N completions and check their answers; returns [N, F] float32, NaN for
    None. The async functions run concurrently once the others are done; what any of them logs goes to ``logs``."""
    logs = logs if logs is not None else RewardLogs()
    hooks = {"log_metric": logs.log_metric, "log_extra": logs.log_extra, **(extra or {})}
    n = len(completions)
    if not rewards:  # a trainer without rewards (distillation)
        return torch.zeros(n, 0)

    def caller(reward: Reward):
        def call(rows: slice):
            return reward.func(prompts=prompts[rows], completions=completions[rows],
                               completion_ids=completion_ids[rows], **{k: v[rows] for k, v in columns.items()},
                               **hooks)
        return call

    def failure(reward: Reward, error: BaseException) -> RewardFunctionError:
        if isinstance(error, RewardFunctionError):  # a misused log hook: its message already says what is wrong
            return error
        index = _first_failing_sample(caller(reward), n)
        where = f"on sample {index} (prompt {str(prompts[index])[:80]!r})" if index is not None else \
            f"on a batch of {n} completions"
        return RewardFunctionError(f"reward function '{reward.name}' raised {type(error).__name__}: {error} {where}")

    outputs: list = []
    for reward in rewards:
        try:
            outputs.append(caller(reward)(slice(None)))  # an async function returns its coroutine here
        except Exception as error:
            raise failure(reward, error) from error
    pending = [i for i, out in enumerate(outputs) if inspect.isawaitable(out)]
    results = _event_loop.run([outputs[i] for i in pending]) if pending else []
    for i, result in zip(pending, results):
        if isinstance(result, BaseException):
            raise failure(rewards[i], result) from result
        outputs[i] = result
    logs.check(n)
    scores = torch.stack([_check_values(r, out, n) for r, out in zip(rewards, outputs)], dim=1)  # [N, F]
    unscorable = torch.isnan(scores).all(dim=1)  # [N]
    if unscorable.any():
        # TRL's warning, worded as TRL's, naming the first such sample. Its reward stays NaN: left out of its
        # group's mean and std, advantage 0 (trainers/sampling/advantages.py), as in TRL.
        index = int(unscorable.nonzero()[0])
        sample = {key: values[index] for key, values in columns.items()}
        sample["prompt"], sample["completion"] = prompts[index], completions[index]
        logger.warning(f"All reward functions returned None for the following kwargs:\n{sample}\n"
                       "Please ensure that at least one reward function returns a valid reward.")
    return scores


def reward_sources(reward_funcs, reward_processing_classes, may_be_empty: bool) -> tuple[list, list]:
    """GRPOTrainer's reward arguments, checked: (one spec per reward function, one tokenizer or None each). As in
    TRL, one tokenizer given alone is a list of one, for a single reward function. ``may_be_empty``: an
    environment_factory may own the reward (its get_reward), and distillation needs none."""
    specs = (list(reward_funcs) if isinstance(reward_funcs, (list, tuple))
             else [] if reward_funcs is None else [reward_funcs])
    if not specs and not may_be_empty:
        raise ConfigError("No reward source provided: reward_funcs is empty; give at least one reward function.")
    if reward_processing_classes is None:
        tokenizers = [None] * len(specs)
    elif isinstance(reward_processing_classes, (list, tuple)):
        tokenizers = list(reward_processing_classes)
    else:
        tokenizers = [reward_processing_classes]
    if len(tokenizers) != len(specs):
        raise ConfigError(f"The number of reward processing classes ({len(tokenizers)}) must match the number of "
                          f"reward functions ({len(specs)}): give one per reward function, None for a function.")
    return specs, tokenizers

