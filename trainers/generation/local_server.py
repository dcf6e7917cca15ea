"""A `trainers vllm-serve` server started from Python on this machine, for scripts that serve a model they have just
made (examples/grpo_tools.py --async_generation, examples/distill_arithmetic.py --serve_teacher, the vLLM
benchmarks): started on a free port, optionally pinned to some CPU cores, waited for until it answers, stopped
with every process it started. The server itself is generation/vllm_server.py."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

from trainers.errors import VLLMServerError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LocalServer:
    """A running server: its process (the leader of its own process group), URL, log file and start-up time."""

    process: subprocess.Popen
    url: str
    log_path: str
    startup_seconds: float

    def stop(self, grace: float = 30.0) -> None:
        """SIGTERM to the server's process group (vLLM shuts its engine down), SIGKILL after ``grace`` seconds (a
        server still holding connections from a client that gave up can wait for them that long)."""
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=grace)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def start_local_server(model: str, log_path: str, *, max_model_len: int = 1024, dtype: str = "float32",
                       cores: list[int] | None = None, extra: tuple[str, ...] = (), timeout: float = 600.0,
                       port: int | None = None) -> LocalServer:
    """`trainers vllm-serve --model model` on 127.0.0.1 and a free port (eager, a 1 GiB KV cache on CPU; ``extra``:
    more flags), its output in ``log_path`` (``port``: that one instead, e.g. a server restarted where it was); with
    ``cores``, the server and its engine run on those CPU cores alone (taskset, and vLLM's own thread binding). Returns once the server answers; an error naming the log if it
    exits or does not answer within ``timeout`` seconds."""
    from trainers.generation.vllm_client import VLLMClient

    port = port or free_port()
    command = [sys.executable, "-m", "trainers.cli.main", "vllm-serve", "--model", model, "--host", "127.0.0.1",
               "--port", str(port), "--dtype", dtype, "--max_model_len", str(max_model_len), "--enforce_eager",
               "--cpu_kvcache_space", "1", "--log_level", "warning", *extra]
    env = dict(os.environ)
    if cores:
        listed = ",".join(map(str, cores))
        command = ["taskset", "-c", listed] + command
        env.update(VLLM_CPU_OMP_THREADS_BIND=listed, OMP_NUM_THREADS=str(len(cores)))
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    url, started = f"http://127.0.0.1:{port}", time.monotonic()
    while True:
        if process.poll() is not None:
            raise VLLMServerError(f"the vLLM server for {model} exited ({process.returncode}); see {log_path}")
        try:
            VLLMClient(url, connection_timeout=0).close()
            return LocalServer(process, url, log_path, time.monotonic() - started)
        except VLLMServerError:
            if time.monotonic() - started > timeout:
                LocalServer(process, url, log_path, 0.0).stop()
                raise VLLMServerError(f"the vLLM server for {model} did not answer within {timeout:g} s; see "
                                      f"{log_path}") from None
            time.sleep(0.5)
