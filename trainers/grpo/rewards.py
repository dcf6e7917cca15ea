"""Reward functions: the contract, built-in rewards by name, and reward models used as reward functions.

The contract (TRL's): ``f(prompts, completions, completion_ids, **columns) -> list[float | None]``, one value
per completion. ``prompts``/``completions`` are strings, or lists of messages for conversational data; every
other dataset column arrives as a keyword argument (one value per completion), plus ``trainer_state`` and
TRL's two logging hooks, ``log_metric(name, value)`` and ``log_extra(column, values)``. ``None`` means "not
applicable to this sample": it is left out of the weighted sum. A function may be ``async``: the async ones
of a call run concurrently.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import importlib.util
import inspect
import math
import numbers
import os
import re
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from trainers.errors import ModelLoadError, RewardFunctionError
from trainers.logs import logger
from trainers.modeling import check_model_path


def completion_text(completion: Any) -> str:
    """The text of a completion: the string itself, or the content of its (last) assistant message."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    return str(completion)


# ----------------------------------------------------------------------------------------------------------------
# Built-in rewards
# ----------------------------------------------------------------------------------------------------------------

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def _as_number(text: str) -> float | None:
    try:
        return float(text.replace(",", "").strip())
    except ValueError:
        return None


def is_latex(reference: Any) -> bool:
    """A reference written in LaTeX (it has a command such as ``\\frac``): compared with math_verify."""
    return isinstance(reference, str) and "\\" in reference


def _last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` in ``text`` (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for index in range(begin, len(text)):
        if text[index] == "{":
            depth += 1
        elif text[index] == "}":
            if depth == 0:
                return text[begin:index]
            depth -= 1
    return None


def _answer_spans(text: str) -> list[str]:
    """Where a completion may state its answer: the whole text, the last ``\\boxed{}``, each ``<answer>`` block."""
    spans = [text, *_ANSWER_TAG.findall(text)]
    boxed = _last_boxed(text)
    if boxed is not None:
        spans.append(boxed)
    return [span.strip() for span in spans]


_MATH_VERIFY_MISSING = "math_verify, which is not installed: pip install math-verify (or 'trainers[math]')."


def math_verify_missing() -> bool:
    return importlib.util.find_spec("math_verify") is None


class _LatexChecker:
    """TRL's math_verify comparison (boxed answer first, no anchorless extraction), imported on first use.

    A reference without ``$`` or ``\\boxed`` is parsed as if it were boxed: parsed bare, as TRL does,
    ``2\\sqrt{3}`` reads as 2."""

    def __init__(self):
        if math_verify_missing():
            raise RewardFunctionError(f"The 'accuracy' reward compares LaTeX answers with {_MATH_VERIFY_MISSING}")
        from latex2sympy2_extended import NormalizationConfig
        from math_verify import LatexExtractionConfig, parse, verify

        self.parse, self.verify = parse, verify
        self.config = [LatexExtractionConfig(normalization_config=NormalizationConfig(units=True),
                                             boxed_match_priority=0, try_extract_without_anchor=False)]

    def __call__(self, completion: str, reference: str) -> float | None:
        # math_verify times out with signal.alarm, which only works in the main thread
        main = threading.current_thread() is threading.main_thread()
        anchored = "$" in reference or "\\boxed" in reference  # the reference marks its own answer
        timeout = 10 if main else None
        gold = (self.parse(reference, parsing_timeout=timeout) if anchored  # math_verify's defaults, as in TRL
                else self.parse(f"\\boxed{{{reference}}}", extraction_config=self.config, parsing_timeout=timeout))
        if not gold:
            return None  # an unparseable reference skips the sample, as in TRL
        answer = self.parse(completion, extraction_config=self.config, extraction_mode="first_match",
                            parsing_timeout=timeout)
        return float(self.verify(gold, answer, timeout_seconds=5 if main else None))


_latex_checker: _LatexChecker | None = None


def accuracy_reward(completions: list, answer: list | None = None, solution: list | None = None,
                    **kwargs) -> list[float | None]:
    """1.0 when the completion's answer equals the reference, else 0.0.

    The reference comes from the ``answer`` (or ``solution``) column, by kind:

    - a number: compared as a number with the last number in the completion ("The sum is 46." matches 46);
    - LaTeX (it has a backslash command, e.g. ``\\frac{1}{3}``): compared symbolically with math_verify, as
      TRL's ``accuracy_reward`` does (``\\boxed{\\frac{2}{6}}`` matches); needs the ``math-verify`` package,
      and a reference math_verify cannot parse gives None;
    - any other text: must equal the stripped completion, the content of its last ``\\boxed{}``, or of an
      ``<answer>...</answer>`` block.

    Rows without a reference get None.
    """
    global _latex_checker
    references = answer if answer is not None else solution
    if references is None:
        raise RewardFunctionError("The built-in 'accuracy' reward needs an 'answer' (or 'solution') column.")
    rewards: list[float | None] = []
    for completion, reference in zip(completions, references):
        if reference is None:
            rewards.append(None)
            continue
        text = completion_text(completion).strip()
        target = _as_number(str(reference))
        if target is not None:
            numbers = _NUMBER.findall(text)
            rewards.append(1.0 if numbers and math.isclose(float(numbers[-1]), target) else 0.0)
        elif is_latex(reference):
            _latex_checker = _latex_checker or _LatexChecker()
            rewards.append(_latex_checker(text, reference))
        else:
            rewards.append(1.0 if str(reference).strip() in _answer_spans(text) else 0.0)
    return rewards


def check_accuracy_references(rows: list[dict], dataset: str) -> None:
    """Before training: the 'accuracy' reward has a reference column, and math_verify if a reference is LaTeX."""
    column = "answer" if "answer" in rows[0] else "solution" if "solution" in rows[0] else None
    if column is None:
        raise RewardFunctionError(f"The built-in 'accuracy' reward compares completions with an 'answer' (or "
                                  f"'solution') column; {dataset} has {sorted(rows[0])}.")
    latex = next((i for i, row in enumerate(rows) if is_latex(row.get(column))), None)
    if latex is not None and math_verify_missing():
        raise RewardFunctionError(
            f"{dataset} column '{column}' holds LaTeX answers (row {latex}: {rows[latex][column]!r}); the 'accuracy' "
            f"reward compares them with {_MATH_VERIFY_MISSING}")


FORMAT_PATTERN = re.compile(r"^<think>.*?</think>\s*<answer>.*?</answer>\s*$", re.DOTALL)


def format_reward(completions: list, **kwargs) -> list[float]:
    """1.0 when the completion is ``<think>...</think><answer>...</answer>`` (reasoning-model format), else 0.0."""
    return [1.0 if FORMAT_PATTERN.match(completion_text(c).strip()) else 0.0 for c in completions]


def soft_overlong_penalty(max_completion_length: int, soft_cache_length: int | None = None) -> Callable:
    """DAPO's soft over-length punishment (arXiv:2503.14476 eq. 13), as a reward function.

    With L = completion length, L_max = max_completion_length and L_cache the soft window (default L_max/4):
    0 if L <= L_max - L_cache; (L_max - L_cache - L) / L_cache inside the window; -1 beyond L_max.
    """
    cache = soft_cache_length if soft_cache_length is not None else max(1, max_completion_length // 4)
    if not 0 < cache <= max_completion_length:
        raise RewardFunctionError(f"soft_cache_length={cache} must be in (0, max_completion_length].")

    def overlong(completion_ids: list, **kwargs) -> list[float]:
        free = max_completion_length - cache
        out = []
        for ids in completion_ids:
            length = len(ids)
            if length <= free:
                out.append(0.0)
            elif length <= max_completion_length:
                out.append((free - length) / cache)
            else:
                out.append(-1.0)
        return out

    overlong.__name__ = "overlong"
    return overlong


BUILTIN_REWARDS = {"accuracy", "format", "overlong"}


# ----------------------------------------------------------------------------------------------------------------
# Reward models
# ----------------------------------------------------------------------------------------------------------------


class RewardModel:
    """A sequence-classification model used as a reward function: the score is logit 0 of prompt+completion.

    Conversational samples are rendered with the reward tokenizer's chat template (and the trainer's
    ``chat_template_kwargs``, as in TRL).
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
        texts = []
        for prompt, completion in zip(prompts, completions):
            if isinstance(prompt, list):
                texts.append(self.tokenizer.apply_chat_template(prompt + completion, tokenize=False,
                                                                **self.chat_template_kwargs))
            else:
                texts.append(prompt + completion)
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
    """A callable, a built-in name, ``module:function``, a reward model (a folder or Hub id, as TRL loads any other
    string), or a model instance -> Reward."""
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


class _EventLoop:
    """A private event loop on a daemon thread that runs async reward functions, as TRL does. It outlives each
    call (so clients an async function keeps open stay usable) and works when the calling thread already runs a
    loop (Jupyter), where ``asyncio.run`` refuses."""

    def __init__(self):
        self.loop = None
        self.lock = threading.Lock()

    def run(self, awaitables: list) -> list:
        """Await all concurrently; returns their results or the exceptions they raised, in order."""
        with self.lock:
            if self.loop is None:
                self.loop = asyncio.new_event_loop()
                threading.Thread(target=self.loop.run_forever, name="reward-functions", daemon=True).start()

        async def together():
            return await asyncio.gather(*awaitables, return_exceptions=True)

        return asyncio.run_coroutine_threadsafe(together(), self.loop).result()


_event_loop = _EventLoop()


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
        # group's mean and std, advantage 0 (trainers/grpo/advantages.py), as in TRL.
        index = int(unscorable.nonzero()[0])
        sample = {key: values[index] for key, values in columns.items()}
        sample["prompt"], sample["completion"] = prompts[index], completions[index]
        logger.warning(f"All reward functions returned None for the following kwargs:\n{sample}\n"
                       "Please ensure that at least one reward function returns a valid reward.")
    return scores


# TRL's names (``from trl.rewards import ...``), so a TRL script ports by changing its import.
THINK_PATTERN = re.compile(r"^<think>(?!.*<think>)(.*?)</think>.*$", re.DOTALL | re.MULTILINE)


def think_format_reward(completions: list, **kwargs) -> list[float]:
    """TRL's ``think_format_reward``: 1.0 when the completion opens with one ``<think>...</think>`` block
    (whatever follows), else 0.0. Looser than :func:`format_reward`, which also wants ``<answer>...</answer>``."""
    return [1.0 if THINK_PATTERN.match(completion_text(c)) else 0.0 for c in completions]


def get_soft_overlong_punishment(max_completion_len: int, soft_punish_cache: int) -> Callable:
    """TRL's name for :func:`soft_overlong_penalty`."""
    return soft_overlong_penalty(max_completion_len, soft_punish_cache)
