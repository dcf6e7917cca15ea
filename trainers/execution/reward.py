"""The ``code_execution`` reward: each completion's program run against its row's tests, in a sandbox.

TRL's reward-function contract (trainers/sampling/rewards.py): ``code_execution_reward(...)`` returns a function
``f(completions, **columns) -> list[float]``; the built-in name ``"code_execution"`` is this with the defaults.
Each completion gets one outcome (``passed``, ``failed``, ``timeout``, ``memory``, ``crashed``, ``no code``): the
column ``code_execution`` of the logged completions (``log_extra``) and the share of each per round
(``log_metric("code_execution/<outcome>")``), so a run shows what its policy's programs do, not just a mean.
"""

from __future__ import annotations

import json

from trainers.errors import ConfigError, RewardFunctionError
from trainers.execution.executors import LocalExecutor, Program, RemoteExecutor
from trainers.execution.programs import OUTCOMES, extract_code, parse_tests
from trainers.execution.sandbox import ExecutionLimits

SCORES = ("fraction", "all_or_nothing")


def _text(completion) -> str:
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    return str(completion)


def code_execution_reward(tests_column: str = "tests", *, score: str = "fraction", function: str | None = None,
                          executor=None, limits: ExecutionLimits | None = None, max_workers: int | None = None,
                          isolation: str = "auto", api_key: str | None = None, template: str | None = None):
    """A reward function that runs each completion's code against the tests in ``tests_column``.

    Args:
        tests_column: the dataset column holding each row's tests (trainers/execution/programs.py, ``parse_tests``:
            assert code, a list of asserts, input/output cases, or APPS-style ``{"inputs", "outputs"}``).
        score: "fraction" (tests passed / tests) or "all_or_nothing" (1.0 only when every test passes).
        function: a function the code must define (its absence is "no code"); a completion without a fenced block
            is then taken whole when it defines it.
        template: the program is this with ``{completion}`` replaced by the whole completion, stripped (no code
            block is looked for): ``"print({completion})"`` when completions are Python expressions.
        executor: None (a ``LocalExecutor`` with ``limits``, ``max_workers``, ``isolation``), a URL of a sandbox
            server (``trainers sandbox-serve``; ``api_key`` or TRAINERS_SANDBOX_API_KEY), or any object with
            ``run(list[Program]) -> list[Outcome]``.
    """
    if score not in SCORES:
        raise ConfigError(f"code_execution_reward: score must be one of {SCORES}, got {score!r}.")
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
        text = _text(completion)
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
