"""GRPO against real vLLM-CPU servers (`trainers vllm-serve` on loopback): A and B, each pinned to a core of its own,
and C (sharing A's core) for the first two tests, started once for the module; the tests run in file order. First the same
seeded run against A alone, against A and B, and against all three: the same rewards at every step (each row keeps
its seed whichever server samples it). Asynchronous generation over B and C, C killed after step 2 (its producer
and the trainer fail over to B; the outage counted and warned about once). Then one run of 8 steps in which server
B is killed after step 3, restarted on its port after step 5 (the trainer waits for it there) and taken back, then
server A frozen with SIGSTOP after step 6 (its requests and the weight push wait request_timeout, then it is taken
out). The run finishes its 8 steps; every prompt of the epoch is scored exactly once per completion slot; each
server served 40-60% of the completions while both were up; the failovers are counted and each logged once by name.
Then B is killed too: with no server left the run stops after step 8 with a checkpoint, and the error names both
servers. The pool's logic over stand-ins: tests/unit/test_vllm_servers.py."""

import os
import signal
import threading
from collections import Counter

import pytest
from transformers import TrainerCallback

from tests.conftest import digits, step_records, warnings_of
from trainers import GRPOConfig, GRPOTrainer
from trainers.errors import VLLMServerError
from trainers.generation.local_server import free_port, start_local_server

PROMPTS = [{"prompt": f"{i} {i + 1}"} for i in range(16)]  # 8 steps x 2 prompts: one epoch
STEPS = 8


class ScoredDigits:
    """The digits reward, counting how often each prompt was scored (``scored``)."""

    __name__ = "digits"

    def __init__(self):
        self.scored = Counter()

    def __call__(self, prompts, completions, **kwargs):
        self.scored.update(prompts)
        return digits(completions)


class Chaos(TrainerCallback):
    """Kills server B after step 3, restarts it after step 5, freezes server A after step 6, kills B after step 8."""

    def __init__(self, servers: dict, restart):
        self.servers, self.restart = servers, restart

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 3:
            os.killpg(self.servers["B"].process.pid, signal.SIGKILL)
            self.servers["B"].process.wait()
        elif state.global_step == 5:
            self.servers["B"] = self.restart()  # blocks until it answers (its start-up)
        elif state.global_step == 6:
            os.killpg(self.servers["A"].process.pid, signal.SIGSTOP)
        elif state.global_step == STEPS:
            os.killpg(self.servers["B"].process.pid, signal.SIGKILL)
            self.servers["B"].process.wait()


@pytest.fixture(scope="module")
def two_servers(vllm_python, tmp_path_factory):
    from trainers.cli.tiny import save_tiny_model

    tmp_path = tmp_path_factory.mktemp("two_servers")
    model_dir = save_tiny_model(str(tmp_path / "model"), hidden_size=128, num_layers=2)  # head dim 32 (vLLM-CPU)
    ports = {"A": free_port(), "B": free_port(), "C": free_port()}

    def start(name: str, core: int):
        return start_local_server(model_dir, str(tmp_path / f"{name}.log"), cores=[core], port=ports[name],
                                  extra=("--python", vllm_python, "--seed", "0"), timeout=300)

    servers: dict = {}
    threads = [threading.Thread(target=lambda n=n, c=c: servers.__setitem__(n, start(n, c)))
               for n, c in (("A", 0), ("B", 1), ("C", 0))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    try:
        assert set(servers) == {"A", "B", "C"}, "a server did not start (see its log in tmp_path)"
        yield model_dir, servers, lambda: start("B", 1)
    finally:
        for server in servers.values():
            try:
                os.killpg(server.process.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            server.stop(grace=0)  # A still holds the connections the frozen requests left: no graceful wait


def config(tmp_path, name: str, urls: list[str], **overrides) -> GRPOConfig:
    return GRPOConfig(**{**dict(
        output_dir=str(tmp_path / name), per_device_train_batch_size=8, num_generations=4, max_completion_length=8,
        learning_rate=1e-2, max_steps=STEPS, logging_steps=1, save_strategy="no", disable_tqdm=True,
        report_to="none", seed=0, shuffle_dataset=False, use_vllm=True, vllm_mode="server",
        vllm_server_base_url=urls, vllm_group_port=free_port()), **overrides})


def test_two_and_three_servers_sample_what_one_samples(two_servers, tmp_path):
    """The same seeded run against A, against A and B, against A, B and C: the same rewards at every step. Three
    prompts a round, one request each: with three servers each serves a third, with two the first gets two."""
    model_dir, servers, _ = two_servers
    rewards, shares = {}, {}
    for urls in ([servers["A"].url], [servers["A"].url, servers["B"].url],
                 [servers["A"].url, servers["B"].url, servers["C"].url]):
        args = config(tmp_path, str(len(urls)), urls, max_steps=3, per_device_train_batch_size=12)
        trainer = GRPOTrainer(model=model_dir, reward_funcs=digits, args=args, train_dataset=PROMPTS)
        trainer.train()
        rewards[len(urls)] = [r["reward"] for r in step_records(trainer)]
        last = step_records(trainer)[-1]
        shares[len(urls)] = [round(last.get(f"servers/share/{i}", 1.0), 3) for i in range(len(urls))]
    print(f"\nrewards by servers {rewards}; shares {shares}")
    assert rewards[1] == rewards[2] == rewards[3] and len(rewards[1]) == 3
    assert shares[3] == [0.333, 0.333, 0.333] and sum(shares[2]) == pytest.approx(1.0)


def test_asynchronous_generation_spreads_its_rounds_over_both_and_survives_a_kill(two_servers, tmp_path, caplog):
    """async_generation over B and C: the producer thread samples through a pool of its own, following the
    trainer's pushes; both serve. C is killed after step 2 (the last test to use it): the producer's requests and
    the trainer's next push fail over to B, the run finishes its 4 steps, every prompt of the 4 steps is scored
    once per completion slot, and the outage (met by both pools) is counted and warned about once."""
    model_dir, servers, _ = two_servers
    urls = [servers["B"].url, servers["C"].url]
    reward = ScoredDigits()
    class KillC(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                os.killpg(servers["C"].process.pid, signal.SIGKILL)
                servers["C"].process.wait()

    args = config(tmp_path, "async", urls, max_steps=4, async_generation=True, max_staleness=1)
    trainer = GRPOTrainer(model=model_dir, reward_funcs=reward, args=args, train_dataset=PROMPTS,
                          callbacks=[KillC()])
    with warnings_of("trainers", caplog) as records:
        trainer.train()
    steps = {r["step"]: r for r in step_records(trainer)}
    print(f"\nasynchronous, two servers: shares at step 2 {steps[2]['servers/share/0']:.2f} / "
          f"{steps[2]['servers/share/1']:.2f}; in service {[steps[s]['servers/in_service'] for s in steps]}")
    assert trainer.state.global_step == 4 and reward.scored == Counter({row["prompt"]: 4 for row in PROMPTS[:8]})
    assert steps[2]["servers/in_service"] == 2 and steps[2]["servers/failovers"] == 0
    assert 0.3 <= steps[2]["servers/share/0"] <= 0.7 and steps[2]["servers/share/1"] > 0
    assert steps[4]["servers/in_service"] == 1 and steps[4]["servers/failovers"] == 1
    assert sum(r.getMessage().startswith(f"vLLM server {urls[1]} failed") for r in records()) == 1


def test_two_servers_share_the_rounds_and_the_run_survives_a_kill_a_restart_and_a_freeze(two_servers, tmp_path,
                                                                                          caplog):
    model_dir, servers, restart = two_servers
    urls = [servers["A"].url, servers["B"].url]
    reward = ScoredDigits()
    args = config(tmp_path, "chaos", urls, request_timeout=12, max_steps=STEPS + 2)
    trainer = GRPOTrainer(model=model_dir, reward_funcs=reward, args=args, train_dataset=PROMPTS,
                          callbacks=[Chaos(servers, restart)])
    with warnings_of("trainers", caplog) as logged, pytest.raises(VLLMServerError) as stopped:
        trainer.train()
    # no server left after step 8: stopped there, with a checkpoint, naming both servers
    message = str(stopped.value)
    assert f"No vLLM server left: {urls[0]}, {urls[1]}" in message, message
    assert "Training stopped after step 8; checkpoint written to" in message, message
    assert os.path.isdir(tmp_path / "chaos" / "checkpoint-8")
    records = {r["step"]: r for r in step_records(trainer)}
    assert trainer.state.global_step == STEPS and sorted(records) == list(range(1, STEPS + 1))
    # every prompt of the epoch scored once per completion slot: nothing lost or doubled by the failovers
    assert reward.scored == Counter({row["prompt"]: 4 for row in PROMPTS})
    in_service = [records[s]["servers/in_service"] for s in range(1, STEPS + 1)]
    failovers = [records[s]["servers/failovers"] for s in range(1, STEPS + 1)]
    print(f"\ntwo servers: in service {in_service}, failovers {failovers}, shares at step 3 "
          f"{records[3]['servers/share/0']:.2f} / {records[3]['servers/share/1']:.2f}")
    # both up (steps 1-3): each 40-60% of the completions
    assert 0.4 <= records[3]["servers/share/0"] <= 0.6 and 0.4 <= records[3]["servers/share/1"] <= 0.6
    assert in_service[:3] == [2, 2, 2] and failovers[:3] == [0, 0, 0]
    assert in_service[3] == 1 and failovers[3] == 1  # B killed: out at step 4's weight push
    assert in_service[5] == 2  # restarted: taken back at step 6's push, with its weights
    assert in_service[6:] == [1, 1] and failovers[-1] == 2  # A frozen: out after request_timeout
    records_ = logged()
    warned = Counter(url for r in records_ for url in urls if r.getMessage().startswith(f"vLLM server {url} failed"))
    assert warned == {urls[0]: 1, urls[1]: 2}  # one warning per failure: A frozen; B killed, then killed again
    assert any("answers again" in r.getMessage() and servers["B"].url in r.getMessage() for r in records_)
