"""What a completion's program is, what its tests are, and what its run comes to.

- ``extract_code``: the last fenced code block of a completion (```python, ```py or a bare fence), or, with a
  function name, a completion that is the function itself.
- ``parse_tests``: a dataset row's tests -> ``Tests``. Assert tests: a string of Python (each top-level statement
  one test; statements that are not asserts set up the ones after them) or a list of strings (one test each).
  Input/output tests: a list of ``{"input": ..., "output": ...}`` (also ``stdin``/``stdout``), or
  ``{"inputs": [...], "outputs": [...]}`` (the APPS/TACO layout); either may come as a JSON string.
- ``judge``: the sandbox's per-case results -> ``Outcome`` (status, tests passed, why). Input/output tests are
  compared here, outside the sandbox (lines with trailing spaces stripped, trailing blank lines ignored, exit 0
  needed); assert tests through the harness's verdict line, which must carry the run's nonce.
"""

from __future__ import annotations

import ast
import json
import re
import signal
from dataclasses import dataclass

from trainers.execution.harness import MEMORY_ERROR_EXIT

# Every completion gets exactly one of these; "rewards/code_execution/<status>" counts them
OUTCOMES = ("passed", "failed", "timeout", "memory", "crashed", "no code")

_FENCE = re.compile(r"```[ \t]*([\w+#.-]*)[^\n]*\n(.*?)```", re.DOTALL)
_PYTHON_TAGS = {"", "python", "py", "python3", "py3"}


@dataclass(frozen=True)
class Outcome:
    """One completion's run: ``status`` (one of OUTCOMES), how many of its tests passed, and why, in a line."""

    status: str
    passed: int
    total: int
    detail: str = ""

    def score(self, all_or_nothing: bool) -> float:
        if self.total == 0 or self.status != "passed" and all_or_nothing:
            return 0.0
        return float(self.passed == self.total) if all_or_nothing else self.passed / self.total

    def to_json(self) -> dict:
        return {"status": self.status, "passed": self.passed, "total": self.total, "detail": self.detail}


@dataclass(frozen=True)
class Tests:
    """A row's tests: ``mode`` "assert" (``asserts``: one source string each) or "stdio" (``inputs`` and the
    expected ``outputs``, one per case)."""

    mode: str
    asserts: tuple = ()
    inputs: tuple = ()
    outputs: tuple = ()

    @property
    def total(self) -> int:
        return len(self.asserts) if self.mode == "assert" else len(self.inputs)

    def to_json(self) -> dict:
        return {"mode": self.mode, "asserts": list(self.asserts), "inputs": list(self.inputs),
                "outputs": list(self.outputs)}


def extract_code(completion_text: str, function: str | None = None) -> str | None:
    """The program in a completion, or None (scored "no code")."""
    blocks = [code for tag, code in _FENCE.findall(completion_text) if tag.lower() in _PYTHON_TAGS]
    if blocks:
        return blocks[-1]
    if function is not None and re.search(rf"^\s*def\s+{re.escape(function)}\s*\(", completion_text, re.MULTILINE):
        return completion_text
    return None


def _split_statements(source: str) -> tuple:
    """A test string's top-level statements, each one test; those before an assert that are not asserts (imports,
    helpers) are joined to it. Parsed only (``ast.parse`` runs nothing); a string that does not parse is one test
    (it fails inside the sandbox, as the program's problem would)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return (source,)
    lines = source.splitlines(keepends=True)
    tests, pending = [], ""
    for node in tree.body:
        text = "".join(lines[node.lineno - 1:node.end_lineno])
        if isinstance(node, ast.Assert):
            tests.append(pending + text)
            pending = ""
        else:
            pending += text
    if pending:  # code after the last assert (``check(candidate)``, HumanEval's layout) is a test of its own
        tests.append(pending)
    return tuple(tests)


def parse_tests(value, column: str, row: int) -> Tests:
    """A row's ``column`` value -> Tests; anything else is an error naming the column, the row and the layouts."""
    if isinstance(value, str) and value.lstrip()[:1] in ("{", "["):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            pass  # Python after all (a list literal, say): taken as assert code
    if isinstance(value, str):
        tests = Tests("assert", asserts=_split_statements(value))
    elif isinstance(value, dict) and "inputs" in value and "outputs" in value:
        tests = Tests("stdio", inputs=tuple(map(_text, value["inputs"])), outputs=tuple(map(_text, value["outputs"])))
    elif isinstance(value, (list, tuple)) and value and all(isinstance(v, str) for v in value):
        tests = Tests("assert", asserts=tuple(value))
    elif isinstance(value, (list, tuple)) and value and all(isinstance(v, dict) for v in value):
        try:
            tests = Tests("stdio", inputs=tuple(_text(v.get("input", v.get("stdin"))) for v in value),
                          outputs=tuple(_text(v["output"] if "output" in v else v["stdout"]) for v in value))
        except KeyError:
            tests = None
    else:
        tests = None
    if tests is None or tests.total == 0 or len(tests.inputs) != len(tests.outputs):
        raise ValueError(
            f"column {column!r} of row {row}: tests must be assert code (a string, or a list of strings), a list of "
            f"{{'input': ..., 'output': ...}} cases, or {{'inputs': [...], 'outputs': [...]}} (or one of these as "
            f"JSON), with at least one test; got {str(value)[:200]!r}.")
    return tests


def _text(value) -> str:
    if value is None:
        return ""
    return value if isinstance(value, str) else "\n".join(map(str, value)) if isinstance(value, list) else str(value)


def _same_output(got: str, expected: str) -> bool:
    def lines(text: str) -> list[str]:
        return [line.rstrip() for line in text.strip("\n").splitlines()]
    return lines(got) == lines(expected)


def _crash(result: dict) -> Outcome | None:
    """The run's failure that is not a test failing: the time, the memory, the output or a signal."""
    if "exit" not in result:
        return Outcome("crashed", 0, 0, f"the sandbox failed: {str(result)[:300]}")
    if result["timeout"] or result["signal"] == signal.SIGXCPU:  # the wall deadline, or RLIMIT_CPU's signal
        return Outcome("timeout", 0, 0, f"ran past its time limit ({result['seconds']:.1f} s)")
    if result["output_over"]:
        return Outcome("crashed", 0, 0, "printed more than max_output_bytes")
    if result["exit"] == MEMORY_ERROR_EXIT or result["exit"] != 0 and "MemoryError" in result["stderr"][-300:]:
        return Outcome("memory", 0, 0, "ran out of memory (memory_mb)")
    if result["signal"] is not None:
        return Outcome("crashed", 0, 0, f"killed by signal {result['signal']}")
    return None


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def judge(tests: Tests, results: list[dict], nonce: str) -> Outcome:
    """The Outcome of one program from its run's results (one per case; one {"error"} if the sandbox failed)."""
    total = tests.total
    if tests.mode == "stdio":
        if len(results) != total:
            crash = _crash(results[0])
            return Outcome(crash.status, 0, total, crash.detail)
        passed, worst = 0, None
        for result, expected in zip(results, tests.outputs):
            crash = _crash(result)
            if crash is None and result["exit"] == 0 and _same_output(result["stdout"], expected):
                passed += 1
            elif worst is None:
                worst = crash or Outcome(
                    "failed", 0, 0, "wrong output" if result["exit"] == 0 else
                    f"exited with {result['exit']}: {_last_line(result['stderr'])}")
        if worst is None:
            return Outcome("passed", passed, total)
        return Outcome(worst.status, passed, total, worst.detail)
    result = results[0]
    lines = [line for line in result.get("verdict", "").splitlines() if line.startswith(nonce + " ")]
    crash = _crash(result)
    if crash is not None:
        return Outcome(crash.status, 0, total, crash.detail)
    if not lines:  # ended before the harness wrote its verdict: os._exit, a killed harness, a closed fd 3
        return Outcome("crashed", 0, total, f"ended before its tests finished (exit {result['exit']}): "
                                            f"{_last_line(result['stderr'])}")
    kind, _, rest = lines[-1][len(nonce) + 1:].partition(" ")
    if kind == "R":
        bits = rest.strip()
        passed = bits.count("1")
        if len(bits) != total:
            return Outcome("crashed", 0, total, f"the harness reported {len(bits)} tests for {total}")
        return Outcome("passed" if passed == total else "failed", passed, total,
                       "" if passed == total else f"{total - passed} of {total} tests failed")
    status, _, detail = rest.partition(" ")
    status = {"no_code": "no code"}.get(status, status)
    return Outcome(status if status in OUTCOMES else "crashed", 0, total, detail)
