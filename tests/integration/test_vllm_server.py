"""vllm_mode="server" against a real vLLM server: `trainers vllm-serve` started once for this module (a tiny
width-128 Qwen2, CPU, fp32, eager), and VLLMClient's generate contract, weight updates (the server's greedy
completions and log-probs equal a reference model's with the same weights), a mismatched model, GRPO training
against it (tests/integration/vllm_server_job.py, in its own process), and a server killed mid-run (during
training, then the client's errors). The server is a separate process group, killed at the end, whatever
happens. The tests run in file order: the last two kill the server.

vLLM's Python: the vllm_python fixture (tests/conftest.py), which skips these tests where there is none."""

import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import pytest
import torch

from tests.conftest import (REPO, against, free_port, launch, noisy_model, rank_reports, reports_of_one_job,
                            run_job)
from tests.integration.vllm_tool_rounds import check_tool_rounds
from trainers.errors import VLLMServerError
from trainers.generation.vllm_client import KEY_VARIABLE, VLLMClient, VLLMKeyError

PROMPTS = [[1, 2, 3, 4], [10, 20, 30], [5, 6], [100, 101, 102, 103, 104]]


@dataclass
class Server:
    url: str
    model_dir: str
    process: subprocess.Popen
    log_path: str

    def log_tail(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-6000:]


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of a process group."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":  # fields: state, ppid, pgrp, ...
            members.append(int(entry))
    return members


def stop(process: subprocess.Popen) -> list[int]:
    """SIGTERM the server's whole process group, SIGKILL what is left after 30 s; -> the pids still alive."""
    pgid = process.pid  # start_new_session: the launcher leads its group, and the server execs in its place
    for sig, grace in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        if not group_members(pgid):
            break
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + grace
        while group_members(pgid) and time.monotonic() < deadline:
            if process.poll() is None:
                try:
                    process.wait(timeout=0.5)
                except subprocess.TimeoutExpired:
                    pass
            else:
                time.sleep(0.2)
    return group_members(pgid)


@pytest.fixture(scope="module")
def server(vllm_python, tmp_path_factory):
    yield from serve(vllm_python, tmp_path_factory)


def serve(python: str, tmp_path_factory):
    """A `trainers vllm-serve` server on a tiny model for the test module (a generator: the fixture's body, which
    test_vllm_async.py starts for itself too), run by ``python``; stopped, with every process it started, at the
    end."""
    from trainers.cli.tiny import save_tiny_model

    root = tmp_path_factory.mktemp("vllm_server")
    # width 128: vLLM's CPU attention wants a head dim of at least 32
    model_dir = save_tiny_model(str(root / "model"), hidden_size=128, num_layers=2)
    # the server has a key, so every test here drives it as a trainer must: the variable reaches the server, this
    # process's clients and the jobs it launches (restored when the module ends)
    previous_key = os.environ.get(KEY_VARIABLE)
    os.environ[KEY_VARIABLE] = "test-" + secrets.token_hex(8)
    port = free_port()
    log_path = str(root / "server.log")
    command = [sys.executable, "-m", "trainers.cli.main", "vllm-serve", "--python", python, "--model", model_dir,
               "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max_model_len", "1024",
               "--enforce_eager", "--cpu_kvcache_space", "1", "--seed", "0"]
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
    running = Server(f"http://127.0.0.1:{port}", model_dir, process, log_path)
    try:
        started = time.monotonic()
        while True:
            if process.poll() is not None:
                pytest.fail(f"the vLLM server exited ({process.returncode}):\n{running.log_tail()}")
            try:
                VLLMClient(running.url, connection_timeout=0)
                break
            except VLLMServerError:
                if time.monotonic() - started > 300:
                    pytest.fail(f"the vLLM server did not answer within 300 s:\n{running.log_tail()}")
                time.sleep(1)
        print(f"\nvLLM server start-up: {time.monotonic() - started:.1f} s")
        yield running
    finally:
        left = stop(process)
        if previous_key is None:
            os.environ.pop(KEY_VARIABLE, None)
        else:
            os.environ[KEY_VARIABLE] = previous_key
        assert not left, f"server processes outlived the test module: {left}"


@pytest.fixture(scope="module")
def client(server):
    client = VLLMClient(server.url, connection_timeout=5, group_port=free_port())
    yield client
    client.close()


def reference_model(model_dir, seed: int):
    """The tiny model with every weight moved by noise: outputs far from the served model's."""
    return noisy_model(model_dir, seed, scale=0.5)


@torch.no_grad()
def reference_greedy(model, prompts, max_tokens: int) -> list[list[int]]:
    out = []
    for prompt in prompts:
        ids = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=model.config.pad_token_id)
        out.append(ids[0, len(prompt):].tolist())
    return out


@torch.no_grad()
def reference_logprobs(model, prompt: list[int], completion: list[int]) -> list[float]:
    logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1]  # [C, V]
    return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(completion)[:, None])[:, 0].tolist()


def greedy(client, max_tokens=8):
    return client.generate(PROMPTS, temperature=0.0, max_tokens=max_tokens,
                           generation_kwargs={"ignore_eos": True})["completion_ids"]


def test_generate_contract(client, server):
    from transformers import AutoTokenizer

    out = client.generate(PROMPTS, n=2, max_tokens=5, temperature=1.0, logprobs=0, generation_kwargs={"seed": 1})
    assert set(out) == {"prompt_ids", "completion_ids", "logprobs", "logprob_token_ids"}
    assert out["prompt_ids"] == PROMPTS  # one row per prompt
    assert len(out["completion_ids"]) == 2 * len(PROMPTS)  # n rows per prompt, prompt-major
    for completion, values, ids in zip(out["completion_ids"], out["logprobs"], out["logprob_token_ids"]):
        assert 1 <= len(completion) <= 5 and all(0 <= t < 259 for t in completion)
        assert [len(v) for v in values] == [1] * len(completion)  # logprobs=0: the sampled token's alone
        assert [i[0] for i in ids] == completion and all(v[0] <= 0 for v in values)
    # top-2: two or three per token (the sampled one added when it is not among them), by descending probability
    out = client.generate(PROMPTS[:2], max_tokens=4, logprobs=2, generation_kwargs={"seed": 2})
    for completion, values, ids in zip(out["completion_ids"], out["logprobs"], out["logprob_token_ids"]):
        for token, v, i in zip(completion, values, ids):
            assert len(v) in (2, 3) and v == sorted(v, reverse=True) and token in i
    assert client.generate(PROMPTS[:1], max_tokens=2, logprobs=None)["logprobs"] is None
    # text prompts: the server tokenizes them as the model's tokenizer does
    tokenizer = AutoTokenizer.from_pretrained(server.model_dir)
    out = client.generate(["hello", "ab"], max_tokens=3)
    assert out["prompt_ids"] == [tokenizer("hello").input_ids, tokenizer("ab").input_ids]
    assert len(out["completion_ids"]) == 2


def test_the_token_route_samples_as_the_completions_route_and_keeps_stop_strings(client):
    """The token route (in-flight updates sample through it; the client asks it not to detokenize) gives the
    completions route's tokens and log-probs for one seed; with stop strings it detokenizes (vLLM refuses them
    otherwise)."""
    for prompt in PROMPTS[:2]:
        texts = client.generate([prompt], n=3, max_tokens=6, temperature=1.0, logprobs=0,
                                generation_kwargs={"seed": 11, "ignore_eos": True})
        tokens = client.generate_tokens(prompt, n=3, seed=11, sampling_params={
            "max_tokens": 6, "temperature": 1.0, "logprobs": 0, "ignore_eos": True})
        assert tokens["completion_ids"] == texts["completion_ids"]
        for ours, theirs in zip(tokens["logprobs"], texts["logprobs"]):
            assert [v[0] for v in ours] == pytest.approx([v[0] for v in theirs], abs=1e-5)
    stopped = client.generate_tokens(PROMPTS[0], n=1, seed=12, sampling_params={"max_tokens": 4, "stop": ["\x00zz"]})
    assert 1 <= len(stopped["completion_ids"][0]) <= 4


def test_weight_update_makes_the_server_match_a_reference(client, server):
    model = reference_model(server.model_dir, seed=0)
    expected = reference_greedy(model, PROMPTS, 8)
    assert greedy(client) != expected  # the test can fail: the served weights are not these yet
    seconds = []
    for _ in range(3):
        started = time.perf_counter()
        client.update_model_params(model)  # the full state dict: the tied output head included
        seconds.append(time.perf_counter() - started)
    print(f"\nweight sync, tiny model ({sum(p.numel() for p in model.parameters())} parameters): "
          f"{', '.join(f'{1000 * s:.0f}' for s in seconds)} ms")
    assert greedy(client) == expected
    # sampled at temperature 1: the server's log-probs are the reference's own
    out = client.generate(PROMPTS, max_tokens=6, logprobs=0, generation_kwargs={"seed": 3, "ignore_eos": True})
    for prompt, completion, values in zip(PROMPTS, out["completion_ids"], out["logprobs"]):
        assert [v[0] for v in values] == pytest.approx(reference_logprobs(model, prompt, completion), abs=2e-3)

    # one update in several chunks (one per gathered module under ZeRO-3): the same result
    model = reference_model(server.model_dir, seed=1)
    expected = reference_greedy(model, PROMPTS, 8)
    assert greedy(client) != expected
    items = list(model.state_dict().items())
    with client.weight_update():
        for start in range(0, len(items), 5):
            client.update_named_params(items[start:start + 5])
    assert greedy(client) == expected

    # the server's dtype comes from /server_info; bf16 weights travel as bf16 (buckets of that dtype) to this
    # float32 server, which widens them exactly (to a narrower server, float32 weights are cast before they leave)
    assert client.server_dtype() == torch.float32
    rounded = reference_model(server.model_dir, seed=3).to(torch.bfloat16)
    sent = [(name, tensor.clone()) for name, tensor in rounded.state_dict().items()]  # bf16 (the tied head too)
    expected = reference_greedy(rounded.float(), PROMPTS, 8)  # the same weights, widened (.float() is in place)
    assert greedy(client) != expected
    client.update_weights(sent)
    assert greedy(client) == expected


def test_a_push_of_some_layers_keeps_the_others_and_part_of_a_layer_is_refused(client, server):
    """The server's reload (trainers_vllm_worker.LeanReload on CPU) loads what a push carries and keeps the rest:
    a layer nobody sent keeps its kernels; a layer sent in part (q without k and v) is refused by name, not run on a
    kernel built over uninitialized memory; a full push afterwards serves again."""
    before = reference_model(server.model_dir, seed=5)
    client.update_model_params(before)
    other = reference_model(server.model_dir, seed=6)
    layer_1 = {name: tensor for name, tensor in other.state_dict().items() if ".layers.1." in name}
    assert len(layer_1) >= 7  # q, k, v, o, gate, up, down (and the norms, biases)
    mixed = reference_model(server.model_dir, seed=5)
    mixed.load_state_dict(layer_1, strict=False)
    expected = reference_greedy(mixed, PROMPTS, 8)
    assert expected != reference_greedy(before, PROMPTS, 8)  # the test can fail: layer 1 matters to greedy
    client.update_weights(layer_1.items())
    assert greedy(client) == expected
    out = client.generate(PROMPTS, max_tokens=6, logprobs=0, generation_kwargs={"seed": 4, "ignore_eos": True})
    for prompt, completion, values in zip(PROMPTS, out["completion_ids"], out["logprobs"]):
        assert [v[0] for v in values] == pytest.approx(reference_logprobs(mixed, prompt, completion), abs=2e-3)

    q_alone = [(name, tensor) for name, tensor in other.state_dict().items() if name.endswith("0.self_attn.q_proj.weight")]
    with pytest.raises(VLLMServerError, match=r"part of their weights.*QKVParallelLinear"):
        client.update_weights(q_alone)
    client.update_model_params(before)
    assert greedy(client) == reference_greedy(before, PROMPTS, 8)

    # a trainer that dies after sending q alone leaves the update open: the next trainer's push closes it (the
    # refusal is not its error) and serves its own weights
    dead = VLLMClient(server.url, connection_timeout=5, group_port=free_port())
    dead.begin_weight_update()
    dead.update_named_params(q_alone)
    dead.abandon()
    successor = VLLMClient(server.url, connection_timeout=5, group_port=free_port())
    successor.update_model_params(mixed)
    assert greedy(successor) == expected
    successor.close()  # its group closed on the server: the module's client opens a new one at its next push
    client.close_communicator()
    client.update_model_params(before)
    assert greedy(client) == reference_greedy(before, PROMPTS, 8)


def get(server, path: str) -> str:
    """GET ``path`` with the server's key (routes beside the client's: vLLM's metrics, its pause state)."""
    key = os.environ.get(KEY_VARIABLE)
    request = urllib.request.Request(server.url + path, headers={"Authorization": f"Bearer {key}"} if key else {})
    with urllib.request.urlopen(request) as response:
        return response.read().decode()


def generated_tokens(server) -> float:
    """The server's count of tokens generated so far (vLLM's /metrics)."""
    lines = get(server, "/metrics").splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("vllm:generation_tokens_total"))


def test_a_request_in_flight_goes_on_across_a_paused_weight_update(client, server):
    """In-flight weight updates (asynchronous GRPO's default): a request of 1000 tokens on the token route is paused
    between two decode steps (begin_weight_update(pause=True)), the weights replaced and tagged, and the request
    resumed: it completes whole, its tokens tagged with the version before the push and then the one after (vLLM's
    weight-version spans), and the new weights serve (greedy equal to theirs)."""
    first, second = reference_model(server.model_dir, seed=5), reference_model(server.model_dir, seed=6)

    def push(model, version: int, pause: bool) -> None:
        client.begin_weight_update(pause=pause)
        client.update_named_params(model.state_dict().items())
        client.end_weight_update(version)

    push(first, 1, pause=False)
    for attempt in range(3):  # a request that ended before the push (vLLM's /metrics lag) is sent again
        answer: dict = {}
        request = threading.Thread(target=lambda: answer.update(client.generate_tokens(
            PROMPTS[0], n=1, seed=attempt, sampling_params={"max_tokens": 1000, "temperature": 1.0,
                                                            "ignore_eos": True, "logprobs": 0})))
        before = generated_tokens(server)
        request.start()
        deadline = time.monotonic() + 60
        while generated_tokens(server) < before + 20 and time.monotonic() < deadline:  # it is decoding
            time.sleep(0.05)
        if request.is_alive():
            break
        request.join()
    assert request.is_alive(), "the request ended before the push three times"
    push(second, 2, pause=True)
    request.join(timeout=120)
    splits = []
    for ids, versions, logprobs in zip(answer["completion_ids"], answer["versions"], answer["logprobs"]):
        assert len(ids) == len(versions) == len(logprobs) == 1000
        split = versions.index(2)
        assert 0 < split < 1000 and versions == [1] * split + [2] * (1000 - split)
        splits.append(split)
    print(f"\na request in flight across a push: tokens of version 1 up to {splits}, then version 2")
    assert greedy(client) == reference_greedy(second, PROMPTS, 8)
    # a push that paused the server and failed half-way leaves it paused: the next client to connect resumes it
    assert status_of(server.url + "/pause?mode=keep", "POST", os.environ.get(KEY_VARIABLE)) == 200
    assert json.loads(get(server, "/is_paused")) == {"is_paused": True}
    VLLMClient(server.url, connection_timeout=5).check_server(server.model_dir)
    assert json.loads(get(server, "/is_paused")) == {"is_paused": False}
    assert greedy(client) == reference_greedy(second, PROMPTS, 8)


def status_of(url: str, method: str, key: str | None) -> int:
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    request = urllib.request.Request(url, data=b"{}" if method != "GET" else None, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


def test_every_route_refuses_a_caller_without_the_key_and_changes_nothing(client, server):
    key = os.environ[KEY_VARIABLE]
    before = greedy(client)
    with urllib.request.urlopen(urllib.request.Request(server.url + "/openapi.json",
                                                       headers={"Authorization": f"Bearer {key}"})) as response:
        paths = json.loads(response.read())["paths"]
    routes = [(path.replace("{", "").replace("}", ""), method.upper()) for path, methods in paths.items()
              for method in methods]
    # the weight transfer and vLLM's development routes among them, and paths outside the schema
    assert {"/init_weight_transfer_engine", "/update_weights", "/pause", "/resume", "/health",
            "/v1/completions", "/inference/v1/generate"} <= {path for path, _ in routes}
    routes += [("/metrics", "GET"), ("/docs", "GET"), ("/no/such/route", "POST"),
               ("/trainers/weight_update", "POST")]  # ours (trainers_vllm_routes.py)
    answered = {(path, method): [status_of(server.url + path, method, wrong) for wrong in (None, "not-the-key")]
                for path, method in routes}
    assert {route: codes for route, codes in answered.items() if codes != [401, 401]} == {}
    print(f"\n{len(routes)} routes, each 401 without the key")
    assert greedy(client) == before  # nothing changed: not paused, weights as they were
    with pytest.raises(VLLMKeyError, match=f"{server.url}.*vllm_server_api_key"):
        VLLMClient(server.url, connection_timeout=5, api_key="")  # a trainer without the key: named, at once


def test_mismatched_model_is_detected_and_named(client, server):
    client.check_server(server.model_dir)  # the same folder
    client.check_server(os.path.relpath(server.model_dir) + "/")  # the same folder, spelled otherwise
    other = os.path.join(os.path.dirname(server.model_dir), "another-model")
    with pytest.raises(VLLMServerError) as error:
        client.check_server(other)
    message = str(error.value)
    assert server.url in message and repr(server.model_dir) in message and repr(other) in message
    assert "--served-model-name" in message


JOB = os.path.join(REPO, "tests", "integration", "vllm_server_job.py")
SYNC_OFF = range(3, 6)  # the job's: steps that sample without pushing the policy's weights first
IN_SYNC = 1e-5  # |log pi_server - log pi_policy| per token, float32 both (a stale step: ~1e-2)


def job(out, *args) -> dict:
    """tests/integration/vllm_server_job.py in its own process (with vLLM installed the trainer imports it)."""
    return run_job(JOB, *args, out, report=os.path.join(out, "report.json"))


TOGETHER = ["follow", "repeat", "rloo", "distill", "tools"]  # vllm_server_job.py's modes that share one process


@pytest.fixture(scope="module")
def together(server, tmp_path_factory):
    """``together(mode)``: the report of one of the TOGETHER modes, all run once for the module, one after the other
    in one process (each pushes its own weights to the server first), when a test first needs one."""
    return reports_of_one_job(JOB, TOGETHER, tmp_path_factory, against(server))


def test_a_served_teacher_with_the_whole_vocabulary_is_the_local_teacher(client, server, tmp_path):
    """The server holds a teacher (the tiny model moved by noise); distillation from it with loss_top_k = the
    vocabulary size logs the same loss as from the same teacher held locally (vLLM's float32 log-probs against the
    trainer's), and with loss_top_k=1 a smaller one (a coarser partition: a lower bound)."""
    from trainers import DistillationConfig, DistillationTrainer

    teacher = reference_model(server.model_dir, seed=7)
    client.update_model_params(teacher)
    vocabulary = teacher.config.vocab_size
    rows = [{"prompt": p} for p in ["abc", "hello", "xyz", "12", "the", "cat", "sat", "on"]]
    losses = {}
    for name, extra in (("local", {}), ("served", {"teacher_model_server_url": server.url, "loss_top_k": vocabulary}),
                        ("top-1", {"teacher_model_server_url": server.url, "loss_top_k": 1})):
        args = DistillationConfig(output_dir=str(tmp_path / name), per_device_train_batch_size=8,
                                  max_completion_length=6, learning_rate=1e-2, max_steps=1, beta=0.5,
                                  logging_steps=1, save_strategy="no", disable_tqdm=True, seed=0, report_to="none",
                                  **extra)
        trainer = DistillationTrainer(model=server.model_dir, teacher_model=None if extra else teacher, args=args,
                                      train_dataset=rows)
        trainer.train()
        losses[name] = trainer.state.log_history[0]["loss"]
    print(f"\nserved teacher: losses {losses}")
    assert losses["served"] == pytest.approx(losses["local"], rel=1e-4)
    assert 0 < losses["top-1"] < losses["served"]


def test_grpo_in_server_mode_learns_and_keeps_the_server_on_the_policy(together):
    """24 GRPO steps of the digits task against the server: the reward rises as with the lean engine (and in
    colocate mode); after every step's weight push the server's greedy completions equal the policy's own and
    the sampler's log-probs match the trainer's; during SYNC_OFF (the push switched off) both checks fail."""
    report = together("follow")
    rewards = {r["step"]: r["reward"] for r in report["records"]}
    assert rewards[1] < 0.1 and sum(rewards[s] for s in range(21, 25)) / 4 > 0.5, rewards
    diff = {r["step"] - 1: r["sampling/sampling_logp_difference/mean"] for r in report["records"]}  # by round step
    print(f"\nGRPO, server mode, 24 steps: {report['seconds']:.1f} s; per round step: log-prob difference {diff}, "
          f"greedy equal {[r['equal'] for r in report['rounds']]}")
    assert sorted(diff) == list(range(24))
    synced = [s for s in diff if s not in SYNC_OFF]
    assert all(diff[s] < IN_SYNC for s in synced), diff
    assert all(diff[s] > 100 * IN_SYNC for s in SYNC_OFF), diff  # a stale server is seen
    equal = {r["step"]: r["equal"] for r in report["rounds"]}
    assert all(equal[s] for s in synced), equal
    assert not all(equal[s] for s in SYNC_OFF), equal  # a stale server's greedy completions differ
    assert report["client_closed"]
    # evaluate() after train() connects again and samples from the trained policy (untrained: reward < 0.1)
    assert report["eval_reward"] > 0.3 and not report["closed_after_evaluate"]


def test_a_server_mode_run_repeats_exactly_with_its_seed(together):
    """Each completion is sampled with its own seed (from the run's seed, the step and the row): two runs with one
    seed against the same server (each pushes its initial weights) sample the same tokens and end with the same
    weights, however the server batches them; another seed samples others; a group's completions still differ."""
    report = together("repeat")
    first, again, other = report["weights"]
    assert first == again and first != other
    assert report["completions"][0] == report["completions"][1] != report["completions"][2]
    assert all(report["groups_vary"])


def test_rloo_in_server_mode_keeps_the_server_on_the_policy(together):
    """RLOOTrainer samples through the same server: after every step's weight push its greedy completions equal the
    policy's, its log-probs match the trainer's, and RLOO's round metrics are logged."""
    report = together("rloo")
    assert [r["equal"] for r in report["rounds"]] == [True] * 4
    assert all(r["sampling/sampling_logp_difference/mean"] < IN_SYNC for r in report["records"])
    assert all("kl" in r and "clip_ratio/region_mean" in r for r in report["records"])


def test_distillation_in_server_mode_keeps_the_server_on_the_student(together):
    """DistillationTrainer samples through the same server: after every step's weight push its greedy completions
    equal the student's (learning is test_distillation.py's). Its loss reads no log-probs of the round, so none
    are computed to compare with the server's (no sampling/* metrics, as TRL's distillation)."""
    report = together("distill")
    assert [r["equal"] for r in report["rounds"]] == [True] * 4
    assert not any(key.startswith("sampling/") for r in report["records"] for key in r)
    assert all(r["loss"] > 0 and not any(key.startswith("reward") for key in r) for r in report["records"])


def test_two_processes_share_the_server(server, tmp_path):
    """2-process DDP against one server: the main process sends both processes' prompts in one request and the
    weights once per step; each process gets its own completions, and after every push the server's greedy
    completions equal each process's policy."""
    launch("multi_gpu", JOB, "distributed", server.url, server.model_dir, str(free_port()), str(tmp_path),
           timeout=600)
    reports = rank_reports(tmp_path)
    assert [r["is_main_process"] for r in reports] == [True, False]
    for report in reports:
        assert [r["step"] for r in report["rounds"]] == [0, 1, 2] and all(r["equal"] for r in report["rounds"])
        # the trainer's log-probs come from its bf16 autocast forward (the template's), the server's from float32
        assert all(r["sampling/sampling_logp_difference/mean"] < 5e-3 for r in report["records"]), report["records"]
    assert reports[0]["client_closed"]
    # one round's records over both processes: the same metrics on each (they are reduced over the processes)
    assert [r["reward"] for r in reports[0]["records"]] == [r["reward"] for r in reports[1]["records"]]


def test_tool_loop_against_the_server(together):
    """The tool loop against the server (tests/integration/vllm_tool_rounds.py): the server continues each rollout
    from its tool result, with log-probs equal to the trainer's."""
    check_tool_rounds(together("tools"), IN_SYNC)


def test_server_dying_mid_training_stops_with_a_checkpoint(server, tmp_path):
    """The server is killed after step 2: the next step's weight push fails, and the run stops with a
    VLLMServerError naming the URL and a checkpoint of step 2, from which a run resumes with those weights."""
    report = job(tmp_path, "die", server.url, server.model_dir, free_port(), server.process.pid)
    print(f"\nserver killed after step 2: the run stopped {report['seconds_to_stop']:.1f} s after it started")
    message = report["error"]
    assert f"The vLLM server at {server.url} did not answer POST /trainers/weight_update" in message, message
    assert "Training stopped after step 2; checkpoint written to" in message and "checkpoint-2" in message
    assert report["steps_done"] == 2 and [r["step"] for r in report["rounds"]] == [0, 1]
    assert [c for c in report["checkpoints"] if c.startswith("checkpoint-")] == ["checkpoint-2"]
    assert report["client_closed"]
    assert report["resumed_weights_equal"] and report["resumed_steps"] == [1, 2, 3]
    assert group_members(server.process.pid) == []


def test_killed_server_is_a_clear_error_and_leaves_no_process(client, server):
    if group_members(server.process.pid):  # not killed yet by the training test above
        os.killpg(server.process.pid, signal.SIGKILL)  # the server dies mid-run (OOM killer, node lost)
    server.process.wait(timeout=30)
    with pytest.raises(VLLMServerError, match=f"The vLLM server at {server.url} did not answer POST /v1/completions"):
        client.generate(PROMPTS, max_tokens=4)
    with pytest.raises(VLLMServerError, match=server.url):
        client.update_model_params(reference_model(server.model_dir, seed=2))
    deadline = time.monotonic() + 10
    while group_members(server.process.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert group_members(server.process.pid) == []
