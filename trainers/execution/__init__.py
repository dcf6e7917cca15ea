"""Running completions' code safely: the sandbox (sandbox.py, with jail.py and harness.py), what a program and its
tests are (programs.py) and where programs run (executors.py: here, or on a sandbox server); the ``code_execution`` reward
built on them is with the other built-in rewards (trainers/sampling/reward_functions.py). docs/rewards.md says what
is contained and how."""

from trainers.execution.executors import LocalExecutor, Program, RemoteExecutor
from trainers.execution.programs import OUTCOMES, Outcome, Tests, extract_code, parse_tests
from trainers.execution.sandbox import ExecutionLimits

__all__ = ["ExecutionLimits", "LocalExecutor", "OUTCOMES", "Outcome", "Program", "RemoteExecutor", "Tests",
           "extract_code", "parse_tests"]
