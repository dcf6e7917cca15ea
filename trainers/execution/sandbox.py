"""Running untrusted code: the limits, the choice of isolation, and one sandboxed run of a program's cases.

A run starts ``python -I -S trainers/execution/jail.py`` in a session of its own with a minimal environment and no
inherited file descriptors, sends it the job on stdin and reads one JSON line per case back (jail.py says what it
builds; harness.py what runs inside). The program never runs in the trainer's process: no ``eval``/``exec`` here.
"""

from __future__ import annotations

import functools
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, fields

from trainers.errors import ConfigError
from trainers.logs import logger

HERE = os.path.dirname(os.path.abspath(__file__))
JAIL, HARNESS = os.path.join(HERE, "jail.py"), os.path.join(HERE, "harness.py")
ISOLATIONS = ("auto", "namespaces", "processes")
SLOT_USERS = 64  # users per process: slot i of process p runs as 200000 + (p % 100000) * 64 + i


@dataclass(frozen=True)
class ExecutionLimits:
    """What one program may use. Each case (one stdin, or the whole list of asserts) gets these afresh."""

    cpu_seconds: float = 5.0  # CPU time per case (RLIMIT_CPU): past it, "timeout"
    wall_seconds: float = 10.0  # wall time per case (a sleeping program uses no CPU): past it, "timeout"
    memory_mb: int = 512  # address space (RLIMIT_AS): past it a MemoryError, "memory"
    max_processes: int = 16  # processes and threads of the program's user (RLIMIT_NPROC)
    max_open_files: int = 64  # RLIMIT_NOFILE
    max_output_bytes: int = 1 << 20  # stdout (and stderr) past this: the program is stopped, "crashed"
    max_file_bytes: int = 16 << 20  # one file written (RLIMIT_FSIZE)
    disk_mb: int = 64  # the working folder's size (a tmpfs, under isolation "namespaces")

    def __post_init__(self):
        for field in fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ConfigError(f"ExecutionLimits.{field.name} must be a positive number, got {value!r}.")
        if self.max_open_files < 16:
            raise ConfigError(f"ExecutionLimits.max_open_files must be at least 16 (Python itself opens a few), "
                              f"got {self.max_open_files}.")
        if self.memory_mb < 64:
            raise ConfigError(f"ExecutionLimits.memory_mb must be at least 64 (Python itself needs that much "
                              f"address space), got {self.memory_mb}.")


def _base_python() -> str:
    """The interpreter itself, not a virtual environment's link to it (the venv's folder stays outside)."""
    return os.path.realpath(getattr(sys, "_base_executable", sys.executable))


def _world_reachable(path: str) -> bool:
    """Whether any user can run ``path``: every folder above it searchable by others, the file readable and
    executable by them (an interpreter under /root is not: the unprivileged user of "processes" cannot start it)."""
    path = os.path.realpath(path)
    folder = os.path.dirname(path)
    while folder != "/":
        if not os.stat(folder).st_mode & 0o001:
            return False
        folder = os.path.dirname(folder)
    return os.stat(path).st_mode & 0o005 == 0o005


def _interpreter(isolation: str) -> str:
    """This Python's base interpreter; under "processes" as root, one the unprivileged user can start (the
    system's python3 where this one is not, with a warning), else an error saying why."""
    python = _base_python()
    if isolation == "namespaces" or os.geteuid() != 0 or _world_reachable(python):
        return python
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3", "/bin/python3"):
        if os.path.exists(candidate) and _world_reachable(candidate):
            logger.warning(f"Code execution (isolation 'processes') runs programs with {candidate}: this Python "
                           f"({python}) is not reachable by the unprivileged user programs run as.")
            return os.path.realpath(candidate)
    raise ConfigError(f"Code execution with isolation 'processes' cannot run programs as an unprivileged user: this "
                      f"Python ({python}) is not reachable by other users and no system python3 is; install Python "
                      f"where any user can run it, or run where namespaces are allowed (isolation 'namespaces').")


def _read_only_paths() -> list[str]:
    """What the namespace's root shows read-only: the system's programs and libraries, and Python's prefix."""
    paths = ["/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"]
    prefix = os.path.realpath(sys.base_prefix)
    if not any(prefix == p or prefix.startswith(p + "/") for p in paths):
        paths.append(prefix)
    return [p for p in paths if os.path.lexists(p)]


@functools.lru_cache(maxsize=None)
def probe_isolation(requested: str) -> str:
    """The isolation this machine gives: "namespaces" where the kernel lets this process create them (root, or a
    kernel that allows it), else "processes" with a warning saying what is then reachable. ``requested``
    "namespaces" that cannot be had is an error; "processes" is taken as asked."""
    if requested not in ISOLATIONS:
        raise ConfigError(f"isolation must be one of {ISOLATIONS}, got {requested!r}.")
    if requested == "processes":
        return requested
    reason = None
    if os.geteuid() != 0:
        reason = "not running as root (namespaces and an unprivileged user for the program need it)"
    else:
        # an empty program, end to end: its harness's verdict ("x R", no tests) says the whole sandbox works
        results = Sandbox(ExecutionLimits(), "namespaces").run({"code": "", "tests": [], "nonce": "x"}, "assert",
                                                                [""], slot=0)
        if not results[0].get("verdict", "").startswith("x R"):
            reason = f"an empty program did not run in them ({str(results[0])[:500]})"
    if reason is None:
        return "namespaces"
    if requested == "namespaces":
        raise ConfigError(f"isolation='namespaces' is not available here: {reason}.")
    logger.warning(f"Code execution runs without namespaces: {reason}. Programs still run under resource limits, "
                   f"in a session of their own{', as an unprivileged user' if os.geteuid() == 0 else ''}, killed "
                   f"whole after each case; but they can reach the network and read what that user can read "
                   f"(docs/rewards.md, 'Running code').")
    return "processes"


class Sandbox:
    """Runs programs under ``limits`` with ``isolation`` ("namespaces" or "processes", from probe_isolation)."""

    def __init__(self, limits: ExecutionLimits, isolation: str):
        self.limits, self.isolation = limits, isolation
        self.python, self.read_only = _interpreter(isolation), _read_only_paths()

    def slot_user(self, slot: int) -> int | None:
        """The unprivileged user slot ``slot`` runs as (root only: an ordinary user cannot switch users)."""
        if os.geteuid() != 0:
            return None
        return 200000 + (os.getpid() % 100000) * SLOT_USERS + slot % SLOT_USERS

    def run(self, program: dict, mode: str, cases: list[str], slot: int) -> list[dict]:
        """Run ``program`` ({"code", "tests", "nonce", "function"}) once per case (its stdin) in ``mode``
        ("stdio" or "assert"); one dict per case (jail.py's run_case), or one {"error": ...} if the jail failed."""
        uid = self.slot_user(slot)
        scratch = tempfile.mkdtemp(prefix="trainers-sandbox-")
        try:
            workdir = os.path.join(scratch, "work")
            os.makedirs(workdir)
            os.makedirs(os.path.join(scratch, "root"))
            harness = os.path.join(scratch, "harness.py")  # where the program's user can read it, wherever we are
            shutil.copyfile(HARNESS, harness)
            os.chmod(harness, 0o644)
            if uid is not None:
                os.chown(workdir, uid, uid)
            os.chmod(scratch, 0o755)
            os.chmod(workdir, 0o700)
            job = {"isolation": self.isolation, "python": self.python, "harness": harness, "uid": uid,
                   "limits": asdict(self.limits), "mode": mode, "program": program, "cases": cases,
                   "read_only": self.read_only, "root": os.path.join(scratch, "root"), "workdir": workdir}
            return self._start(job, uid, len(cases))
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def _start(self, job: dict, uid: int | None, n: int) -> list[dict]:
        limit = n * (self.limits.wall_seconds + 2) + 5  # the jail's own set-up and each case's kill included
        process = subprocess.Popen([self.python, "-I", "-S", JAIL], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, start_new_session=True, close_fds=True,
                                   env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
        try:
            out, err = process.communicate(json.dumps(job).encode(), timeout=limit)
        except subprocess.TimeoutExpired:
            self._kill(process, uid)
            out, err = process.communicate()
            return [{"error": f"the sandbox itself did not finish within {limit:g} s"}]
        finally:
            if process.poll() is None:
                self._kill(process, uid)
        lines = [json.loads(line) for line in out.decode(errors="replace").splitlines() if line.startswith("{")]
        results = [line for line in lines if "exit" in line]
        if len(results) != n:
            failure = next((line for line in lines if "exit" not in line), None)
            return [failure or {"error": f"the sandbox exited with {process.returncode}: "
                                         f"{err.decode(errors='replace')[-500:]}"}]
        return results

    def _kill(self, process: subprocess.Popen, uid: int | None) -> None:
        """The jail and everything in its session; under "namespaces" killing the jail's PID 1 ends the rest."""
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if uid is not None and self.isolation == "processes":
            _kill_user(uid)
        process.wait()


def _kill_user(uid: int) -> None:
    """Every process of ``uid`` (found in /proc), until none is left: ones that left the session too."""
    for _ in range(50):
        found = False
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                if os.stat(f"/proc/{pid}").st_uid == uid:
                    os.kill(int(pid), signal.SIGKILL)
                    found = True
            except (FileNotFoundError, ProcessLookupError):
                continue
        if not found:
            return


class Slots:
    """A bounded set of slot numbers, so concurrent runs use different users (and their own process limits)."""

    def __init__(self, n: int):
        self._free: queue.Queue = queue.Queue()
        for slot in range(n):
            self._free.put(slot)

    def take(self) -> int:
        return self._free.get()

    def give(self, slot: int) -> None:
        self._free.put(slot)
