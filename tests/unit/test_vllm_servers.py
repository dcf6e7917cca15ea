"""Several vLLM servers as one (trainers/generation/vllm_servers.py), over stand-in clients that answer, fail or
come back as a test says: requests spread by the fewest in flight, a server that fails taken out (counted, one
warning) while the others finish the work, one that misses a push gets no requests until a push reaches it, one
that answers again taken back at the next push, and the error when none is left. The real servers:
tests/integration/test_vllm_servers.py."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.conftest import warnings_of
from trainers.errors import VLLMServerError
from trainers.generation.vllm_client import VLLMServerDown
from trainers.generation.vllm_servers import ServerPool


class Fleet:
    """Stand-in servers by URL: which are up, what each served and received."""

    def __init__(self, *urls, delay: float = 0.0):
        self.up = {url: True for url in urls}
        self.served = {url: [] for url in urls}  # the prompts each answered
        self.weights = {url: [] for url in urls}  # the batches each received, per push
        self.updates = {url: [] for url in urls}  # per push: (its requests paused, the version it was tagged with)
        self.delay = delay

    def connect(self, url: str, wait: bool):
        if not self.up[url]:
            raise VLLMServerDown(f"The vLLM server at {url} did not answer GET /health: refused.")
        return Client(self, url)


class Client:
    def __init__(self, fleet: Fleet, url: str):
        self.fleet, self.url = fleet, url

    def _check(self, path: str) -> None:
        if not self.fleet.up[self.url]:
            raise VLLMServerDown(f"The vLLM server at {self.url} did not answer POST {path}: refused.")

    def generate(self, prompts, n=1, **kwargs):
        self._check("/v1/completions")
        time.sleep(self.fleet.delay)
        self._check("/v1/completions")  # killed while sampling
        self.fleet.served[self.url] += prompts
        return {"prompt_ids": prompts, "completion_ids": [[7]] * (n * len(prompts))}

    def begin_weight_update(self, pause=False):
        self._check("/start_weight_update")
        self.fleet.weights[self.url].append([])
        self.fleet.updates[self.url].append([pause, None])

    def update_named_params(self, batch):
        self._check("/update_weights")
        self.fleet.weights[self.url][-1] += [name for name, _ in batch]

    def end_weight_update(self, version=None):
        self._check("/finish_weight_update")
        self.fleet.updates[self.url][-1][1] = version

    def abandon(self):
        pass

    def close(self):
        pass


A, B, C = "http://a:8000", "http://b:8000", "http://c:8000"
BATCHES = [[("w1", None)], [("w2", None)]]


def sample(pool: ServerPool, prompts: list[int], workers: int = 8) -> list[dict]:
    with ThreadPoolExecutor(workers) as threads:
        return list(threads.map(lambda p: pool.request(lambda client: client.generate([p])), prompts))


def test_requests_spread_over_the_servers_by_the_fewest_in_flight():
    fleet = Fleet(A, B, delay=0.02)
    pool = ServerPool([A, B], fleet.connect)
    sample(pool, list(range(40)))
    shares = {url: len(served) / 40 for url, served in fleet.served.items()}
    assert all(0.3 <= share <= 0.7 for share in shares.values()), shares
    assert sorted(fleet.served[A] + fleet.served[B]) == list(range(40))  # each once
    metrics = pool.metrics()
    assert metrics["servers/in_service"] == 2 and metrics["servers/failovers"] == 0
    assert metrics["servers/share/0"] + metrics["servers/share/1"] == pytest.approx(1.0)
    one = Fleet(A)  # alone, in order: the same requests
    sample(ServerPool([A], one.connect), list(range(5)), workers=1)
    assert one.served[A] == list(range(5))


def test_a_server_that_fails_mid_round_is_taken_out_and_the_others_finish(caplog):
    fleet = Fleet(A, B, C, delay=0.01)
    pool = ServerPool([A, B, C], fleet.connect)
    killer = threading.Timer(0.03, lambda: fleet.up.__setitem__(B, False))
    killer.start()
    with warnings_of("trainers", caplog) as logged:
        answers = sample(pool, list(range(60)), workers=6)
    killer.join()
    assert len(answers) == 60 and all(a["completion_ids"] == [[7]] for a in answers)
    assert sorted(fleet.served[A] + fleet.served[B] + fleet.served[C]) == list(range(60))  # none lost or doubled
    assert pool.failovers == 1 and [s.url for s in pool.in_service()] == [A, C]
    warnings = [r.getMessage() for r in logged() if B in r.getMessage()]
    assert len(warnings) == 1 and "out of service (2 of 3 left" in warnings[0]


def test_a_server_that_misses_a_push_gets_no_requests_until_one_reaches_it_and_comes_back_when_it_answers():
    fleet = Fleet(A, B)
    pool = ServerPool([A, B], fleet.connect)
    pool.push(iter(BATCHES), version=1)
    assert fleet.weights[A] == fleet.weights[B] == [["w1", "w2"]] and pool.version == 1
    fleet.up[B] = False
    pool.push(iter(BATCHES), version=2)  # B misses it: out, A alone serves
    assert [s.url for s in pool.in_service()] == [A] and pool.failovers == 1
    fleet.served = {A: [], B: []}
    sample(pool, list(range(10)))
    assert len(fleet.served[A]) == 10 and fleet.served[B] == []
    pool.push(iter(BATCHES), version=3)  # B still down: asked, left out
    assert [s.url for s in pool.in_service()] == [A]
    fleet.up[B] = True  # restarted
    pool.push(iter(BATCHES), version=4)  # taken back: it gets this push's weights, then requests
    assert fleet.weights[B][-1] == ["w1", "w2"] and [s.url for s in pool.in_service()] == [A, B]
    assert all(s.version == 4 for s in pool.servers)


def test_a_push_pauses_the_requests_in_flight_only_when_asked_and_tags_its_version():
    fleet = Fleet(A, B)
    pool = ServerPool([A, B], fleet.connect)
    pool.push(iter(BATCHES), version=1)
    pool.push(iter(BATCHES), version=2, pause=True)  # a producer is sampling: each server pauses it for the update
    assert fleet.updates[A] == fleet.updates[B] == [[False, 1], [True, 2]]


def test_a_push_sent_now_and_finished_later_holds_its_version_only_once_finished():
    """send_push returns with the tensors at every server and each update still open (paused, untagged); the pool
    still serves the old version. finish_push ends it: the servers that finish hold the new version, one that fails
    finishing is taken out; when none is left finishing, the error is raised there."""
    fleet = Fleet(A, B)
    pool = ServerPool([A, B], fleet.connect)
    pool.push(iter(BATCHES), version=1)
    push = pool.send_push(iter(BATCHES), version=2, pause=True)
    assert fleet.weights[A][-1] == fleet.weights[B][-1] == ["w1", "w2"]
    assert fleet.updates[A][-1] == fleet.updates[B][-1] == [True, None] and pool.version == 1
    fleet.up[B] = False  # dies while it loads
    pool.finish_push(push)
    assert fleet.updates[A][-1] == [True, 2] and pool.version == 2
    assert [s.url for s in pool.in_service()] == [A] and pool.failovers == 1
    push = pool.send_push(iter(BATCHES), version=3, pause=True)
    fleet.up[A] = False
    with pytest.raises(VLLMServerError, match="No vLLM server left.*did not answer POST /finish_weight_update"):
        pool.finish_push(push)


def test_the_other_processes_pools_follow_the_pushing_one():
    fleet = Fleet(A, B)
    pushing, following = ServerPool([A, B], fleet.connect), ServerPool([A, B], fleet.connect)
    pushing.push(iter(BATCHES), version=5)
    following.adopt(pushing.view())
    assert [s.url for s in following.in_service()] == [A, B] and following.version == 5
    fleet.up[B] = False
    pushing.push(iter(BATCHES), version=6)
    following.adopt(pushing.view())
    assert [s.url for s in following.in_service()] == [A]
    fleet.up[B] = True
    pushing.push(iter(BATCHES), version=7)
    following.adopt(pushing.view())
    assert [s.url for s in following.in_service()] == [A, B] and following.version == 7


def test_an_outage_that_a_producer_and_the_trainer_both_meet_is_warned_about_and_counted_once(caplog):
    """An asynchronous producer's pool shares the trainer's ``outages``: B fails under the producer while
    sampling, then under the trainer's push; one warning, one failover; taken back, the next outage counts."""
    fleet = Fleet(A, B)
    pushing = ServerPool([A, B], fleet.connect)
    producing = ServerPool([A, B], fleet.connect, pushing.outages)
    pushing.push(iter(BATCHES), version=1)
    producing.adopt(pushing.view())
    fleet.up[B] = False
    with warnings_of("trainers", caplog) as logged:
        sample(producing, list(range(6)), workers=2)  # B fails under the producer
        pushing.push(iter(BATCHES), version=2)  # and under the trainer's push
        producing.adopt(pushing.view())
    warnings = [r.getMessage() for r in logged() if B in r.getMessage()]
    assert len(warnings) == 1 and pushing.failovers == producing.failovers == 1
    assert pushing.metrics([producing])["servers/failovers"] == 1
    fleet.up[B] = True
    pushing.push(iter(BATCHES), version=3)  # taken back by the trainer, then by the producer
    producing.adopt(pushing.view())
    assert [s.url for s in producing.in_service()] == [A, B]
    fleet.up[B] = False
    pushing.push(iter(BATCHES), version=4)
    assert pushing.metrics([producing])["servers/failovers"] == 2


def test_when_no_server_is_left_the_error_says_so_and_one_server_keeps_its_own_error():
    fleet = Fleet(A, B)
    pool = ServerPool([A, B], fleet.connect)
    fleet.up[A] = fleet.up[B] = False
    with pytest.raises(VLLMServerError, match=f"No vLLM server left: {A}, {B} .* The last failure: The vLLM "
                                              f"server at http://(a|b):8000 did not answer"):
        sample(pool, [1])
    alone = Fleet(A)
    pool = ServerPool([A], alone.connect)
    alone.up[A] = False
    with pytest.raises(VLLMServerDown, match=f"^The vLLM server at {A} did not answer POST /v1/completions"):
        sample(pool, [1])  # exactly as without a pool
    alone_push = Fleet(A)
    pool = ServerPool([A], alone_push.connect)
    alone_push.up[A] = False
    with pytest.raises(VLLMServerDown, match="did not answer POST /start_weight_update"):
        pool.push(iter(BATCHES), version=1)


def test_a_refused_request_is_the_runs_error_not_the_servers():
    fleet = Fleet(A, B)
    pool = ServerPool([A, B], fleet.connect)

    def bad(client):
        raise VLLMServerError(f"The vLLM server at {client.url} answered POST /v1/completions with HTTP 400: ...")

    with pytest.raises(VLLMServerError, match="HTTP 400"):
        pool.request(bad)
    assert pool.failovers == 0 and len(pool.in_service()) == 2
    with pytest.raises(VLLMServerError, match="lists a server twice"):
        ServerPool([A, A], fleet.connect)
