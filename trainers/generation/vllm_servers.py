"""Several `trainers vllm-serve` servers as one (``vllm_server_base_url`` given a list of URLs): each round's
requests spread over them, the weights pushed to all of them together, and a server that fails taken out while
the others finish the round.

- **Spreading.** Each request (one prompt's completions, seeded: generation/vllm_remote.py) goes to the server in
  service with the fewest requests in flight (ties: the first listed). Seeds stay per row, so which server
  samples a row does not choose its seed; whether it samples the same tokens as another server would is a
  matter of the engines' batching (docs/grpo.md, "Several servers").
- **Versions.** Each server is tagged with the optimizer step whose weights (or LoRA adapter: ``push_adapter``) it
  holds. Only servers holding the
  latest weights get requests: a server that missed a push gets none until a push reaches it.
- **Failover.** A server that does not answer (refused, reset, past ``request_timeout``) or fails inside
  (HTTP 5xx) while sampling or receiving weights is taken out, with one warning naming it, and counted
  (``ServerPool.metrics``); its requests go to the others, so the round completes with every row sampled once.
  At each weight push the servers that are out are asked again (``/health``, once): one that answers is
  connected afresh, sent the weights with the others, and takes requests again. Only when none is left is it a
  ``VLLMServerError`` (the trainer stops with a checkpoint, as with one server).

A request the server refuses (another 4xx: a bad sampling option, a wrong key) is the run's error, not the
server's: it is raised, whatever the number of servers.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from trainers.errors import VLLMServerError
from trainers.logs import logger


@dataclass
class Server:
    """One server of the pool: its client (None while it is out), the weights it holds, what it is doing."""

    url: str
    client: object | None  # a VLLMClient (generation/vllm_client.py), or a stand-in with its methods
    version: int | None = None  # the optimizer step whose weights it holds (None: none pushed yet)
    out: bool = False  # taken out after a failure, until a push takes it back
    in_flight: int = 0  # requests sent and not yet answered
    completions: int = 0  # completions it returned


@dataclass
class Outages:
    """The servers out of service as this process's pools see them: the trainer's pool and its asynchronous
    producers' pools share one, so an outage that several of them meet (a producer while sampling, the trainer at
    its next push) is warned about and counted once."""

    out: set[str] = field(default_factory=set)  # the URLs of the servers out now
    count: int = 0  # outages in this run
    lock: threading.Lock = field(default_factory=threading.Lock)

    def begin(self, url: str) -> bool:
        """True when this is news: the first pool to meet this server's outage (it warns; the outage counts)."""
        with self.lock:
            if url in self.out:
                return False
            self.out.add(url)
            self.count += 1
            return True

    def end(self, url: str) -> None:
        with self.lock:
            self.out.discard(url)


class ServerPool:
    """``urls``' servers; ``connect(url, wait)`` -> a client of the server there, checked against the model
    (``VLLMServerError`` when it does not answer within the connection timeout, or at once with ``wait=False``).
    The clients are connected now: every server must answer at the start (a wrong URL is a configuration error,
    not a failure to route around). ``outages``: shared with the other pools of this process over the same
    servers (see ``Outages``); a pool of its own by default."""

    def __init__(self, urls: list[str], connect: Callable[[str, bool], object], outages: Outages | None = None):
        if not urls:
            raise VLLMServerError("ServerPool: no server URL given.")
        if len(set(urls)) != len(urls):
            raise VLLMServerError(f"vllm_server_base_url lists a server twice: {urls}.")
        self.connect = connect
        self.servers = [Server(url, connect(url, True)) for url in urls]
        self.version: int | None = None  # the weights the servers in service hold
        self.adapter: tuple[str, int | None] | None = None  # (name, version) of the adapter they serve, if any
        self.outages = outages if outages is not None else Outages()
        self.last_error: Exception | None = None  # the last failure that took a server out
        self.lock = threading.Lock()  # requests run in threads (a round's requests, GRPO's producers)

    # ------------------------------------------------------------------ which server

    @property
    def failovers(self) -> int:
        """Outages in this run, as this process's pools met them (each counted once)."""
        return self.outages.count

    def in_service(self) -> list[Server]:
        """The servers that take requests: answering, and holding the latest weights."""
        return [s for s in self.servers if not s.out and s.client is not None and s.version == self.version]

    def take_out(self, server: Server, error: Exception, doing: str) -> None:
        """``server`` out of service after ``error``: counted, one warning naming it (none when it was the only
        one: its error is the run's; none when another pool of this process met this outage first), its client
        released without a word to it."""
        with self.lock:
            if server.out:
                return
            server.out, self.last_error = True, error
            left = len(self.in_service())
        if self.outages.begin(server.url) and len(self.servers) > 1:
            logger.warning(f"vLLM server {server.url} failed while {doing} and is out of service ({left} of "
                           f"{len(self.servers)} left; it is asked again at the next weight sync): {error}")
        client, server.client = server.client, None
        if client is not None and hasattr(client, "abandon"):
            client.abandon()

    def none_left(self) -> VLLMServerError:
        """The error when no server is left: the last failure itself with one server (as without a pool), else
        one naming them all and the last failure."""
        if len(self.servers) == 1 and self.last_error is not None:
            return self.last_error
        return VLLMServerError(f"No vLLM server left: {', '.join(s.url for s in self.servers)} are out of service "
                               f"(each failed or missed a weight push; the warnings above say why). The last "
                               f"failure: {self.last_error}")

    def _pick(self) -> Server:
        with self.lock:
            ready = self.in_service()
            if not ready:
                raise self.none_left()
            server = min(ready, key=lambda s: s.in_flight)
            server.in_flight += 1
            return server

    def request(self, send: Callable[[object], dict], doing: str = "sampling") -> dict:
        """``send(client)`` on the server in service with the fewest requests in flight; on another if that one
        fails (it is taken out), until one answers or none is left. Safe to call from several threads."""
        from trainers.generation.vllm_client import VLLMServerDown

        while True:
            server = self._pick()
            try:
                out = send(server.client)
            except VLLMServerDown as error:
                self.take_out(server, error, doing)
                continue
            finally:
                with self.lock:
                    server.in_flight -= 1
            with self.lock:
                server.completions += len(out.get("completion_ids", ()))
            return out

    # ------------------------------------------------------------------ weights

    def reconnect(self, server: Server) -> bool:
        """Ask a server that is out once; if it answers, connect it afresh and put it back in the pool."""
        try:
            server.client = self.connect(server.url, False)
        except VLLMServerError:
            return False
        server.out = False
        self.outages.end(server.url)
        return True

    def take_back(self) -> list[Server]:
        """The servers that are out and answer again, connected afresh (their weights are stale until the push
        that follows)."""
        back = []
        for server in self.servers:
            if not server.out:
                continue
            if not self.reconnect(server):
                continue  # still down: asked again at the next push
            server.version = None
            back.append(server)
            logger.warning(f"vLLM server {server.url} answers again: it gets this push's weights and then requests.")
        return back

    def push(self, batches: Iterable[list[tuple[str, torch.Tensor]]], version: int | None,
             pause: bool = False) -> None:
        """Every answering server's weights := ``batches`` (the policy's, gathered module by module), sent to all
        of them together; those that answer again first (``take_back``). A server that fails during the push is
        taken out; the push fails only when none received it. ``pause``: each server's requests in flight are
        paused for the update and go on with the new weights (their tokens from then on tagged ``version``)."""
        self.finish_push(self.send_push(batches, version, pause))

    def send_push(self, batches: Iterable[list[tuple[str, torch.Tensor]]], version: int | None,
                  pause: bool = False) -> Push:
        """``push`` up to the last tensors sent: it returns while the servers still load them, and
        ``finish_push`` ends the update on each (it may run in another thread; the caller neither samples nor
        pushes through this pool meanwhile)."""
        push = Push(self, version)
        try:
            push.each(lambda s: s.client.begin_weight_update(pause), "opening a weight update")
            for batch in batches:
                push.each(lambda s: s.client.update_named_params(batch), "receiving weights")
        except BaseException:
            push.close()
            raise
        return push

    def finish_push(self, push: Push) -> None:
        """The servers of ``push`` load what they were sent, finish the update (their tokens from then on tagged
        with its version) and resume; then those that took every call hold that version."""
        push.finish(lambda s: s.client.end_weight_update(push.version), "finishing a weight update")

    def push_adapter(self, adapter, keep: int = 2) -> None:
        """Every answering server serves ``adapter`` (generation/vllm_lora.py's ``Adapter``) from now on, with the
        base weights it has; each keeps the newest ``keep`` adapters loaded. As ``push``: those that answer again
        first, one that fails is taken out, an error only when none has it."""
        Push(self, adapter.version).finish(lambda s: s.client.load_adapter(adapter, keep), "loading an adapter")
        self.adapter = (adapter.name, adapter.version)

    def lora_configs(self) -> dict[str, dict | None]:
        """Each server's LoRA settings (None: started without --enable-lora), by URL."""
        return {s.url: s.client.lora_config() for s in self.servers if s.client is not None}

    # ------------------------------------------------------------------ another process's pool

    def view(self) -> dict[str, int | None | bool]:
        """Which servers are in service and the weights they hold, as the pool that pushes them sees it: url ->
        the version, or False when it is out or stale. Sent to the other processes' pools after each push."""
        ready = self.in_service()
        return {s.url: (s.version if s in ready else False) for s in self.servers} | {"": self.version,
                                                                                       "adapter": self.adapter}

    def adopt(self, view: dict) -> None:
        """Follow the pushing pool's ``view`` (GRPO's asynchronous producers, which sample but never push; with
        in-flight weight updates, while they sample): a server it has out is out here; one in service there is
        connected again here if it was out; the versions change together, so a request never finds none."""
        for server in self.servers:  # the network first, outside the lock
            version = view.get(server.url, False)
            if version is False and not server.out:
                self.take_out(server, VLLMServerError("out of service for the trainer"), "following the trainer")
            elif version is not False and server.out:
                self.reconnect(server)
        with self.lock:
            self.version, self.adapter = view[""], view.get("adapter")
            for server in self.servers:
                version = view.get(server.url, False)
                if version is not False and not server.out:
                    server.version = version
                    server.client.adapter = self.adapter

    # ------------------------------------------------------------------ reporting

    def metrics(self, followers: Iterable[ServerPool] = ()) -> dict[str, float]:
        """servers/in_service, servers/failovers (in the run so far) and each server's share of the completions
        so far (servers/share/<i>, in the order given), counting what ``followers`` (this process's asynchronous
        producers' pools, over the same servers) sampled; the outages all of them met, each once."""
        pools = [self, *followers]
        counts = [sum(pool.servers[i].completions for pool in pools) for i in range(len(self.servers))]
        total = sum(counts)
        out = {"servers/in_service": float(len(self.in_service())), "servers/failovers": float(self.failovers)}
        for i, count in enumerate(counts):
            out[f"servers/share/{i}"] = count / total if total else 0.0
        return out

    def close(self) -> None:
        for server in self.servers:
            if server.client is not None:
                server.client.close()


class Push:
    """One update of every server of ``pool`` in service (those that answer again first, ``take_back``), made
    of calls that each run on all of them at once (``each``), the last one by ``finish``: then those that took
    every call hold ``version``."""

    def __init__(self, pool: ServerPool, version: int | None):
        pool.take_back()
        self.pool, self.version = pool, version
        self.targets = [s for s in pool.servers if not s.out and s.client is not None]
        self.threads = ThreadPoolExecutor(max_workers=max(1, len(self.targets)))

    def each(self, call: Callable[[Server], None], doing: str) -> None:
        """``call(server)`` on every server of the push still in it, at once; one that does not answer
        (VLLMServerDown) is taken out, any other error is raised."""
        from trainers.generation.vllm_client import VLLMServerDown

        futures = [(s, self.threads.submit(call, s)) for s in self.targets if not s.out]
        for server, future in futures:
            error = future.exception()
            if isinstance(error, VLLMServerDown):
                self.pool.take_out(server, error, doing)
            elif error is not None:
                raise error

    def finish(self, call: Callable[[Server], None], doing: str) -> None:
        """The push's last call (as ``each``); then the servers that took every call hold its version
        (VLLMServerError when none did)."""
        try:
            self.each(call, doing)
        finally:
            self.close()
        held = [s for s in self.targets if not s.out]
        if not held:
            raise self.pool.none_left()
        for server in held:
            server.version = self.version
        self.pool.version = self.version

    def close(self) -> None:
        self.threads.shutdown(wait=True)
