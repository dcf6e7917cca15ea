"""The sandbox's untrusted side: runs inside the program's own process (``python -I -S -B harness.py MODE``, started
by trainers/execution/jail.py with the job on fd 4 and the verdict pipe on fd 3). Standard library only.

Mode "stdio": the program runs as ``__main__`` with the case on stdin; its stdout is judged outside, by the
trainer, so nothing here can fake a pass. A MemoryError exits with MEMORY_ERROR_EXIT so the judge can tell it apart.

Mode "assert": the program runs, then each test (assert statements, or any code that raises on failure) in the
program's namespace; one verdict line goes to fd 3, ``<nonce> R <bits>`` (1 = the test ran without raising) or
``<nonce> E <kind> <message>``. The nonce comes with the job and lives only in this function's locals, so a program
that exits early (``sys.exit``, ``os._exit(0)``), patches ``exit``/``AssertionError``/``exec``/``print`` or prints
a verdict of its own gets no pass: the verdict is written only here, with references taken before the program ran.
Reaching the nonce would take this frame or the process's memory; an audit hook (it cannot be removed) refuses what
leads there (frames, the garbage collector's object lists, ctypes, /proc, tracing, starting other programs), and
the process is made non-dumpable.
"""

import sys

MEMORY_ERROR_EXIT = 102  # stdio mode's exit code for a MemoryError (the judge, trainers/execution/programs.py)


def _harden() -> None:
    import ctypes

    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: no other process reads this one's memory

    refused_events = {"gc.get_objects", "gc.get_referrers", "gc.get_referents", "sys._getframe",
                      "sys._current_frames", "sys.settrace", "sys.setprofile", "os.exec", "os.posix_spawn",
                      "os.spawn", "os.system", "subprocess.Popen", "ctypes.dlopen", "ctypes.dlsym",
                      "ctypes.cdata", "ctypes.call_function", "sys.remote_exec"}
    refused_attributes = {"tb_frame", "gi_frame", "cr_frame", "ag_frame", "f_back", "f_locals", "f_globals"}
    refused_modules = {"_posixsubprocess", "_ctypes", "ctypes", "gc"}
    starts_with = str.startswith

    def audit(event, args, _refused=refused_events, _attrs=refused_attributes, _modules=refused_modules,
              _startswith=starts_with, _str=str, _isinstance=isinstance):
        if event in _refused:
            raise PermissionError(f"{event} is not allowed in the sandbox")
        if event == "object.__getattr__" and args[1] in _attrs:
            raise PermissionError(f"reading {args[1]} is not allowed in the sandbox")
        if event == "import" and args[0] in _modules:
            raise PermissionError(f"importing {args[0]} is not allowed in the sandbox")
        if event == "open" and _isinstance(args[0], _str) and _startswith(args[0], "/proc"):
            raise PermissionError("/proc is not readable in the sandbox")

    sys.addaudithook(audit)
    for name in refused_modules:  # a module imported before the hook would not raise its import event
        sys.modules.pop(name, None)


def _read_job() -> dict:
    import json
    import os

    chunks = []
    while True:
        chunk = os.read(4, 1 << 20)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(4)
    return json.loads(b"".join(chunks))


def run_stdio(program: dict) -> None:
    import os

    os.close(3)
    code = program["code"]
    del program
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        exec(compile(code, "solution.py", "exec"), namespace)
    except MemoryError:
        os.write(2, b"MemoryError\n")
        os._exit(MEMORY_ERROR_EXIT)
    sys.stdout.flush()


def run_asserts(program: dict) -> None:
    import os

    # Everything the verdict depends on, taken before the program runs: it may rebind any builtin or module name
    _write, _exit, _exec, _compile, _encode = os.write, os._exit, exec, compile, str.encode
    _base, _memory, _str, _type, _join = BaseException, MemoryError, str, type, str.join
    nonce, tests, function, code = program["nonce"], list(program["tests"]), program.get("function"), program["code"]
    del program

    def verdict(line):
        try:
            _write(3, _encode(nonce + " " + line + "\n"))
        finally:
            _exit(0)

    _harden()
    namespace = {"__name__": "solution", "__builtins__": __builtins__}
    try:
        _exec(_compile(code, "solution.py", "exec"), namespace)
    except _memory:
        verdict("E memory MemoryError while defining the solution")
    except _base as error:  # SystemExit and KeyboardInterrupt too: the tests did not run
        verdict("E crashed " + _type(error).__name__ + " while running the solution: " + _str(error)[:300])
    if function is not None and function not in namespace:
        verdict("E no_code the code defines no function named " + function)
    bits = []
    for test in tests:
        try:
            _exec(_compile(test, "test.py", "exec"), namespace)
            bits.append("1")
        except _memory:
            verdict("E memory MemoryError in a test")
        except _base:
            bits.append("0")
    verdict("R " + _join("", bits))


def main() -> None:
    program = _read_job()
    if sys.argv[1] == "stdio":
        run_stdio(program)
    else:
        run_asserts(program)


if __name__ == "__main__":
    main()
