"""Running every tool call of a round at once (``ToolRunner``): sync tools on worker threads, async tools on one
event loop, each call with a timeout, failures and timeouts returned as results (TRL runs one rollout after
another). The same runner calls environments' ``reset`` (``map``). ``EventLoopThread`` is the one event loop thread
kind: the runner's async tools run on one, GRPO's async reward functions on another."""

from __future__ import annotations

import asyncio
import functools
import inspect
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from trainers.agents.parsing import ToolCall
from trainers.errors import ConfigError


@dataclass(frozen=True)
class ToolResult:
    """What a call returned, as the tool message's content: ``str(result)`` (as TRL), or for a failure
    ``str({"error": "<short text naming the function>"})``."""
    name: str
    content: str
    failed: bool
    timed_out: bool = False


def _failure(name: str, text: str, timed_out: bool = False) -> ToolResult:
    return ToolResult(name, str({"error": text}), failed=True, timed_out=timed_out)


def _short(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def _call_error(call: ToolCall, tools: Mapping[str, Callable]) -> str | None:
    """Why ``call`` cannot be made (unknown tool, arguments that do not fit the signature), or None."""
    fn = tools.get(call.name)
    if fn is None:
        return f"unknown tool {call.name!r} (tools: {', '.join(tools)})"
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to check (some builtins): the call itself will tell
        return None
    try:
        signature.bind(**call.arguments)
    except TypeError as error:
        return f"{getattr(fn, '__name__', call.name)}: {error}"
    return None


class EventLoopThread:
    """An event loop on a daemon thread, started on first use: where async tools and async reward functions run
    (TRL runs async reward functions on such a loop). It outlives each call, so clients an async function keeps
    open stay usable, and it works where the calling thread already runs a loop (Jupyter: ``asyncio.run``
    refuses there)."""

    def __init__(self, name: str):
        self.name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, coroutine) -> Future:
        """Schedule ``coroutine`` on the loop; its concurrent.futures.Future."""
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                self._thread = threading.Thread(target=self._loop.run_forever, name=self.name, daemon=True)
                self._thread.start()
            return asyncio.run_coroutine_threadsafe(coroutine, self._loop)

    def run(self, awaitables: list) -> list:
        """Await all concurrently; their results or the exceptions they raised, in order."""
        async def together():
            return await asyncio.gather(*awaitables, return_exceptions=True)

        return self.submit(together()).result()

    def close(self) -> None:
        """Cancel what still runs on the loop, stop it and join its thread (idempotent; a later submit starts a
        new loop)."""
        with self._lock:
            loop, thread, self._loop, self._thread = self._loop, self._thread, None, None
        if loop is not None:
            asyncio.run_coroutine_threadsafe(_cancel_all(), loop).result()
            loop.call_soon_threadsafe(loop.stop)
            thread.join()
            loop.close()


@dataclass
class _Job:
    """One call in flight. Its timeout counts from ``started`` (a call waiting for a free worker does not spend
    its time waiting); ``abandoned``: it timed out, and its worker thread left the pool."""
    is_async: bool
    future: Future | None = None
    started: float | None = None
    worker: threading.Thread | None = None
    abandoned: bool = False


class ToolRunner:
    """Runs every tool call of a round at once: async tools on one event loop (a daemon thread, started lazily),
    sync tools on ``workers`` daemon threads (started lazily); each call limited to ``timeout`` seconds from its
    start (None: no limit).

    Python cannot stop a thread: a sync tool that runs past its timeout gets the timed-out result, the round goes
    on, and the call keeps running on its thread until it returns. That thread leaves the pool (another takes its
    place, so later rounds keep ``workers`` threads) and ends when the call returns; being a daemon thread, it does
    not keep the process alive. A timed-out async call is cancelled. An async tool that blocks (``time.sleep``
    instead of ``await asyncio.sleep``) stalls every async call: make such a tool sync.
    """

    def __init__(self, workers: int, timeout: float | None):
        if type(workers) is not int or workers < 1:
            raise ConfigError(f"ToolRunner: workers (tool_workers) must be a positive integer, got {workers!r}")
        if timeout is not None and (type(timeout) not in (int, float) or not timeout > 0):
            raise ConfigError(f"ToolRunner: timeout (tool_timeout) must be positive seconds or None, got {timeout!r}")
        self.workers, self.timeout = workers, timeout
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []  # the pool's threads (not those left with a hung call)
        self._loop = EventLoopThread("tool-loop")  # async tools
        self._lock = threading.Lock()  # the pool, the loop, and a job's hand-over when it times out
        self._changed = threading.Condition()  # notified whenever a job starts or finishes
        self._closed = False

    def _start_worker(self) -> None:
        thread = threading.Thread(target=self._work, name="tool-worker", daemon=True)
        thread.start()
        self._threads.append(thread)

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            job, fn = item
            job.worker, job.started = threading.current_thread(), time.monotonic()
            self._notify()
            try:
                job.future.set_result(fn())
            except BaseException as error:  # noqa: BLE001 - handed to the caller with the result
                job.future.set_exception(error)
            with self._lock:
                if job.abandoned:  # it timed out and another thread took this one's place
                    return

    def _notify(self, *_) -> None:
        with self._changed:
            self._changed.notify_all()

    def _submit(self, fn: Callable[[], Any]) -> _Job:
        """Start ``fn()`` on the loop (async) or queue it for a worker (sync)."""
        job = _Job(inspect.iscoroutinefunction(fn))  # async def functions, methods, partials
        with self._lock:
            if self._closed:
                raise RuntimeError("ToolRunner is closed")
            if job.is_async:
                async def call():
                    return await fn()

                job.started = time.monotonic()
                job.future = self._loop.submit(call())
            else:
                while len(self._threads) < self.workers:
                    self._start_worker()
                job.future = Future()
                self._queue.put((job, fn))
        job.future.add_done_callback(self._notify)
        return job

    def _wait(self, jobs: list[_Job], timeout: float | None) -> None:
        """Block until every job has finished or run ``timeout`` seconds since it started."""
        with self._changed:
            while True:
                now = time.monotonic()
                waiting = [job for job in jobs if not job.future.done()
                           and (timeout is None or job.started is None or now < job.started + timeout)]
                if not waiting:
                    return
                deadlines = [job.started + timeout for job in waiting if timeout is not None and job.started]
                self._changed.wait(min(deadlines) - now if deadlines else None)

    def _settle(self, job: _Job) -> bool:
        """True when the job finished; else give it up: cancel it (async) or replace its thread (sync)."""
        with self._lock:
            if job.future.done():
                return True
            job.abandoned = True
            if job.is_async:
                job.future.cancel()
            elif not self._closed:
                self._threads.remove(job.worker)
                self._start_worker()
            return False

    def run_calls(self, calls: list[Sequence[ToolCall]],
                  toolboxes: list[Mapping[str, Callable]]) -> list[list[ToolResult]]:
        """``calls[i]``: rollout i's calls of this turn; ``toolboxes[i]``: its tools by name. All calls of all
        rollouts run concurrently; the results come back in call order. Never raises for a tool's failure."""
        if len(calls) != len(toolboxes):
            raise ValueError(f"run_calls: {len(calls)} rollouts of calls but {len(toolboxes)} toolboxes")
        results: list[list[ToolResult | None]] = [[None] * len(rollout) for rollout in calls]
        pending = []
        for i, (rollout, tools) in enumerate(zip(calls, toolboxes)):
            for j, call in enumerate(rollout):
                error = _call_error(call, tools)
                if error is not None:
                    results[i][j] = _failure(call.name, error)
                else:
                    fn = tools[call.name]
                    pending.append((i, j, call, fn, self._submit(functools.partial(fn, **call.arguments))))
        self._wait([job for *_, job in pending], self.timeout)
        for i, j, call, fn, job in pending:
            results[i][j] = self._result(call, getattr(fn, "__name__", call.name), job)
        return results

    def _result(self, call: ToolCall, name: str, job: _Job) -> ToolResult:
        if not self._settle(job):
            return _failure(call.name, f"{name} timed out after {self.timeout:g} s", timed_out=True)
        error = job.future.exception()
        if error is None:
            return ToolResult(call.name, str(job.future.result()), failed=False)
        if not isinstance(error, Exception):  # SystemExit, KeyboardInterrupt: not the tool's answer
            raise error
        return _failure(call.name, f"{name} raised {type(error).__name__}: {_short(str(error))}")

    def map(self, functions: list[Callable[[], Any]]) -> list[Any]:
        """Run zero-argument callables (sync, or async ones such as ``functools.partial(async_fn, ...)``)
        concurrently, without a timeout; their results in order. The first exception (in order) is re-raised
        after all have finished: used for ``reset`` and ``get_reward``, whose failure is the user's bug."""
        jobs = [self._submit(fn) for fn in functions]
        self._wait(jobs, None)
        for job in jobs:
            if job.future.exception() is not None:
                raise job.future.exception()
        return [job.future.result() for job in jobs]

    def close(self) -> None:
        """Stop the worker threads and the event loop (idempotent). Calls still running are waited for, except
        those already given up after their timeout."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            threads = list(self._threads)
        for _ in threads:
            self._queue.put(None)
        for thread in threads:
            thread.join()
        self._loop.close()


async def _cancel_all() -> None:
    """Cancel the loop's other tasks (timed-out calls still unwinding) and let them finish."""
    tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
