"""Accelerate's notebook_launcher, made safe to fork from: the OpenMP hook and the check after the fork.

notebook_launcher(train_fn, num_processes=N) forks N processes from the notebook (torch elastic, start method
"fork" on CPU and CUDA) with RANK/WORLD_SIZE/MASTER_* set; build_accelerator (parallel/distributed.py) then makes
them DDP over gloo (cpu=True) on CPU, as for `accelerate launch`. Two things of that launch need help:
  - its mixed_precision= goes to the environment variable MIXED_PRECISION, which Accelerate never reads (it
    reads ACCELERATE_MIXED_PRECISION): build_accelerator honours it.
  - GNU OpenMP (the libgomp torch's CPU wheels ship) is not fork-safe: a process forked from one whose thread
    had run a multi-threaded torch op inherits that thread's OpenMP pool without its threads, and its first
    multi-threaded op waits for them forever. Before notebook_launcher forks, the hook below ends the pool
    (omp_pause_resource_all, OpenMP 5.0: the notebook's next op starts a new one); where the hook could not run
    (trainers imported only after the fork), build_accelerator refuses more than one thread instead of hanging.

Importing this module registers the hook (``import trainers`` does).
"""

from __future__ import annotations

import os

import torch

from trainers.errors import DistributedError

_released_openmp_before_fork = False  # set in the notebook just before the fork; the forked processes inherit it


def notebook_launched() -> bool:
    """Whether Accelerate's notebook_launcher started this process or is about to fork it: it sets NPROC and
    MIXED_PRECISION for its processes, names neither `accelerate launch` nor torchrun sets."""
    return "NPROC" in os.environ and "MIXED_PRECISION" in os.environ


def _gnu_openmp() -> list[str]:
    """The paths of every libgomp this process has loaded (torch's OpenMP; other wheels bundle their own copy, e.g.
    sentencepiece's, which vLLM's dependencies bring in), or [] (none, or another OpenMP)."""
    try:
        with open("/proc/self/maps") as maps:
            return list(dict.fromkeys(line.split()[-1] for line in maps if "/libgomp" in line))
    except OSError:  # not Linux: no libgomp either
        return []


def _release_openmp_threads() -> None:
    """os.register_at_fork hook, in the process about to fork: before notebook_launcher's fork, end the calling
    thread's OpenMP pool so the forked processes do not inherit a pool whose threads they lack."""
    global _released_openmp_before_fork
    paths = _gnu_openmp() if notebook_launched() else []
    if not paths:
        return
    import ctypes

    omp_pause_hard = 2  # omp_pause_resource_t: free the threads, not only idle them
    # every copy: which one torch's thread pool lives in cannot be told from here
    results = [ctypes.CDLL(path).omp_pause_resource_all(omp_pause_hard) for path in paths]
    if all(result == 0 for result in results):
        _released_openmp_before_fork = True


os.register_at_fork(before=_release_openmp_threads)


def check_threads_after_fork() -> None:
    """In a process notebook_launcher forked, with this module imported only after the fork (so the hook above did
    not run in the notebook): more than one torch thread would hang the first step if the notebook had run a
    multi-threaded torch op, which cannot be told from here. Refuse it, naming the two ways out."""
    if _released_openmp_before_fork or torch.get_num_threads() == 1 or not _gnu_openmp():
        return
    raise DistributedError(
        f"This process was forked by accelerate's notebook_launcher, and trains with {torch.get_num_threads()} "
        f"torch threads; GNU OpenMP (torch's) is not fork-safe: if the notebook ran any multi-threaded torch op "
        f"before launching, the forked processes hang at their first step. `import trainers` in the notebook before "
        f"calling notebook_launcher (the trainers then release OpenMP's threads just before the fork), or call "
        f"torch.set_num_threads(1) at the start of the launched function.")
