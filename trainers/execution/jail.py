"""The sandbox's trusted side: runs one program's cases and reports each as a JSON line on stdout.

Standalone (standard library only, started as ``python -I -S jail.py`` by trainers/execution/sandbox.py, which
sends the job as JSON on stdin), so nothing of the trainer's process (its imports, threads, file descriptors,
environment) reaches the program.

Isolation "namespaces" (root): new mount, PID, network, IPC and UTS namespaces. This process forks the namespace's
PID 1 (the reaper below), which builds a root of its own (a tmpfs holding read-only binds of /usr, the libraries and
Python's prefix, /dev/null and friends, a fresh /proc and an empty tmpfs working folder, nothing else: no /etc, no
home, no trainer files), chroots into it and runs each case as an unprivileged user. The network namespace has only
a loopback that is down: no socket reaches anything. When PID 1 exits, the kernel kills every process left in the
namespace, whatever it did (setsid, daemonised, a fork bomb's leftovers).

Isolation "processes" (no namespaces: not root, or the kernel refuses them): the same limits and, as root, the same
unprivileged user (a user of its own per slot, so the process limit is the program's own and every process it
left can be found and killed by user); the files and the network the user can reach stay reachable.

Each case: a child with resource limits (CPU, address space, processes, open files, file size), nice 10, an empty
environment but PATH/HOME/LANG, stdin from the case, stdout/stderr/verdict (fd 3) read here with a cap and a wall
deadline, the job on fd 4 (read and closed by the harness). After each case, everything the program started is
killed.
"""

import ctypes
import json
import math
import os
import selectors
import signal
import sys
import time

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18

_libc = ctypes.CDLL(None, use_errno=True)


def _mount(source, target, fstype, flags, data=None) -> None:
    encode = (lambda s: s.encode() if s is not None else None)
    if _libc.mount(encode(source), encode(target), encode(fstype), flags, encode(data)) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mount {source} on {target}: {os.strerror(errno)}")


def _bind_read_only(source: str, target: str) -> None:
    _mount(source, target, None, MS_BIND | MS_REC)
    _mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def build_root(root: str, job: dict) -> None:
    """The namespace's file system (see the module docstring), then chroot into it and cd to /work."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing mounted here propagates back to the host
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    for path in job["read_only"]:  # /usr, /lib*, /bin, Python's prefix: as links where the host has links
        if os.path.islink(path):
            os.makedirs(os.path.dirname(root + path), exist_ok=True)
            os.symlink(os.readlink(path), root + path)
        elif os.path.isdir(path):
            os.makedirs(root + path, exist_ok=True)
            _bind_read_only(path, root + path)
    os.makedirs(root + "/dev")
    for device in ("null", "zero", "random", "urandom"):
        open(root + "/dev/" + device, "w").close()
        _mount("/dev/" + device, root + "/dev/" + device, None, MS_BIND)
    open(root + "/harness.py", "w").close()
    _bind_read_only(job["harness"], root + "/harness.py")
    os.makedirs(root + "/proc")
    _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV)  # this PID namespace's processes only
    os.makedirs(root + "/work")
    _mount("tmpfs", root + "/work", "tmpfs", MS_NOSUID | MS_NODEV, f"size={int(job['limits']['disk_mb'])}m,mode=1777")
    os.makedirs(root + "/tmp")
    _mount("tmpfs", root + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=1777")
    _mount(None, root, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chroot(root)
    os.chdir("/work")


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name, 0)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _child(job: dict, stdin_fd: int, job_fd: int, out_w: int, err_w: int, verdict_w: int) -> None:
    """In the forked child: limits, user, file descriptors, then exec the harness. Never returns."""
    try:
        limits = job["limits"]
        os.dup2(stdin_fd, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        os.dup2(verdict_w, 3)
        os.dup2(job_fd, 4)
        os.closerange(5, 65536)
        if job["isolation"] == "processes":
            os.setsid()  # its own process group, killed whole after the case
            os.chdir(job["workdir"])
        os.setpriority(os.PRIO_PROCESS, 0, 10)  # the trainer keeps the CPU it needs
        cpu = max(1, math.ceil(limits["cpu_seconds"]))  # whole seconds: RLIMIT_CPU 0 would mean none at all
        resource_limits = [("RLIMIT_CPU", cpu, cpu + 1), ("RLIMIT_AS", int(limits["memory_mb"]) << 20, None),
                           ("RLIMIT_NPROC", int(limits["max_processes"]), None),
                           ("RLIMIT_NOFILE", int(limits["max_open_files"]), None),
                           ("RLIMIT_FSIZE", int(limits["max_file_bytes"]), None), ("RLIMIT_CORE", 0, None)]
        import resource
        for name, soft, hard in resource_limits:
            resource.setrlimit(getattr(resource, name), (soft, soft if hard is None else hard))
        if job["uid"] is not None:
            os.setgroups([])
            os.setgid(job["uid"])
            os.setuid(job["uid"])
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": os.getcwd(), "LANG": "C.UTF-8",
               "PYTHONIOENCODING": "utf-8"}
        os.execve(job["python"], [job["python"], "-I", "-S", "-B", job["harness_path"], job["mode"]], env)
    except BaseException as error:  # noqa: BLE001 -- the child must never return into the reaper's code
        try:
            os.write(2, f"sandbox set-up failed: {error!r}\n".encode())
        finally:
            os._exit(126)


def _kill_everything(job: dict, pid: int) -> int | None:
    """Kill every process the case started: the whole PID namespace but this one (kill(-1) from its PID 1); else the
    child's process group and, as root, every process of the slot's user. Then reap them (orphans come here: PID 1,
    or a child subreaper), so none is left counting against the next case's process limit. Returns the case
    child's wait status if it was reaped here."""
    if os.getpid() == 1:
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:  # none left
            pass
    else:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if job["uid"] is not None:
            _kill_user(job["uid"])
    status, deadline = None, time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            reaped, raw = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if reaped == pid:
            status = raw
        elif reaped == 0:
            time.sleep(0.005)
    return status


def _kill_user(uid: int) -> None:
    """kill(-1) as ``uid``, from a helper: every process of that user (the helper excepted), until none is left."""
    for _ in range(100):
        helper = os.fork()
        if helper == 0:
            try:
                os.setuid(uid)
                os.kill(-1, signal.SIGKILL)
                os._exit(0)
            except ProcessLookupError:
                os._exit(1)  # none left
            except BaseException:  # noqa: BLE001
                os._exit(2)
        _, raw = os.waitpid(helper, 0)
        if os.waitstatus_to_exitcode(raw) != 0:
            return


def run_case(job: dict, stdin_text: str) -> dict:
    """One run of the program; its exit, what it printed (capped) and whether it ran out of time or output."""
    limits = job["limits"]
    cap = int(limits["max_output_bytes"])
    pipes = {name: os.pipe() for name in ("stdout", "stderr", "verdict")}
    stdin_fd = _memfd("stdin", stdin_text.encode())
    job_fd = _memfd("job", json.dumps(job["program"]).encode())
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:
        _child(job, stdin_fd, job_fd, pipes["stdout"][1], pipes["stderr"][1], pipes["verdict"][1])
    for fd in (stdin_fd, job_fd, *(w for _, w in pipes.values())):
        os.close(fd)
    captured = {name: bytearray() for name in pipes}
    selector = selectors.DefaultSelector()
    for name, (r, _) in pipes.items():
        selector.register(r, selectors.EVENT_READ, name)
    deadline = started + limits["wall_seconds"]
    status, timed_out, over = None, False, False
    while True:
        for key, _ in selector.select(timeout=0.01):
            data = os.read(key.fd, 65536)
            if not data:
                selector.unregister(key.fd)
                continue
            captured[key.data] += data
            if len(captured[key.data]) > cap:
                over = True
        if status is None:
            done, raw = os.waitpid(pid, os.WNOHANG)
            if done:
                status = raw
                _kill_everything(job, pid)  # leftovers would hold the pipes open: the case is over
        if over or time.monotonic() > deadline:
            timed_out = not over
            reaped = _kill_everything(job, pid)
            if status is None:
                status = reaped if reaped is not None else os.waitpid(pid, 0)[1]
            break
        if status is not None and not selector.get_map():
            break
    for key in list(selector.get_map().values()):  # what is left in the pipes after the kill (never waiting: a
        while len(captured[key.data]) <= cap:      # process this one could not kill may still hold a pipe open)
            ready = {ready_key.fd for ready_key, _ in selector.select(timeout=0)}
            data = os.read(key.fd, 65536) if key.fd in ready else b""
            if not data:
                break
            captured[key.data] += data
    for _, (r, _) in pipes.items():
        os.close(r)
    code = os.waitstatus_to_exitcode(status)
    return {"exit": code if code >= 0 else None, "signal": -code if code < 0 else None, "timeout": timed_out,
            "output_over": over, "seconds": round(time.monotonic() - started, 4),
            "stdout": captured["stdout"][:cap].decode(errors="replace"),
            "stderr": captured["stderr"][-2000:].decode(errors="replace"),
            "verdict": captured["verdict"][:65536].decode(errors="replace")}


def run_cases(job: dict) -> None:
    """Each case in turn; after one that ran out of time the others are not run (each reported as timed out
    without running), so a program that loops costs one wall_seconds, not one per case."""
    timed_out = False
    for stdin_text in job["cases"]:
        if timed_out:
            result = {"exit": None, "signal": None, "timeout": True, "output_over": False, "seconds": 0.0,
                      "stdout": "", "stderr": "", "verdict": "", "skipped": True}
        else:
            result = run_case(job, stdin_text)
            timed_out = result["timeout"] or result["signal"] == signal.SIGXCPU
        print(json.dumps(result), flush=True)


def main() -> None:
    job = json.loads(sys.stdin.read())
    if job["isolation"] == "processes":
        _libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: the program's orphans come here to be reaped
        job["harness_path"] = job["harness"]
        run_cases(job)
        return
    if _libc.unshare(CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS) != 0:
        errno = ctypes.get_errno()
        print(json.dumps({"unshare_failed": os.strerror(errno)}), flush=True)
        sys.exit(3)
    reaper = os.fork()
    if reaper == 0:  # PID 1 of the new namespace: the program's whole world ends when it exits
        try:
            build_root(job["root"], job)
            job["harness_path"] = "/harness.py"
            run_cases(job)
        except BaseException as error:  # noqa: BLE001
            print(json.dumps({"setup_failed": repr(error)}), flush=True)
            os._exit(4)
        os._exit(0)
    _, status = os.waitpid(reaper, 0)
    sys.exit(os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    main()
