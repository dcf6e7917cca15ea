"""The built-in reward functions: what the names 'accuracy', 'format', 'overlong' and 'code_execution' resolve to,
and TRL's own built-ins by TRL's names (``think_format_reward``, ``get_soft_overlong_punishment``; trainers/rewards.py
re-exports them at TRL's ``trl.rewards`` path).

Each follows the reward-function contract (trainers/sampling/rewards.py, which resolves names to these and calls
them): ``f(prompts, completions, completion_ids, **columns) -> list[float | None]``. Kept apart from that
machinery because they are ordinary reward functions, written as a user's would be; ``accuracy_reward`` brings
its answer extraction and the LaTeX comparison (math_verify, imported on first use).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import re
import threading
from typing import Any, Callable

from trainers.errors import ConfigError, RewardFunctionError
from trainers.execution import ExecutionLimits, LocalExecutor, Program, RemoteExecutor
from trainers.execution.programs import OUTCOMES, extract_code, parse_tests


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


@functools.cache
def latex_checker() -> _LatexChecker:
    """The one LaTeX checker (math_verify is imported on first use)."""
    return _LatexChecker()


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
            rewards.append(latex_checker()(text, reference))
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


BUILTIN_REWARDS = {"accuracy", "format", "overlong", "code_execution"}


# ----------------------------------------------------------------------------------------------------------------
# Code run against tests
# ----------------------------------------------------------------------------------------------------------------

CODE_EXECUTION_SCORES = ("fraction", "all_or_nothing")


def code_execution_reward(tests_column: str = "tests", *, score: str = "fraction", function: str | None = None,
                          executor=None, limits: ExecutionLimits | None = None, max_workers: int | None = None,
                          isolation: str = "auto", api_key: str | None = None, template: str | None = None):
    """The ``code_execution`` reward: a reward function that runs each completion's program against the tests in
    ``tests_column``, in a sandbox (trainers/execution/, docs/rewards.md). Each completion gets one outcome
    (``passed``, ``failed``, ``timeout``, ``memory``, ``crashed``, ``no code``): the column ``code_execution`` of the
    logged completions (``log_extra``) and the share of each per round (``log_metric("code_execution/<outcome>")``),
    so a run shows what its policy's programs do, not just a mean. The name ``"code_execution"`` is this with the
    defaults.

    Args:
        tests_column: the dataset column holding each row's tests (trainers/execution/programs.py, ``parse_tests``:
            assert code, a list of asserts, input/output cases, or APPS-style ``{"inputs", "outputs"}``).
        score: "fraction" (tests passed / tests) or "all_or_nothing" (1.0 only when every test passes).
        function: a function the code must define (its absence is "no code"); a completion without a fenced block
            is then taken whole when it defines it.
        template: the program is this with ``{completion}`` replaced by the whole completion, stripped (no code
            block is looked for): ``"print({completion})"`` when completions are Python expressions.
        executor: None (a ``LocalExecutor`` with ``limits``, an ``ExecutionLimits``, ``max_workers`` and
            ``isolation``), a URL of a sandbox server (``trainers sandbox-serve``; ``api_key`` or
            TRAINERS_SANDBOX_API_KEY), or any object with ``run(list[Program]) -> list[Outcome]``.
    """
    if score not in CODE_EXECUTION_SCORES:
        raise ConfigError(f"code_execution_reward: score must be one of {CODE_EXECUTION_SCORES}, got {score!r}.")
    if executor is None:
        executor = LocalExecutor(limits, max_workers, isolation)
    elif isinstance(executor, str):
        executor = RemoteExecutor(executor, api_key)
    elif not callable(getattr(executor, "run", None)):
        raise ConfigError(f"code_execution_reward: executor must be None, a URL or an object with run(programs); "
                          f"got {type(executor).__name__}.")
    if template is not None and "{completion}" not in template:
        raise ConfigError(f"code_execution_reward: template must contain {{completion}}, got {template!r}.")
    all_or_nothing = score == "all_or_nothing"

    def program_of(completion) -> str | None:
        text = completion_text(completion)
        if template is None:
            return extract_code(text, function)
        return template.replace("{completion}", text.strip()) if text.strip() else None

    def code_execution(completions: list, log_extra=None, log_metric=None, **columns) -> list[float]:
        if tests_column not in columns:
            raise RewardFunctionError(
                f"code_execution needs the tests of each row in the dataset column {tests_column!r}, which this "
                f"dataset lacks (columns: {sorted(k for k in columns if k != 'trainer_state')}); name another with "
                f"code_execution_reward(tests_column=...).")
        programs = []
        for row, (completion, tests) in enumerate(zip(completions, columns[tests_column])):
            try:
                parsed = parse_tests(tests, tests_column, row)
            except ValueError as error:
                raise RewardFunctionError(f"code_execution: {error}") from error
            programs.append(Program(program_of(completion), parsed, function))
        # the same program against the same tests (frequent within a group) runs once and shares its outcome
        keys = [json.dumps([p.code, p.tests.to_json(), p.function]) for p in programs]
        unique = {}
        for key, program in zip(keys, programs):
            unique.setdefault(key, program)
        ran = dict(zip(unique, executor.run(list(unique.values()))))
        outcomes = [ran[key] for key in keys]
        if log_extra is not None:
            log_extra("code_execution", [o.status for o in outcomes])
        if log_metric is not None and outcomes:
            for status in OUTCOMES:
                log_metric(f"code_execution/{status.replace(' ', '_')}",
                           sum(o.status == status for o in outcomes) / len(outcomes))
        return [o.score(all_or_nothing) for o in outcomes]

    code_execution.executor = executor  # for a caller that wants to close it or read its isolation
    return code_execution


# TRL's names (``from trl.rewards import ...``), so a TRL script ports by changing its import.
THINK_PATTERN = re.compile(r"^<think>(?!.*<think>)(.*?)</think>.*$", re.DOTALL | re.MULTILINE)


def think_format_reward(completions: list, **kwargs) -> list[float]:
    """TRL's ``think_format_reward``: 1.0 when the completion opens with one ``<think>...</think>`` block
    (whatever follows), else 0.0. Looser than :func:`format_reward`, which also wants ``<answer>...</answer>``."""
    return [1.0 if THINK_PATTERN.match(completion_text(c)) else 0.0 for c in completions]


def get_soft_overlong_punishment(max_completion_len: int, soft_punish_cache: int) -> Callable:
    """TRL's name for :func:`soft_overlong_penalty`."""
    return soft_overlong_penalty(max_completion_len, soft_punish_cache)
