"""vLLM as a server (``vllm_mode="server"``): the backend over the clients of one or several `trainers vllm-serve`
servers (generation/vllm_client.py; the server: generation/vllm_server.py; several as one pool:
generation/vllm_servers.py). The main process sends every process's prompts, spread over the servers, and the
policy's weights to all of them after each optimizer step that precedes a round; the other processes take part in
the weight gathers (ZeRO-3) and get their rows back. A server that fails mid-run is taken out while the others
serve; when none is left, ``VLLMServerError`` is raised on every process, together: the trainer answers it with a
checkpoint.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, wait

import torch

from trainers.parallel import distributed as dist
from trainers.errors import ConfigError, VLLMServerError
from trainers.generation.backend import BackendInputs
from trainers.generation.sampling import Samples
from trainers.generation.vllm_common import WEIGHT_BATCH_BYTES, VLLMBackend
from trainers.generation.vllm_lora import AdapterFolders, is_peft, lora_sync_choice
from trainers.generation.vllm_servers import ServerPool
from trainers.generation.weight_wire import in_thread
from trainers.logs import logger


MAX_CONCURRENT_REQUESTS = 16  # a round's requests in flight at once (vLLM batches them together)
PROBE_TIMEOUT_S = 5.0  # a server that failed, asked again at a weight push: the most its checks may wait


def seeded_requests(prompt_ids: list[list[int]], seeds: list[int]) -> list[tuple[list[list[int]], int, int]]:
    """The requests for ``prompt_ids`` (rows, in order), as (prompts, n, seed): one per run of rows with the same
    prompt and consecutive seeds, for n completions of that prompt from its first seed. Their completions, in
    request order, are the rows in order."""
    requests: list[tuple[list[list[int]], int, int]] = []
    for ids, seed in zip(prompt_ids, seeds):
        if requests and requests[-1][0][0] == ids and requests[-1][2] + requests[-1][1] == seed:
            requests[-1] = (requests[-1][0], requests[-1][1] + 1, requests[-1][2])
        else:
            requests.append(([ids], 1, seed))
    return requests


def server_urls(config) -> list[str]:
    """The servers' URLs: vllm_server_base_url (one, a list, or several separated by commas), else
    vllm_server_host and vllm_server_port."""
    given = config.vllm_server_base_url
    if given is None:
        return [f"http://{config.vllm_server_host}:{config.vllm_server_port}"]
    parts = given.split(",") if isinstance(given, str) else list(given)
    return [part.strip() for part in parts if part.strip()]


def request_completions(pool: ServerPool, prompt_ids: list[list[int]], seeds: list[int], kwargs: dict, regex: str | None,
                        max_requests: int = MAX_CONCURRENT_REQUESTS, versions: bool = False
                        ) -> tuple[list[list[int]], list[list[float]], list[list[int | None]] | None]:
    """The completions of ``prompt_ids`` (row i with seed ``seeds[i]``, vllm.SamplingParams ``kwargs``), their
    log-probs (NaN where the server gave none) and, with ``versions``, each token's weight version (sampled by the
    token route, which tags them; else None), from the servers of ``pool``: a run of rows with one prompt and
    consecutive seeds (a group's completions) is one request for n completions with the first seed (vLLM seeds the
    n with s, s + 1, ...); the requests are sent together, at most ``max_requests`` in flight, each to the server
    with the fewest in flight (another if that one fails)."""
    options = {k: v for k, v in kwargs.items() if k in ("n", "repetition_penalty", "temperature", "top_p", "top_k",
                                                        "min_p", "max_tokens", "logprobs")}
    extra = {k: v for k, v in kwargs.items() if k not in options}
    requests = seeded_requests(prompt_ids, seeds)

    def send(request: tuple[list[list[int]], int, int]) -> dict:
        prompts, n, seed = request
        if versions:  # one prompt a request on the token route
            params = {**options, **extra} | ({} if regex is None else {"structured_outputs": {"regex": regex}})
            return pool.request(lambda client: client.generate_tokens(prompts[0], n=n, seed=seed,
                                                                      sampling_params=params))
        return pool.request(lambda client: client.generate(
            prompts=prompts, **{**options, "n": n}, structured_outputs_regex=regex,
            generation_kwargs={**extra, "seed": seed}))

    with ThreadPoolExecutor(max_workers=max(1, min(len(requests), max_requests))) as threads:
        outs = list(threads.map(send, requests))
    completions, logprobs = [], []  # the rows in order: the requests' completions in order
    for out in outs:
        completions += out["completion_ids"]
        given = out["logprobs"] or [None] * len(out["completion_ids"])  # None: the server gave none
        logprobs += [[math.nan] * len(ids) if row is None else [math.nan if top[0] is None else top[0] for top in row]
                     for ids, row in zip(out["completion_ids"], given)]
    return completions, logprobs, [row for out in outs for row in out["versions"]] if versions else None


class VLLMRemote(VLLMBackend):
    """`trainers vllm-serve` servers: ``.pool`` on the main process, and ``.vllm_client`` (TRL's
    ``trainer.vllm_generation.vllm_client``) the client of the first server in service. Built on every process,
    together: each client is checked against the served model and the policy's weights are sent before training."""

    def __init__(self, inputs: BackendInputs):
        super().__init__(inputs)
        self.llm = None  # TRL's attribute: a colocated engine, None here
        self.pool: ServerPool | None = None  # on the main process
        self.urls = server_urls(self.config)
        self._producer_pools: list[ServerPool] = []  # this process's asynchronous producers' (producer())
        self._version: int | None = None  # the optimizer step whose weights the push under way sends
        self._closed = False  # on every process: close() ran, the next sync connects again
        self._requests_in_flight = False  # the push under way: asynchronous GRPO's producers may be sampling
        # a push whose servers finish in the background (requests_in_flight), until settle_weights: on every
        # process; the finishing itself on the main process
        self._unsettled, self._finishing = False, None
        self._view: dict | None = None  # the servers as the last push left them (ServerPool.view), on every process
        self._connect()
        self._choose_lora_sync()
        self.sync_weights(0)  # the policy's weights before the first optimizer step
        self.context.accelerator.wait_for_everyone()

    def _connect(self) -> None:
        """The client, on the main process, checked against the served model. Every process calls it."""
        acc, error = self.context.accelerator, None
        if acc.is_main_process:
            try:
                self.pool = ServerPool(self.urls, self._new_client)
            except Exception as caught:
                error = caught
        dist.raise_together(acc, error)

    def _choose_lora_sync(self) -> None:
        """With a LoRA policy and servers that serve adapters, syncs send the adapter alone (vllm_lora_sync:
        generation/vllm_lora.py), saved under output_dir/.vllm_lora, which the servers must be able to read (this
        machine, or a shared filesystem). Every process calls it."""
        acc, config, choice, error = self.context.accelerator, self.config, None, None
        if acc.is_main_process:
            try:
                wanted = is_peft(self.inputs.policy) and config.vllm_lora_sync != "merged"
                choice = lora_sync_choice(config.vllm_lora_sync, self.inputs.policy,
                                          self.pool.lora_configs() if wanted else None)
            except Exception as caught:
                error = caught
        dist.raise_together(acc, error, shared=(ConfigError, VLLMServerError))
        if dist.broadcast_object(acc, choice):
            # requests in flight may name any adapter within the staleness bound: its files stay that long
            keep = config.max_staleness + 2 if config.async_generation else 2
            self.adapters = AdapterFolders(os.path.join(config.output_dir, ".vllm_lora"), keep)

    @property
    def vllm_client(self):
        """TRL's ``trainer.vllm_generation.vllm_client`` (for a rollout_func that calls the server itself): the
        client of the first server in service, on the main process; None elsewhere and once closed."""
        if self.pool is None:
            return None
        ready = self.pool.in_service()
        return ready[0].client if ready else None

    def _new_client(self, url: str, wait: bool = True):
        """A client of the server at ``url``, checked against the trainer's model; ``wait=False``: asked once
        (a server that failed, asked again at a weight sync)."""
        from trainers.generation.vllm_client import VLLMClient

        args = self.config
        # asked once, a server answers within seconds or is still down (a frozen one would hold the push for
        # request_timeout): the checks wait PROBE_TIMEOUT_S at most, then the client waits as configured
        checks = args.request_timeout if wait else min(PROBE_TIMEOUT_S, args.request_timeout or PROBE_TIMEOUT_S)
        client = VLLMClient(base_url=url, group_port=args.vllm_group_port,
                            connection_timeout=args.vllm_server_timeout if wait else 0.0,
                            transfer_timeout=args.weight_sync_timeout, request_timeout=checks,
                            api_key=args.vllm_server_api_key)
        client.check_server(self._model_name())
        client.request_timeout = args.request_timeout
        return client

    def producer(self) -> ServerSampler:
        """A sampler for this process alone, for GRPO's asynchronous producer thread (trainers/sampling/async_rounds.py):
        its own clients, its own rows, no collectives, no weights (this backend pushes them, and tells its pool
        which servers hold them after each push)."""
        inputs = dataclasses.replace(self.inputs, context=dataclasses.replace(
            self.context, accelerator=dist.ThisProcess(self.context.accelerator)))
        pool = ServerPool(self.urls, self._new_client, self.pool.outages if self.pool is not None else None)
        if self._view is not None:  # the weights (the adapter) the servers hold now
            pool.adopt(self._view)
        self._producer_pools.append(pool)
        return ServerSampler(inputs, pool)

    updates_in_flight = True  # a push may land while asynchronous GRPO's producers sample (the server pauses them)

    def sync_weights(self, step: int | None = None, requests_in_flight: bool = False) -> None:
        """The servers' weights := the policy's after ``step``. ``requests_in_flight`` (asynchronous GRPO, in
        flight): the producers may be sampling, so each server pauses its requests for the update (as vLLM's
        ``/pause?mode=keep``) and resumes them with the new weights; and this returns once the tensors have left,
        while the servers load them, finish and resume (``settle_weights`` waits for that; the next push, or
        sampling here, does first). The pause holds every request, any process's, until the new weights are in."""
        self.settle_weights()
        if self._closed:  # closed at the end of a train() call, used again (evaluate, a rollout function)
            self._connect()
            self._closed, self._synced_step = False, None
        self._version, self._requests_in_flight = step, requests_in_flight
        super().sync_weights(step)

    def _push_weights(self, batches: Iterator[list[tuple[str, torch.Tensor]]]) -> None:
        """The main process sends the weights to every server together, in requests of about WEIGHT_BATCH_BYTES;
        the others take part in the gathers. Then every process's asynchronous producers learn which servers hold
        them: at once, or, in flight, when the push is settled (the servers finish it in a thread meanwhile)."""
        error, later = None, self._requests_in_flight
        if self.pool is None:
            for _ in batches:
                pass
        else:
            pool = self.pool
            try:
                push = pool.send_push(chunked(batches), self._version, pause=self._requests_in_flight)
                if later:  # the trainer goes on while the servers load (the pause holds their requests)
                    self._finishing = in_thread(lambda: pool.finish_push(push))
                else:
                    pool.finish_push(push)
            except Exception as caught:
                error = caught
                for _ in batches:  # the other processes are still gathering
                    pass
        if later:  # on every process: a failed send raised now, the finish's outcome at settle_weights
            dist.raise_together(self.context.accelerator, error, shared=(VLLMServerError,))
            self._unsettled = True
            return
        self._after_push(error)

    def failed_push(self) -> Exception | None:
        """The failure of the unsettled push, once its finishing failed (on the main process; None elsewhere and
        otherwise), handed out once: a server whose load failed stays paused, so a trainer waiting for a round
        learns why here instead of at its heartbeat."""
        finishing = self._finishing
        if finishing is None or not finishing.done() or finishing.exception() is None:
            return None
        self._finishing = None
        return finishing.exception()

    def settle_weights(self) -> None:
        """The push whose servers finish in the background (``sync_weights(requests_in_flight=True)``), done: its
        error raised on every process together, every process's asynchronous producers told which servers hold
        the new weights. Nothing when no push is unsettled. Every process calls it together."""
        if not self._unsettled:
            return
        self._unsettled = False
        finishing, self._finishing, error = self._finishing, None, None
        if finishing is not None:
            wait([finishing])
            error = finishing.exception()
        self._after_push(error)

    def _push_adapter(self, step: int | None) -> None:
        """The policy's adapter after ``step``, saved by the main process (every process takes part in the
        gathers), loaded by every server; the requests from then on name it (those in flight keep theirs, so no
        pause is needed). Then every process's asynchronous producers learn which servers hold it."""
        acc, error = self.context.accelerator, None
        adapter = self.adapters.save(acc, self.inputs.policy, step, write=acc.is_main_process)
        if self.pool is not None:
            try:
                self.pool.push_adapter(adapter, keep=2)
            except Exception as caught:
                error = caught
        self._after_push(error)

    def _after_push(self, error: Exception | None) -> None:
        """Every process raises the push's VLLMServerError (the trainer answers it with a checkpoint, written
        together); otherwise every process's asynchronous producers adopt the main process's view of the servers."""
        acc = self.context.accelerator
        dist.raise_together(acc, error, shared=(VLLMServerError,))
        self._view = dist.broadcast_object(acc, self.pool.view() if acc.is_main_process else None)
        for pool in self._producer_pools:
            pool.adopt(self._view)

    def step_metrics(self) -> dict[str, float]:
        """With several servers, what the main process's pools report (servers in service, failovers, each one's
        share of the completions, its asynchronous producer's included), the same on every process; nothing with
        one. Every process calls it together."""
        if len(self.urls) < 2:
            return {}
        mine = self.pool.metrics(self._producer_pools) if self.pool is not None else {}
        return dist.broadcast_object(self.context.accelerator, mine)

    def _generate(self, prompt_ids: list[list[int]], kwargs: dict, seeds: list[int]) -> tuple[list, list]:
        """Every process's prompts from the main process (``request_completions``); each process gets its own rows
        back."""
        self.settle_weights()
        acc = self.context.accelerator
        everyone = dist.gather_objects(acc, [(prompt_ids, seeds)])  # [process] -> (rows, their seeds)
        answer, error = None, None
        if acc.is_main_process:
            try:
                answer = request_completions(self.pool, [ids for part, _ in everyone for ids in part],
                                             [seed for _, part in everyone for seed in part], kwargs,
                                             self.config.vllm_structured_outputs_regex)[:2]
            except Exception as caught:
                error = caught
        dist.raise_together(acc, error, shared=(VLLMServerError,))  # as in _push_weights
        completions, logprobs = dist.broadcast_object(acc, answer)
        start = sum(len(part) for part, _ in everyone[:acc.process_index])
        mine = slice(start, start + len(prompt_ids))
        return completions[mine], logprobs[mine]

    def close(self) -> None:
        """Close the clients (the servers keep running); the next weight sync connects again. Idempotent. A push
        still finishing is waited for (its requests end within their timeouts); its failure, with nothing left to
        raise it to, is logged."""
        finishing, self._finishing, self._unsettled = self._finishing, None, False
        if finishing is not None and finishing.exception() is not None:
            logger.error(f"vLLM server: the last weight push failed as it finished: {finishing.exception()}")
        self._closed = True
        if self.pool is not None:
            pool, self.pool = self.pool, None
            pool.close()


class ServerSampler(VLLMBackend):
    """The generating half of ``VLLMRemote`` for one process: its own ``client``, its own rows, no collectives
    (``inputs``' accelerator is ``dist.ThisProcess``). Weights are not its business: ``VLLMRemote`` pushes them."""

    def __init__(self, inputs: BackendInputs, pool: ServerPool):
        super().__init__(inputs)
        self.pool = pool

    def sample(self, prompts: list, prompt_ids: list[list[int]], params) -> Samples:
        """As the trainer's backend samples, and with in-flight weight updates each token's weight version (the
        token route's tags: a request in flight across a push has tokens of two versions)."""
        kwargs, seeds = self.request_options(prompt_ids, params)
        inflight = self.config.max_inflight_tasks  # -1: MAX_CONCURRENT_REQUESTS
        return self.samples(prompt_ids, *request_completions(
            self.pool, prompt_ids, seeds, kwargs, self.config.vllm_structured_outputs_regex,
            inflight if inflight > 0 else MAX_CONCURRENT_REQUESTS, versions=self.config.in_flight_weight_updates))

    def _generate(self, prompt_ids: list[list[int]], kwargs: dict, seeds: list[int]) -> tuple[list, list]:
        inflight = self.config.max_inflight_tasks  # -1: MAX_CONCURRENT_REQUESTS
        return request_completions(self.pool, prompt_ids, seeds, kwargs, self.config.vllm_structured_outputs_regex,
                                   inflight if inflight > 0 else MAX_CONCURRENT_REQUESTS)[:2]

    def sync_weights(self, step: int | None = None) -> None:
        raise RuntimeError("ServerSampler.sync_weights: the trainer's VLLMRemote pushes the weights.")

    def close(self) -> None:
        self.pool.close()


def chunked(batches: Iterator[list[tuple[str, torch.Tensor]]]) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """``batches`` (one gathered module each) regrouped into requests of about WEIGHT_BATCH_BYTES."""
    pending, size = [], 0
    for batch in batches:
        pending += batch
        size += sum(t.numel() * t.element_size() for _, t in batch)
        if size >= WEIGHT_BATCH_BYTES:
            yield pending
            pending, size = [], 0
    yield pending
