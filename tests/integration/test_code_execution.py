"""The code_execution reward against real sandboxes: adversarial programs contained and scored as failures with
the right outcome (the trainer unharmed, nothing left running, nothing reached outside), a table of right and wrong
solutions, the reward's contract (log_extra, metrics, scores), and the "processes" fallback."""

import os
import socket
import sys
import time

import pytest

from tests.conftest import REPO
from trainers.errors import ConfigError, RewardFunctionError
from trainers.execution import ExecutionLimits, LocalExecutor, Program, parse_tests
from trainers.rewards import code_execution_reward

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the sandbox is Linux's")

LIMITS = ExecutionLimits(cpu_seconds=2, wall_seconds=3, memory_mb=256, max_processes=16,
                         max_output_bytes=1 << 16)


def fenced(code: str) -> str:
    return f"Here is my solution:\n```python\n{code}\n```\n"


def slot_processes() -> list[str]:
    """Processes of this test process's sandbox users (200000 + (pid % 100000) * 64 + slot, sandbox.py), or its
    own sandboxes' jails: none may outlive a run. (Another test worker's sandboxes are not this one's.)"""
    first = 200000 + (os.getpid() % 100000) * 64
    left = []
    for pid in os.listdir("/proc"):
        try:
            uid = os.stat(f"/proc/{pid}").st_uid
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{pid}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (FileNotFoundError, ProcessLookupError, NotADirectoryError, ValueError, IndexError):
            continue
        if first <= uid < first + 64 or parent == os.getpid() and "execution/jail.py" in cmdline:
            left.append(f"{pid} uid {uid}: {cmdline[:120]}")
    return left


@pytest.fixture(scope="module")
def executor():
    executor = LocalExecutor(LIMITS, max_workers=2)
    yield executor
    executor.close()


def score(executor, completions, tests, **options):
    """Scores and the logged outcomes, through the reward function's public contract."""
    reward = code_execution_reward(executor=executor, **options)
    logged, metrics = {}, {}
    scores = reward(completions=completions, tests=tests, log_extra=logged.__setitem__,
                    log_metric=metrics.__setitem__)
    return scores, logged["code_execution"], metrics


BOMB = """
import os, time
def spawn():
    children = 0
    for _ in range(3000):  # bounded: a containment bug fails the test instead of the machine
        try:
            if os.fork() == 0:
                time.sleep(30)
                os._exit(0)
            children += 1
        except OSError:
            break
    return children
"""

MEMORY = """
def hoard():
    kept = []
    for _ in range(48):  # at most 3 GB
        kept.append(bytearray(64 << 20))
    return len(kept)
"""

FAKE_PASS = """
import builtins, os, sys
builtins.AssertionError = type("Never", (Exception,), {})
builtins.exec = lambda *args, **kwargs: None
builtins.exit = sys.exit = lambda *args: None
print("R 1")
try:
    os.write(3, b"0123456789abcdef0123456789abcdef R 1\\n")
except OSError:
    pass
"""


ADVERSARIAL = {  # name: expected outcome; the programs are built by the fixture below (they name its paths)
    "infinite loop": "timeout", "sleep past the limit": "timeout", "fork bomb": "failed", "memory bomb": "memory",
    "huge print": "crashed", "read /etc/passwd": "failed", "read the trainer's file": "failed",
    "read the repository": "failed", "write outside": "failed", "open a socket": "failed",
    "kill the parent": "failed", "os._exit(0) before the tests": "crashed", "fake a pass": "failed",
    "walk the harness's frames": "crashed",
}


@pytest.fixture(scope="module")
def adversarial(executor, tmp_path_factory):
    """Every adversarial program run once, together (a round's worth): {name: (outcome, score)}, the round's metrics,
    and what the test can check outside afterwards (the file it must not find, the listener nothing reached)."""
    tmp_path = tmp_path_factory.mktemp("adversarial")
    secret = tmp_path / "trainer_secret.txt"
    secret.write_text("the trainer's secret\n")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    outside = tmp_path / "written_from_the_sandbox"
    with open("/etc/passwd") as f:
        passwd = f.read()
    stdio = lambda expected: [{"input": "", "output": expected}]  # noqa: E731
    programs = {  # name: (code, tests)
        "infinite loop": ("def f():\n    while True:\n        pass", "assert f() == 1"),
        "sleep past the limit": ("import time\ndef f():\n    time.sleep(60)\n    return 1", "assert f() == 1"),
        "fork bomb": (BOMB, "assert spawn() == 3000"),
        "memory bomb": (MEMORY, "assert hoard() == 48"),
        "huge print": ("for _ in range(100):\n    print('x' * (1 << 20))", stdio("x")),
        "read /etc/passwd": ("print(open('/etc/passwd').read(), end='')", stdio(passwd)),
        "read the trainer's file": (f"print(open({str(secret)!r}).read(), end='')", stdio(secret.read_text())),
        "read the repository": (f"print(open({os.path.join(REPO, 'pyproject.toml')!r}).read()[:20], end='')",
                                stdio(open(os.path.join(REPO, "pyproject.toml")).read()[:20])),
        "write outside": (f"open({str(outside)!r}, 'w').write('x')\nopen('/usr/pwned', 'w').write('x')\n"
                          f"print('written')", stdio("written")),
        "open a socket": (f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
                          f"s.sendall(b'pwned')\nprint('connected')", stdio("connected")),
        "kill the parent": (f"import os, signal\nfor pid in (os.getppid(), {os.getpid()}, 1):\n"
                            f"    os.kill(pid, signal.SIGKILL)\nprint('killed')", stdio("killed")),
        "os._exit(0) before the tests": ("import os\nos._exit(0)", "assert False"),
        "fake a pass": (FAKE_PASS, "assert add(1, 2) == 3"),
        "walk the harness's frames": ("import sys\nframe = sys._getframe(1)\nprint(frame.f_locals)", "assert True"),
    }
    assert list(programs) == list(ADVERSARIAL)
    scores, outcomes, metrics = score(executor, [fenced(code) for code, _ in programs.values()],
                                      [tests for _, tests in programs.values()])
    yield {"results": dict(zip(programs, zip(outcomes, scores))), "metrics": metrics, "outside": outside,
           "listener": listener}
    listener.close()


# what only namespaces contain (docs/rewards.md: the "processes" fallback leaves the network and readable files)
NEEDS_NAMESPACES = {"read /etc/passwd", "read the repository", "open a socket"}


@pytest.mark.parametrize("name", list(ADVERSARIAL))
def test_an_adversarial_program_fails_with_its_outcome(adversarial, executor, name):
    if name in NEEDS_NAMESPACES and executor.isolation != "namespaces":
        pytest.skip("this kernel refuses namespaces: the fallback does not contain this (docs/rewards.md)")
    assert adversarial["results"][name] == (ADVERSARIAL[name], 0.0)


def test_adversarial_programs_reach_nothing_and_leave_nothing(adversarial, executor):
    """After the round: nothing written outside, nothing connected to the test's listener, no process of the
    sandbox's users left, the trainer (this process) alive; the round's metrics count the outcomes."""
    assert not adversarial["outside"].exists() and not os.path.exists("/usr/pwned")
    if executor.isolation == "namespaces":
        with pytest.raises(BlockingIOError):
            adversarial["listener"].accept()
        assert adversarial["metrics"]["code_execution/passed"] == 0.0
    assert slot_processes() == []
    metrics = adversarial["metrics"]
    assert metrics["code_execution/timeout"] == pytest.approx(2 / len(ADVERSARIAL))


def test_right_and_wrong_solutions_on_a_table(executor):
    problems = [  # (right, wrong, tests)
        ("def add(a, b):\n    return a + b", "def add(a, b):\n    return a - b",
         "assert add(1, 2) == 3\nassert add(-1, 1) == 0"),
        ("def rev(s):\n    return s[::-1]", "def rev(s):\n    return s",
         ["assert rev('abc') == 'cba'", "assert rev('') == ''"]),
        ("def fact(n):\n    return 1 if n < 2 else n * fact(n - 1)", "def fact(n):\n    return n",
         "assert fact(5) == 120\nassert fact(0) == 1"),
        ("def is_prime(n):\n    return n > 1 and all(n % d for d in range(2, int(n ** 0.5) + 1))",
         "def is_prime(n):\n    return n % 2 == 1", "assert is_prime(7)\nassert not is_prime(9)\nassert is_prime(2)"),
        ("def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a",
         "def fib(n):\n    return n", "assert fib(10) == 55\nassert fib(1) == 1"),
        ("import math\ndef gcd(a, b):\n    return math.gcd(a, b)", "def gcd(a, b):\n    return min(a, b)",
         "assert gcd(12, 18) == 6"),
        ("def uniq(xs):\n    return sorted(set(xs))", "def uniq(xs):\n    return xs",
         "assert uniq([3, 1, 3, 2]) == [1, 2, 3]"),
        ("print(sum(map(int, input().split())))", "print(0)",
         [{"input": "1 2 3", "output": "6"}, {"input": "10 -4", "output": "6"}]),
        ("n = int(input())\nprint('\\n'.join(str(i * i) for i in range(n)))",
         "n = int(input())\nprint(n * n)", {"inputs": ["3", "1"], "outputs": ["0\n1\n4", "0"]}),
        ("import sys\nwords = sys.stdin.read().split()\nprint(len(words))", "print(1)",
         '[{"input": "a b c", "output": "3"}, {"input": "x", "output": "1"}]'),
        ("s = input()\nprint(s.upper())", "s = input()\nprint(s)", [{"stdin": "abc", "stdout": "ABC\n"}]),
    ]
    completions = [fenced(code) for right, wrong, _ in problems for code in (right, wrong)]
    tests = [t for _, _, t in problems for _ in range(2)]
    assert len(completions) >= 20
    scores, outcomes, _ = score(executor, completions, tests, score="all_or_nothing")
    assert outcomes == ["passed", "failed"] * len(problems)
    assert scores == [1.0, 0.0] * len(problems)


def test_the_reward_scores_fractions_names_the_column_and_finds_the_code(executor):
    completions = [fenced("def add(a, b):\n    return 3"), "no code at all",
                   "def add(a, b):\n    return a + b\n", fenced("def add(a, b):\n    return a + b")]
    tests = ["assert add(1, 2) == 3\nassert add(2, 2) == 4"] * 4
    scores, outcomes, metrics = score(executor, completions, tests, function="add")
    assert outcomes == ["failed", "no code", "passed", "passed"] and scores == [0.5, 0.0, 1.0, 1.0]
    assert metrics["code_execution/no_code"] == 0.25 and metrics["code_execution/passed"] == 0.5
    _, outcomes, _ = score(executor, [fenced("def plus(a, b):\n    return a + b")], tests[:1], function="add")
    assert outcomes == ["no code"]
    scores, outcomes, _ = score(executor, ["17+25", "42", "4 2", ""], [[{"input": "", "output": "42"}]] * 4,
                                template="print({completion})")
    assert outcomes == ["passed", "passed", "failed", "no code"] and scores == [1.0, 1.0, 0.0, 0.0]  # print(4 2)
    started = time.monotonic()  # after a case runs out of time, the program's other cases are not run
    _, outcomes, _ = score(executor, [fenced("while True:\n    pass")], [[{"input": str(i), "output": ""}
                                                                        for i in range(4)]])
    assert outcomes == ["timeout"] and time.monotonic() - started < 2 * LIMITS.wall_seconds
    fractional = LocalExecutor(ExecutionLimits(cpu_seconds=0.5, memory_mb=300.5), max_workers=1)  # rounded up
    assert [o.status for o in fractional.run([Program("def add(a, b):\n    return a + b", parse_tests(
        tests[0], "tests", 0))])] == ["passed"]
    with pytest.raises(RewardFunctionError, match="column 'tests'.*lacks"):
        code_execution_reward(executor=executor)(completions=["x"], answers=["1"])
    with pytest.raises(RewardFunctionError, match="column 'unit_tests' of row 0"):
        code_execution_reward("unit_tests", executor=executor)(completions=["x"], unit_tests=[42])


@pytest.mark.skipif(os.geteuid() != 0, reason="an unprivileged user for the program needs root")
def test_without_namespaces_the_limits_and_the_user_still_contain_it(tmp_path):
    executor = LocalExecutor(LIMITS, max_workers=2, isolation="processes")
    try:
        assert executor.sandbox.python  # an interpreter the unprivileged user can start (this one, or python3)
    except ConfigError as error:
        pytest.skip(str(error))
    cases = [(fenced("def f():\n    while True:\n        pass"), "assert f()", "timeout"),
             (fenced(BOMB), "assert spawn() == 3000", "failed"),
             (fenced(MEMORY), "assert hoard() == 48", "memory"),
             (fenced("import os, time\nif os.fork() == 0:  # a daemon: out of the session\n    os.setsid()\n"
                     "    time.sleep(60)\n    os._exit(0)"), "assert True", "passed"),
             (fenced("def add(a, b):\n    return a + b"), "assert add(2, 2) == 4", "passed")]
    scores, outcomes, _ = score(executor, [c for c, _, _ in cases], [t for _, t, _ in cases])
    executor.close()
    assert outcomes == [o for _, _, o in cases] and scores == [0.0, 0.0, 0.0, 1.0, 1.0]
    assert slot_processes() == []  # the daemon that left the session too
