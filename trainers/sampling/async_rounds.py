"""Asynchronous generation (GRPOConfig.async_generation): GRPO's rounds sampled ahead of training.

    trainer thread (every process together)                 producer thread (one per process, its own rows)
    -----------------------------------------------         ---------------------------------------------------
    prepare_step(t): sync_weights(t) every                   waits for a fed round the engine's weights may
      weight_sync_steps (in flight: the engine pauses          sample: version // N >= first_step(r) // N - k
      the producers' requests between two tokens; else         samples it (the tool loop over it) through the
      between their rounds)
    feed(r): round r's rows, read in order          ---->      backend's producer(): its own client, no
    take(r): waits for them, checks the bound       <----      collectives; tags it with its oldest token's version
    the rest of the rollout stage (rewards, old log-probs, advantages) as in a synchronous round

(N: weight_sync_steps; k: max_staleness; a version is the optimizer step whose weights the engine holds.) With
in_flight_weight_updates (the backend's ``updates_in_flight``) the trainer pushes while the producers sample: a
round sampled across a push has tokens of two versions, each tagged by the backend (``Samples.versions``), and it
counts as its oldest token's; otherwise a push waits for the round in flight. In flight, the backend may return
from a push before the engine has loaded it (every request waits, paused, until it has: so no token is sampled
with half the new weights), and ``settle_weights``, after the optimizer step, waits for that. A
round is never generated staler than the bound: the producer waits instead, so nothing is generated to be thrown
away (and later tokens are only newer); ``take`` checks the bound again and refuses a round beyond it. With k = 0 every round is sampled with the weights of
the step that trains on it, by the same seeds: the synchronous run, exactly. The lag is corrected by the sampler's
log-probs (vllm_importance_sampling_correction, off_policy_mask_threshold), as for any sampler apart from the policy.

Never hangs: the producer's requests time out (request_timeout), a weight push times out (weight_sync_timeout),
and a trainer that waits for a round while the producer shows no progress for heartbeat_stale_after_s stops. A
failure is raised on every process together (``GenerationError``, or the server's ``VLLMServerError``) and the trainer
answers it with a checkpoint. Rounds fed but not trained on are discarded when the producer stops; a checkpoint
records the data position before the first of them (``ReadAhead``), so a resumed run generates them again.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from trainers.parallel import distributed as dist
from trainers.errors import GenerationError, VLLMServerError
from trainers.logs import logger
from trainers.sampling.rollout import Sampled, sample_rows

POLL_SECONDS = 0.5  # how often a waiting side looks at the clock (a stop, a stalled producer)


@dataclass(frozen=True)
class Work:
    """A round for the producer: this process's rows of it, and the first optimizer step that trains on it."""

    round_index: int
    first_step: int
    rows: list[dict]
    prompt_ids: list[list[int]]


class ReadAhead:
    """GRPO's prompt batches read ahead of training (``read``), handed to the trainer in order (``batch``). A
    checkpoint's data position (``state``) is the one before the first round read but not yet handed out: a
    resumed run reads those rounds again and the producer generates them anew."""

    def __init__(self, batches):
        self.inner = batches
        self._ahead: dict[int, tuple[Any, list]] = {}  # round -> (the position before it, its prompts)

    def read(self, round_index: int) -> list:
        before = self.inner.state()
        prompts = self.inner.batch(round_index)
        self._ahead[round_index] = (before, prompts)
        return prompts

    def batch(self, round_index: int) -> list:
        if round_index not in self._ahead:  # not read ahead (the synchronous path): read now
            self.read(round_index)
        return self._ahead.pop(round_index)[1]

    def state(self):
        return self._ahead[min(self._ahead)][0] if self._ahead else self.inner.state()

    def restore(self, state) -> None:
        self._ahead.clear()
        self.inner.restore(state)

    def rewind(self) -> None:
        """Forget the rounds read ahead: the next read is the first of them again."""
        if self._ahead:
            self.restore(self.state())

    def __getattr__(self, name: str):  # the rest of the batches' interface (validate, steps_per_epoch, ...)
        return getattr(self.inner, name)


class AsyncRounds:
    """The generation backend of an asynchronous run: the trainer's ``backend`` (weight pushes, evaluation's
    sampling) and a producer thread on this process over ``backend.producer()`` (module docstring). Built once the
    backend is; ``start`` begins a run's producer, ``close`` ends it (and the backend's lifetime). Every process
    calls ``sync_weights``, ``take``, ``settle_weights`` and ``step_metrics`` together, in the same order."""

    def __init__(self, backend, tool_loop_factory, tokenizer, eos_ids: set[int], sampling, accelerator, args):
        if not callable(getattr(backend, "producer", None)):
            raise GenerationError(f"async_generation=True: the generation backend {type(backend).__name__} cannot "
                                  f"sample ahead of training (it has no producer()); use use_vllm=True with "
                                  f"vllm_mode='server'.")
        self.backend, self.tool_loop_factory = backend, tool_loop_factory
        self.tokenizer, self.eos_ids, self.sampling = tokenizer, eos_ids, sampling
        self.accelerator, self.args = accelerator, args
        self.every, self.bound = args.weight_sync_steps, args.max_staleness
        self.in_flight = args.in_flight_weight_updates
        if self.in_flight and not getattr(backend, "updates_in_flight", False):
            raise GenerationError(f"async_generation with in_flight_weight_updates=True: the generation backend "
                                  f"{type(backend).__name__} cannot take new weights while its producer samples (it "
                                  f"has no updates_in_flight); set in_flight_weight_updates=False (each round on "
                                  f"one version).")
        self._cond = threading.Condition()
        self._generating = threading.Lock()  # held by the producer while it samples a round
        self._thread: threading.Thread | None = None
        self._reset()

    def _reset(self) -> None:
        self._work: collections.deque[Work] = collections.deque()
        self._done: dict[int, Sampled] = {}  # round index -> its rows, tagged with the version that sampled them
        self._fed: set[int] = set()  # rounds fed and not taken yet
        self._version: int | None = None  # the step whose weights the engine holds (None: not pushed this run)
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._progress = time.monotonic()  # the producer's heartbeat: its last round done, or its last wait
        self._waiting_rows = 0  # rows generated or in generation, not yet taken
        # since the last step_metrics: the trainer's wait for rounds, the producer's idle time, the weight syncs' time
        # and the part of it spent waiting for the producer to finish a round
        self._trainer_wait = self._producer_idle = self._sync_seconds = self._sync_wait = 0.0

    # ------------------------------------------------------------------ the backend interface (trainer thread)

    def sample(self, prompts: list, prompt_ids: list[list[int]], params):
        """Sampling in the trainer's thread (evaluation): the backend's own, with every process."""
        return self.backend.sample(prompts, prompt_ids, params)

    def sync_weights(self, step: int) -> None:
        """The engine gets the weights of optimizer step ``step``: with in_flight_weight_updates while the producers
        sample (``requests_in_flight``: the backend pauses every request, any process's, from the push's start
        until the new weights are in, so every token sampled from there on is of the new version; it may return
        before they are in, and ``settle_weights`` waits for them), else between their rounds (each process's
        producer finishes the round it is sampling first and stays between rounds until the push is done). All
        processes meet, the backend pushes, the producers go on with the new version."""
        if self._version == step:
            return
        started = time.monotonic()
        if self.in_flight:
            self.backend.sync_weights(step, requests_in_flight=True)
        else:
            self._push_between_rounds(step)
        with self._cond:
            self._version = step
            self._cond.notify_all()
        self._sync_seconds += time.monotonic() - started

    def _push_between_rounds(self, step: int) -> None:
        """in_flight_weight_updates=False: wait for this process's producer to finish its round, meet, push."""
        timeout = self.args.request_timeout + self.args.weight_sync_timeout
        started = time.monotonic()
        paused = self._generating.acquire(timeout=timeout)
        self._sync_wait += time.monotonic() - started
        error = None if paused else GenerationError(
            f"async_generation: the producer did not finish its round within {timeout} s (request_timeout + "
            f"weight_sync_timeout), so the weights of step {step} could not be pushed.")
        try:
            dist.raise_together(self.accelerator, error, shared=(GenerationError,))
            self.accelerator.wait_for_everyone()  # no process's producer is sampling now
            self.backend.sync_weights(step)
        finally:
            if paused:
                self._generating.release()

    def settle_weights(self) -> None:
        """After each optimizer step, every process together: the last push done (in flight, the servers finish it
        while the trainer goes on: the backend's ``settle_weights``), its failure raised here on every process
        together; the wait counts in perf/weight_sync_s."""
        settle = getattr(self.backend, "settle_weights", None)
        if settle is not None:
            started = time.monotonic()
            settle()
            self._sync_seconds += time.monotonic() - started

    def due(self, step: int) -> bool:
        """Whether optimizer step ``step`` pushes the policy's weights (every weight_sync_steps, and a run's first)."""
        return self._version is None or step % self.every == 0

    def close(self) -> None:
        """Stop the producer (a round in flight is abandoned) and end the backend's lifetime. Idempotent."""
        self._stop_producer()
        self.backend.close()

    # ------------------------------------------------------------------ the pipeline (trainer thread)

    def start(self) -> None:
        """A run's producer thread, over a fresh producer sampler (rounds fed from here on)."""
        self._stop_producer()
        self._reset()
        sampler, tool_loop = self.backend.producer(), self.tool_loop_factory()
        self._thread = threading.Thread(target=self._produce, args=(sampler, tool_loop, self._stop),
                                        name="grpo-async-producer", daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread is not None

    def horizon(self, step: int) -> int:
        """The last optimizer step whose rounds may be fed at step ``step``: those the next weight sync lets the
        producer sample."""
        return (step // self.every + 1 + self.bound) * self.every - 1

    def feed(self, work: Work) -> None:
        with self._cond:
            self._fed.add(work.round_index)
            self._work.append(work)
            self._cond.notify_all()

    def take(self, round_index: int, first_step: int) -> tuple[Sampled, dict[str, float]]:
        """Round ``round_index``'s rows on this process, once the producer has them, and its staleness metrics
        (over every process). Raises the producer's error (on every process together), a push's that failed as
        it finished in the background (the backend's ``failed_push``: the round may never come, as the engine
        stays paused), or GenerationError when the producer shows no progress for heartbeat_stale_after_s."""
        started, error, sampled = time.monotonic(), None, None
        stale_after = self.args.heartbeat_stale_after_s
        failed_push = getattr(self.backend, "failed_push", None)  # a push finishing in the background that failed
        with self._cond:
            if round_index not in self._done and round_index not in self._fed:
                raise RuntimeError(f"AsyncRounds.take({round_index}): that round was never fed to the producer.")
            while round_index not in self._done and self._error is None:
                if failed_push is not None and (failure := failed_push()) is not None:
                    self._error = failure  # the engine stays paused: the round will not come
                    break
                quiet = time.monotonic() - self._progress
                if quiet > stale_after:
                    self._error = GenerationError(
                        f"async_generation: round {round_index} (for optimizer step {first_step}) is not ready and "
                        f"the producer has shown no progress for {quiet:.0f} s (heartbeat_stale_after_s="
                        f"{stale_after:g}); the engine holds the weights of step {self._version}.")
                    break
                self._cond.wait(timeout=POLL_SECONDS)
            # a round that is ready is trained on, whatever a later round met (the producer may have run ahead
            # and failed on the next one already): the error stops the run at the round it concerns
            error = self._error if round_index not in self._done else None
            if error is None:
                sampled = self._done.pop(round_index)
                self._fed.discard(round_index)
                self._waiting_rows -= len(sampled.samples.completion_ids)
            waiting = self._waiting_rows
        self._trainer_wait += time.monotonic() - started
        dist.raise_together(self.accelerator, error, shared=(GenerationError, VLLMServerError))
        staleness = first_step // self.every - sampled.version // self.every  # its oldest token's
        versions = sampled.samples.versions or []
        mixed = sum(len({v for v in row if v is not None}) > 1 for row in versions)  # sampled across a push
        acc = self.accelerator
        total = dist.all_reduce_sum(acc, torch.tensor([float(staleness), float(waiting), float(mixed),
                                                       float(len(sampled.samples.completion_ids))], device=acc.device))
        peak = dist.all_reduce_max(acc, torch.tensor([float(staleness)], device=acc.device)).item()
        if peak > self.bound:  # the producer's gate makes this impossible: a bug, never trained on silently
            raise GenerationError(f"async_generation: round {round_index} was sampled {peak:g} weight syncs before "
                                  f"step {first_step}, beyond max_staleness={self.bound}.")
        staleness_sum, waiting_sum, mixed_sum, rows = total.tolist()
        return sampled, {"sample/staleness_mean": staleness_sum / acc.num_processes,
                         "sample/staleness_max": peak, "sample/rollout_queue_size": waiting_sum,
                         "sample/updated_in_flight": mixed_sum / rows if rows else 0.0}

    def step_metrics(self) -> dict[str, float]:
        """Since the last call, the most over processes: the trainer's wait for rounds (perf/rollout_wait_s), the
        producer's idle time (rollout/backpressure_s: waiting for weights, room or work), the weight syncs' time
        (perf/weight_sync_s) and the part of it spent waiting for a producer to finish its round
        (perf/weight_sync_wait_s)."""
        with self._cond:
            values = [self._trainer_wait, self._producer_idle, self._sync_seconds, self._sync_wait]
            self._trainer_wait = self._producer_idle = self._sync_seconds = self._sync_wait = 0.0
        acc = self.accelerator
        peak = dist.all_reduce_max(acc, torch.tensor(values, dtype=torch.float64, device=acc.device)).tolist()
        return dict(zip(("perf/rollout_wait_s", "rollout/backpressure_s", "perf/weight_sync_s",
                         "perf/weight_sync_wait_s"), peak))

    def _stop_producer(self) -> None:
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
            abandoned = len(self._work) + len(self._done)
        thread.join(timeout=self.args.request_timeout)
        if thread.is_alive():  # stuck in a request to a server that does not answer: it dies with the process
            logger.warning("async_generation: the producer thread is still in a request; it is left behind.")
        if abandoned and self.accelerator.is_main_process:
            logger.info(f"async_generation: {abandoned} round(s) generated ahead were not trained on; a resumed run "
                        f"generates them again.")

    # ------------------------------------------------------------------ the producer (its own thread)

    def _eligible(self) -> Work | None:
        """The next fed round, if the engine's weights may sample it and there is room for it (under _cond)."""
        if not self._work or self._version is None:
            return None
        work = self._work[0]
        if self._version // self.every < work.first_step // self.every - self.bound:
            return None  # too stale: wait for a newer version
        if self._waiting_rows and self._waiting_rows + len(work.rows) > self.args.queue_maxsize:
            return None  # no room until the trainer takes a round
        return work

    def _produce(self, sampler, tool_loop, stop: threading.Event) -> None:
        local, work = dist.ThisProcess(self.accelerator), None
        try:
            while not stop.is_set():
                idle = time.monotonic()
                with self._cond:
                    while not stop.is_set() and (work := self._eligible()) is None:
                        self._progress = time.monotonic()  # alive: waiting for weights, room or work
                        self._cond.wait(timeout=POLL_SECONDS)
                    if stop.is_set():
                        return
                    self._work.popleft()
                    self._waiting_rows += len(work.rows)
                    self._producer_idle += time.monotonic() - idle
                with self._generating:
                    with self._cond:
                        version = self._version  # newer than when it was eligible, perhaps: still within the bound
                    if hasattr(sampler, "seed_position"):  # seeds by the step the round is for, as a synchronous run
                        sampler.seed_position(work.first_step)
                    sampled = sample_rows(sampler, tool_loop, self.tokenizer, work.rows, work.prompt_ids,
                                          self.sampling, self.eos_ids, local)
                with self._cond:  # in flight, tokens may be newer than the round's start: the oldest one counts
                    self._done[work.round_index] = replace(sampled, version=oldest(sampled, version))
                    self._progress = time.monotonic()
                    self._cond.notify_all()
        except BaseException as caught:  # the trainer raises it on every process, with a checkpoint
            error = caught
            if not isinstance(caught, (GenerationError, VLLMServerError)):
                where = f"round {work.round_index}" if work is not None else "its first round"
                logger.error(f"async_generation: the producer failed sampling {where}", exc_info=caught)
                error = GenerationError(f"async_generation: the producer failed sampling {where}: "
                                        f"{type(caught).__name__}: {caught}")
                error.__cause__ = caught
            with self._cond:
                self._error = error
                self._cond.notify_all()
        finally:
            sampler.close()
            if tool_loop is not None:
                tool_loop.close()


def oldest(sampled: Sampled, started_with: int | None) -> int | None:
    """The version of a round's oldest token, as the backend tagged them (in-flight weight updates), else the
    version it started with (no token is older)."""
    tagged = [v for row in sampled.samples.versions or [] for v in row if v is not None]
    return min(tagged) if tagged else started_with
