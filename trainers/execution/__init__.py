"""Running completions' code safely: the sandbox (sandbox.py, with jail.py and harness.py), what a program and its
tests are (programs.py), where programs run (executors.py: here, or on a sandbox server) and the ``code_execution``
reward built on them (reward.py). docs/rewards.md says what is contained and how."""

from trainers.execution.executors import LocalExecutor, Program, RemoteExecutor
from trainers.execution.programs import OUTCOMES, Outcome, Tests, extract_code, parse_tests
from trainers.execution.reward import code_execution_reward
from trainers.execution.sandbox import ExecutionLimits

__all__ = ["ExecutionLimits", "LocalExecutor", "OUTCOMES", "Outcome", "Program", "RemoteExecutor", "Tests",
           "code_execution_reward", "extract_code", "parse_tests"]
