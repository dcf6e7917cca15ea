"""Where programs run: ``LocalExecutor`` (sandboxes on this machine, a bounded pool) and ``RemoteExecutor`` (an HTTP
endpoint, ``trainers sandbox-serve``, which runs them with a LocalExecutor of its own). Both take a list of
``Program`` and return one ``Outcome`` each, in order.

The remote protocol (docs/rewards.md): ``POST /run`` with ``{"programs": [{"code": str | null, "tests": {"mode":
"assert" | "stdio", "asserts": [...], "inputs": [...], "outputs": [...]}, "function": str | null}, ...]}`` and
``Authorization: Bearer KEY``; the answer ``{"outcomes": [{"status", "passed", "total", "detail"}, ...]}``.
"""

from __future__ import annotations

import os
import secrets
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from trainers.errors import ConfigError, RemoteServiceError
from trainers.execution.programs import OUTCOMES, Outcome, Tests, judge
from trainers.execution.sandbox import SLOT_USERS, ExecutionLimits, Sandbox, Slots, probe_isolation
from trainers.services.http import post_json

SANDBOX_KEY_VARIABLE = "TRAINERS_SANDBOX_API_KEY"  # the sandbox server's key, for the server and the trainer


@dataclass(frozen=True)
class Program:
    """One completion's program (None: none was found) and its row's tests."""

    code: str | None
    tests: Tests
    function: str | None = None

    def to_json(self) -> dict:
        return {"code": self.code, "tests": self.tests.to_json(), "function": self.function}

    @classmethod
    def from_json(cls, value: dict) -> "Program":
        tests = value["tests"]
        if tests.get("mode") not in ("assert", "stdio"):
            raise ValueError(f"tests.mode must be 'assert' or 'stdio', got {tests.get('mode')!r}")
        return cls(value.get("code"), Tests(tests["mode"], tuple(tests.get("asserts", ())),
                                            tuple(tests.get("inputs", ())), tuple(tests.get("outputs", ()))),
                   value.get("function"))


def default_workers() -> int:
    """Programs run at once: this process's cores, at most 8 (they run at nice 10, so the trainer keeps its CPU)."""
    return max(1, min(8, len(os.sched_getaffinity(0))))


class LocalExecutor:
    """Runs programs in sandboxes here, ``max_workers`` at once. ``isolation``: "auto" (namespaces where the
    kernel gives them, else processes with a warning), "namespaces" (an error where they cannot be had) or
    "processes" (trainers/execution/sandbox.py)."""

    def __init__(self, limits: ExecutionLimits | None = None, max_workers: int | None = None,
                 isolation: str = "auto"):
        self.limits = limits or ExecutionLimits()
        self.max_workers = default_workers() if max_workers is None else max_workers
        if not 1 <= self.max_workers <= SLOT_USERS:
            raise ConfigError(f"max_workers must be between 1 and {SLOT_USERS}, got {max_workers}.")
        self.requested_isolation = isolation
        self._sandbox: Sandbox | None = None
        self._slots = Slots(self.max_workers)
        self._pool = ThreadPoolExecutor(self.max_workers, thread_name_prefix="code-execution")

    @property
    def isolation(self) -> str:
        """The isolation in use, probed on first use (a run of an empty program, ~0.1 s)."""
        return self.sandbox.isolation

    @property
    def sandbox(self) -> Sandbox:
        if self._sandbox is None:
            self._sandbox = Sandbox(self.limits, probe_isolation(self.requested_isolation))
        return self._sandbox

    def run(self, programs: list[Program]) -> list[Outcome]:
        sandbox = self.sandbox
        return list(self._pool.map(lambda program: self._run_one(sandbox, program), programs))

    def _run_one(self, sandbox: Sandbox, program: Program) -> Outcome:
        tests = program.tests
        if program.code is None:
            return Outcome("no code", 0, tests.total, "no fenced code block" if program.function is None else
                           f"no fenced code block and no function named {program.function}")
        nonce = secrets.token_hex(16)
        job = {"code": program.code, "tests": list(tests.asserts), "function": program.function, "nonce": nonce}
        cases = list(tests.inputs) if tests.mode == "stdio" else [""]
        slot = self._slots.take()
        try:
            results = sandbox.run(job, tests.mode, cases, slot)
        finally:
            self._slots.give(slot)
        return judge(tests, results, nonce)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class RemoteExecutor:
    """Runs programs on a sandbox server (``trainers sandbox-serve``) at ``url``; ``api_key``: its key (None: the
    environment's TRAINERS_SANDBOX_API_KEY). ``timeout``: seconds one request (a batch of programs) may take."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 300.0):
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"executor URL must start with http:// or https://, got {url!r}.")
        self.url, self.timeout = url.rstrip("/"), timeout
        self.api_key = api_key if api_key is not None else os.environ.get(SANDBOX_KEY_VARIABLE) or None

    def run(self, programs: list[Program]) -> list[Outcome]:
        answer = post_json(self.url, "/run", {"programs": [p.to_json() for p in programs]}, self.api_key,
                           self.timeout, "sandbox server")
        outcomes = answer.get("outcomes")
        if not isinstance(outcomes, list) or len(outcomes) != len(programs):
            raise RemoteServiceError(f"The sandbox server at {self.url} answered /run without one outcome per "
                                     f"program ({len(programs)}): {str(answer)[:300]}")
        return [Outcome(o["status"] if o.get("status") in OUTCOMES else "crashed", int(o.get("passed", 0)),
                        int(o.get("total", 0)), str(o.get("detail", ""))) for o in outcomes]

    def close(self) -> None:
        pass
