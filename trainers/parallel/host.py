"""Tuning for the host the trainers run on, CPU workarounds in one place (the core calls them; none of them
changes a result): glibc's allocator settings for CPU training, a pause at exit that lets gloo's worker threads
finish, AMX permission for vLLM's CPU kernels, and a warning about DeepSpeed build locks an interrupted compile
left behind. Each function's docstring has its measurement. (Float32 attention for bf16 training on CPU is in
cpu_attention.py: this module stays light, so that ``trainers.parallel.distributed`` imports without transformers.)"""

from __future__ import annotations

import ctypes
import glob
import os
import time
import warnings

import torch


def allow_amx_tiles() -> bool:
    """Ask Linux for this process's permission to use AMX tiles, where the CPU has them; -> whether it may.

    The kernel lets a process run AMX tile instructions only after it asked (arch_prctl ARCH_REQ_XCOMP_PERM).
    oneDNN asks before its own AMX kernels; vLLM's CPU attention picks AMX kernels for bf16 without asking, and the
    engine's first bf16 forward then dies with SIGILL (seen on a Xeon with AMX: a colocated engine under the ZeRO-3
    template, whose bf16 policy makes the engine bf16). Asking twice is harmless; without AMX nothing happens."""
    return bool(torch.cpu._is_amx_tile_supported() and torch.cpu._init_amx())


def let_gloo_workers_finish() -> None:
    """At exit, give gloo's worker threads the GIL for a moment so they drop their finished work (``atexit``).

    A gloo worker frees a collective's work object after the caller has already been told it finished; when
    the work holds tensors seen from Python, freeing them needs the GIL. If the script exits within a few
    milliseconds of its last collective, the worker is still waiting for the GIL when the interpreter shuts
    down, and CPython ends the thread mid-destructor: "terminate called without an active exception", SIGABRT,
    a failed exit code for a run that trained and saved correctly. Seen in the core dump as
    ``~AsyncAllreduceWork`` -> ``take_gil`` -> ``PyThread_exit_thread`` on a worker thread. Measured on 2-process
    DDP GRPO runs on CPU: 6 aborts in 57 runs without this, 0 in 30 with it. ``destroy_process_group`` does
    not help (3 in 20): the DDP wrapper still holds the process group. Sleeping releases the GIL without
    needing the other processes, so it cannot hang when one of them has died.
    """
    time.sleep(0.1)


STALE_LOCK_SECONDS = 15 * 60  # a DeepSpeed CPU op compiles in about a minute here


def warn_on_stale_build_locks() -> list[str]:
    """Warn about compile locks that an interrupted build left behind in torch's extension folder.

    DeepSpeed compiles ``cpu_adam`` and friends through ``torch.utils.cpp_extension``, which takes a ``lock`` file
    in the op's build folder and makes every other process wait, polling, until the file disappears. A build
    killed mid-way leaves it there and the next run waits forever without a word. A fresh lock is normal (one
    rank compiles while the others wait), so only locks older than ``STALE_LOCK_SECONDS`` are reported.
    Returns the paths warned about.
    """
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()  # as torch picks it
    now = time.time()
    stale = []
    for path in sorted(glob.glob(os.path.join(root, "*", "*", "lock"))):
        try:
            age = now - os.path.getmtime(path)
        except FileNotFoundError:  # another process finished its compile since the glob: nothing to report
            continue
        if age > STALE_LOCK_SECONDS:
            warnings.warn(f"{path} is {age / 60:.0f} minutes old, probably left by an interrupted compile; DeepSpeed "
                          "will wait for it to disappear before building or loading that op, forever if nothing "
                          "removes it. If no other process is compiling it, delete the file.", stacklevel=3)
            stale.append(path)
    return stale


# glibc mallopt parameters
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4
_HOST_BLOCK = 8 << 20  # 8 MiB
_INT_MAX = 2**31 - 1
# "system" leaves glibc's allocator settings alone (for comparisons, or when returning memory matters more)
HOST_ALLOCATOR_ENV = "TRAINERS_HOST_ALLOCATOR"


def _libc():
    setting = os.environ.get(HOST_ALLOCATOR_ENV, "auto").lower()
    if setting not in ("auto", "system"):
        raise ValueError(f"{HOST_ALLOCATOR_ENV}={setting!r}: valid values are 'auto' (the default) and 'system'.")
    if setting == "system":
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (macOS, musl): leave the allocator alone
        return None


def keep_host_memory() -> bool:
    """Make glibc keep freed memory for reuse instead of returning it to the OS, for training on CPU without ZeRO.

    A training step allocates and frees the same large activations, logits chunks and gradients every time.
    By default glibc serves blocks above its mmap threshold (at most 32 MiB) with fresh ``mmap`` calls and
    trims freed heap tops, so every step pays the kernel to zero-fill and fault in the same pages again: on
    the 2-core CI machine a third of the wall time went to system time. With no mmapped blocks and no trimming
    the pages are faulted in once. Measured (docs/benchmarks.md): bf16 SFT on the ~85M model 6.0-7.0 s ->
    4.4-4.6 s per step. The cost is that each process keeps its peak heap until it exits. Returns whether it
    was applied (glibc only; ``TRAINERS_HOST_ALLOCATOR=system`` turns it off).
    """
    libc = _libc()
    if libc is None:
        return False
    libc.mallopt(_M_TRIM_THRESHOLD, _INT_MAX)
    libc.mallopt(_M_MMAP_MAX, 0)
    return True


def tune_host_allocator() -> bool:
    """Make glibc return freed large blocks to the OS, for DeepSpeed training on CPU.

    ZeRO-3 frees and re-gathers every layer's weights at each step. glibc serves blocks below its *dynamic*
    mmap threshold (which climbs to 32 MiB after the first large free) from heap arenas and keeps them after
    they are freed, so resident memory grows by what ZeRO released. Fixing the threshold at 8 MiB makes such
    blocks mmapped and unmapped on free. Measured (docs/distributed.md): -1.5 GB peak per rank for a 300M
    model under ZeRO-3 on CPU, no measurable cost at that size, ~5% on a width-256 model (a 1 MiB threshold
    cost 45-70% there), so it is applied to DeepSpeed runs on CPU only. Returns whether it was applied
    (``TRAINERS_HOST_ALLOCATOR=system`` turns it off).
    """
    libc = _libc()
    if libc is None:
        return False
    libc.mallopt(_M_MMAP_THRESHOLD, _HOST_BLOCK)
    libc.mallopt(_M_TRIM_THRESHOLD, _HOST_BLOCK)
    return True
