"""A generation backend apart from the policy, for asynchronous GRPO's tests without a vLLM server: a copy of the
policy's weights (updated only by ``sync_weights``) that samples with seeded generators and returns its log-probs,
as vLLM does. Registered as ``copy_engine``; ``producer()`` samples one process's rows alone, sharing the copy.
Weights may arrive while a producer samples (``updates_in_flight``, as the vLLM server's pause between decode
steps): one lock keeps a token's forward and a weight load apart, and each token records the version it was
sampled with (``Samples.versions``).

``CopyEngine.fail_at`` / ``stall_at`` (class attributes, for one test at a time): the producer's sampler raises, or
sleeps for an hour, on its n-th round (counted from 1 per producer). ``finish_fails_at``: the in-flight push of
that step fails as it finishes, as a server whose load fails (the push returns, the engine stays paused: no
producer samples again, ``failed_push`` and ``settle_weights`` give the error). ``CopyEngine.pushes`` records
the steps of every weight push, and ``CopyEngine.versions`` the (first step, weights step) of every round a
producer sampled."""

from __future__ import annotations

import copy
import hashlib
import threading
import time

import torch

from trainers.errors import VLLMServerError
from trainers.parallel import distributed as dist
from trainers.generation.backend import register_backend
from trainers.generation.sampling import Samples, ended


class CopyEngine:
    fail_at: int | None = None
    finish_fails_at: int | None = None
    stall_at: int | None = None
    pushes: list[int] = []
    pushed_in_flight: list[int] = []  # the steps whose push said producers may be sampling (requests_in_flight)
    versions: list[tuple[int, int]] = []

    updates_in_flight = True

    def __init__(self, inputs, engine: torch.nn.Module | None = None, accelerator=None, producing: bool = False,
                 lock: threading.Lock | None = None):
        self.inputs, self.config = inputs, inputs.config
        self.accelerator = accelerator or inputs.context.accelerator
        self.engine = engine if engine is not None else copy.deepcopy(inputs.policy).eval().requires_grad_(False)
        self.lock = lock or threading.Lock()  # a token's forward, or a weight load: never both
        self.producing, self.rounds = producing, 0
        self._step, self._calls, self._weights = 0, 0, 0
        self._failed: VLLMServerError | None = None  # a push that failed as it finished, not yet handed out
        self._paused = False  # holding the lock since such a push (close releases it)

    def seed_position(self, step: int) -> None:
        if step != self._step:
            self._step, self._calls = step, 0
        if self.producing:  # a producer's new round
            self.rounds += 1
            CopyEngine.versions.append((step, CopyEngine._held))
            if self.rounds == CopyEngine.fail_at:
                raise RuntimeError(f"copy_engine: failing on round {self.rounds}, as the test asked")
            if self.rounds == CopyEngine.stall_at:
                time.sleep(3600)

    def sync_weights(self, step: int | None = None, requests_in_flight: bool = False) -> None:
        if requests_in_flight:
            CopyEngine.pushed_in_flight.append(step)
        if step is not None:
            self.seed_position(step)
        with self.lock:
            self.engine.load_state_dict(self.inputs.policy.state_dict())
            CopyEngine._held = step
        CopyEngine.pushes.append(step)
        if requests_in_flight and step == CopyEngine.finish_fails_at:
            self.lock.acquire()  # paused for good, as a server whose load failed
            self._paused = True
            self._failed = VLLMServerError(f"copy_engine: the push of step {step} failed as it finished, as the "
                                           f"test asked")

    def failed_push(self) -> VLLMServerError | None:
        error, self._failed = self._failed, None
        return error

    def settle_weights(self) -> None:
        dist.raise_together(self.accelerator, self.failed_push(), shared=(VLLMServerError,))

    @torch.no_grad()
    def sample(self, prompts: list, prompt_ids: list[list[int]], params) -> Samples:
        self._calls += 1
        where = f"{self.config.seed}/{self._step}/{self._calls}/{self.accelerator.process_index}"
        base = int.from_bytes(hashlib.sha256(where.encode()).digest()[:4], "big")
        eos = set(self.inputs.context.eos_ids)
        completions, logprobs, versions = [], [], []
        for row, ids in enumerate(prompt_ids):
            generator = torch.Generator().manual_seed(base + row)
            tokens, values, held = [], [], []
            for _ in range(params.max_new_tokens):
                with self.lock:
                    logits = self.engine(torch.tensor([ids + tokens])).logits[0, -1].float() / params.temperature
                    held.append(CopyEngine._held)
                logp = torch.log_softmax(logits, -1)
                token = int(torch.multinomial(logp.exp(), 1, generator=generator))
                tokens.append(token)
                values.append(float(logp[token]))
                if token in eos:
                    break
            completions.append(tokens)
            logprobs.append(values)
            versions.append(held)
        return Samples(prompt_ids, completions, logprobs, finished=[ended(c, eos) for c in completions],
                       versions=versions)

    def producer(self) -> CopyEngine:
        return CopyEngine(self.inputs, self.engine, dist.ThisProcess(self.accelerator), producing=True,
                          lock=self.lock)

    def close(self) -> None:
        if self._paused:  # the failed push's pause: the producer may end
            self._paused = False
            self.lock.release()


CopyEngine._held = None
register_backend("copy_engine", CopyEngine)


class WholeRoundsEngine(CopyEngine):
    """A backend that cannot take weights while it samples (in_flight_weight_updates=False only)."""

    updates_in_flight = False


register_backend("copy_engine_whole_rounds", WholeRoundsEngine)
