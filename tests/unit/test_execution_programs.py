"""What a completion's program and a row's tests are, and how a run's results are judged (no sandbox here:
trainers/execution/programs.py is pure)."""

import pytest

from trainers.errors import ConfigError
from trainers.execution import ExecutionLimits, Outcome, extract_code, parse_tests
from trainers.execution.programs import judge


def test_the_last_python_block_is_the_program():
    text = "First:\n```python\nx = 1\n```\nthen\n```\nprint(2)\n```\nand\n```text\nnot code\n```"
    assert extract_code(text) == "print(2)\n"
    assert extract_code("```py\nprint(1)\n```") == "print(1)\n"
    assert extract_code("no code here") is None
    assert extract_code("def add(a, b):\n    return a + b", function="add").startswith("def add")
    assert extract_code("def plus(a, b): ...", function="add") is None


def test_test_layouts():
    tests = parse_tests("import math\nassert math.pi > 3\nx = 2\nassert x == 2\ncheck(x)", "tests", 0)
    assert tests.mode == "assert" and tests.asserts == ("import math\nassert math.pi > 3\n", "x = 2\nassert x == 2\n",
                                                         "check(x)")
    assert parse_tests(["assert 1", "assert 2"], "tests", 0).total == 2
    stdio = parse_tests([{"input": "1", "output": "2"}, {"stdin": "3", "stdout": "4"}], "tests", 0)
    assert (stdio.mode, stdio.inputs, stdio.outputs) == ("stdio", ("1", "3"), ("2", "4"))
    apps = parse_tests('{"inputs": ["1\\n"], "outputs": ["2\\n"]}', "tests", 0)
    assert (apps.inputs, apps.outputs) == (("1\n",), ("2\n",))
    for bad in (42, [], [{"input": "1"}], {"inputs": ["1"], "outputs": []}):
        with pytest.raises(ValueError, match="column 'tests' of row 3"):
            parse_tests(bad, "tests", 3)


def case(exit=0, signal=None, timeout=False, over=False, stdout="", stderr="", verdict=""):
    return {"exit": exit, "signal": signal, "timeout": timeout, "output_over": over, "seconds": 0.1,
            "stdout": stdout, "stderr": stderr, "verdict": verdict}


def test_judging_input_output_cases():
    tests = parse_tests([{"input": "", "output": "1\n2"}, {"input": "", "output": "3"}], "tests", 0)
    assert judge(tests, [case(stdout="1  \n2\n\n"), case(stdout="3")], "n") == Outcome("passed", 2, 2)
    assert judge(tests, [case(stdout="1\n2"), case(stdout="4")], "n").status == "failed"
    assert judge(tests, [case(stdout="1\n2"), case(exit=1, stdout="3", stderr="ValueError: x")], "n").passed == 1
    assert judge(tests, [case(stdout="1\n2"), case(timeout=True)], "n") == Outcome(
        "timeout", 1, 2, "ran past its time limit (0.1 s)")
    assert judge(tests, [case(exit=102), case()], "n").status == "memory"
    assert judge(tests, [case(signal=24), case()], "n").status == "timeout"  # SIGXCPU: RLIMIT_CPU
    assert judge(tests, [case(over=True), case()], "n").status == "crashed"
    assert judge(tests, [{"error": "the sandbox itself did not finish"}], "n").status == "crashed"


def test_an_assert_verdict_counts_only_with_the_runs_nonce():
    tests = parse_tests("assert f(1)\nassert f(2)", "tests", 0)
    assert judge(tests, [case(verdict="n0nce R 11\n")], "n0nce") == Outcome("passed", 2, 2)
    assert judge(tests, [case(verdict="n0nce R 10\n")], "n0nce").score(all_or_nothing=False) == 0.5
    assert judge(tests, [case(verdict="n0nce R 10\n")], "n0nce").score(all_or_nothing=True) == 0.0
    assert judge(tests, [case(verdict="guess R 11\n", stdout="n0nce R 11")], "n0nce").status == "crashed"
    assert judge(tests, [case(verdict="n0nce E memory MemoryError")], "n0nce").status == "memory"
    assert judge(tests, [case(verdict="n0nce E no_code no function named f")], "n0nce").status == "no code"
    assert judge(tests, [case(verdict="n0nce R 1")], "n0nce").status == "crashed"  # 1 result for 2 tests


def test_limits_are_checked_once():
    with pytest.raises(ConfigError, match="ExecutionLimits.wall_seconds must be a positive number"):
        ExecutionLimits(wall_seconds=0)
    with pytest.raises(ConfigError, match="memory_mb must be at least 64"):
        ExecutionLimits(memory_mb=32)
