"""`trainers vllm-serve`'s command line and environment, and VLLMClient's checks that need no server (no vLLM
needed: the real server is tests/integration/test_vllm_server.py)."""

import ast
import http.server
import json
import math
import os
import sys
import threading

import pytest
import torch

from tests.conftest import free_port
from trainers.errors import VLLMServerError
from trainers.generation import vllm_answers, vllm_client, vllm_server, weight_transport

WORKER_FILE = os.path.join(vllm_server.WORKER_DIR, "trainers_vllm_worker.py")


def command(*argv):
    args, extra = vllm_server.build_parser().parse_known_args(list(argv))
    return args, vllm_server.build_command(args, extra)


def flag(cmd, name):
    return cmd[cmd.index(name) + 1]


def test_command_runs_the_api_server_with_our_transfer_engine(tmp_path):
    _, cmd = command("--model", str(tmp_path), "--port", "8123", "--tensor-parallel-size", "2",
                        "--max_model_len", "512", "--enforce_eager", "--seed", "3")
    assert cmd[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    assert flag(cmd, "--model") == str(tmp_path)
    assert flag(cmd, "--port") == "8123" and flag(cmd, "--tensor-parallel-size") == "2"
    assert flag(cmd, "--max-model-len") == "512" and "--enforce-eager" in cmd
    assert flag(cmd, "--worker-extension-cls") == "trainers_vllm_worker.TrainersWorkerExtension"
    assert json.loads(flag(cmd, "--weight-transfer-config")) == {"backend": "trainers_gloo"}
    assert flag(cmd, "--logprobs-mode") == "processed_logprobs" and flag(cmd, "--max-logprobs") == "-1"
    assert "--enable-scale-out" in cmd  # the token route: each token's weight version (in-flight weight updates)
    assert cmd[-2:] == ["--seed", "3"]  # a flag vllm-serve does not know goes to vLLM as is
    # TRL's spellings: underscores and dashes are the same option
    _, same = command("--model", str(tmp_path), "--port", "8123", "--tensor_parallel_size", "2",
                      "--max-model-len", "512", "--enforce-eager", "--seed", "3")
    assert same == cmd


def test_environment_exposes_only_the_worker_module(tmp_path):
    args, _ = command("--model", str(tmp_path))
    env = vllm_server.build_env(args, base={"PYTHONPATH": "/elsewhere"})
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
    assert env["PYTHONPATH"].split(os.pathsep) == [vllm_server.WORKER_DIR, "/elsewhere"]
    # the folder on the server's path holds modules with unique names, never the trainers package
    assert sorted(n for n in os.listdir(vllm_server.WORKER_DIR) if n.endswith(".py")) == [
        "trainers_vllm_auth.py", "trainers_vllm_routes.py", "trainers_vllm_worker.py"]
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"  # CPU: 1 GiB of KV cache, not a fraction of host RAM
    args, _ = command("--model", str(tmp_path), "--cpu_kvcache_space", "3")
    assert vllm_server.build_env(args, base={})["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert vllm_server.build_env(args, base={"VLLM_CPU_KVCACHE_SPACE": "5"})["VLLM_CPU_KVCACHE_SPACE"] == "5"


def test_model_and_python_are_checked_before_starting(tmp_path, monkeypatch):
    from trainers.cli import main as cli

    relative = os.path.relpath(tmp_path)
    assert vllm_server.resolve_model(relative) == str(tmp_path)  # the name /v1/models reports: absolute
    assert vllm_server.resolve_model("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"  # a Hub id
    with pytest.raises(SystemExit, match="'/no/such/model': no such folder"):
        cli.main(["vllm-serve", "--model", "/no/such/model"])
    with pytest.raises(SystemExit, match="--python '/no/python': no such file"):
        cli.main(["vllm-serve", "--model", str(tmp_path), "--python", "/no/python"])
    started = []
    monkeypatch.setattr(os, "execve", lambda path, argv, env: started.append((path, argv, env)))
    cli.main(["vllm-serve", "--model", str(tmp_path), "--port", "8124"])
    (path, argv, env), = started
    assert path == sys.executable and flag(argv, "--port") == "8124" and env["VLLM_SERVER_DEV_MODE"] == "1"


def imported_modules(path):
    with open(path) as f:
        tree = ast.parse(f.read())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_server_side_needs_neither_the_trainers_package_nor_its_dependencies():
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    assert imported_modules(vllm_server.__file__) <= stdlib
    assert imported_modules(WORKER_FILE) <= stdlib | {"torch", "vllm"}
    assert imported_modules(os.path.join(vllm_server.WORKER_DIR, "trainers_vllm_auth.py")) <= stdlib
    routes_file = os.path.join(vllm_server.WORKER_DIR, "trainers_vllm_routes.py")
    assert imported_modules(routes_file) <= stdlib | {"vllm"}
    # the names both sides must agree on
    worker, routes = constants(WORKER_FILE), constants(routes_file)
    assert worker["ENGINE_NAME"] == vllm_server.ENGINE_NAME == weight_transport.GLOO_ENGINE
    assert worker["STORE_PREFIX"] == weight_transport.STORE_PREFIX
    assert routes["ROUTE"] == vllm_client.WEIGHT_ROUTE


def constants(path: str) -> dict:
    """A module's top-level NAME = constant assignments, read without importing it (it needs vLLM)."""
    with open(path) as f:
        body = ast.parse(f.read()).body
    return {node.targets[0].id: node.value.value for node in body
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)}


def test_unreachable_server_is_an_error_naming_the_url():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(VLLMServerError) as error:
        vllm_client.VLLMClient(url, connection_timeout=0.5)
    assert url in str(error.value) and "cannot be reached" in str(error.value)
    assert "trainers vllm-serve" in str(error.value) and "vllm_server_base_url" in str(error.value)
    with pytest.raises(VLLMServerError, match="'localhost:8000' must look like http://host:port"):
        vllm_client.VLLMClient("localhost:8000")


def test_logprobs_are_parsed_as_trl_parses_them():
    payload = {"tokens": ["token_id:7", "token_id:9"], "token_logprobs": [-2.0, float("nan")],
               "top_logprobs": [{"token_id:3": -0.5, "token_id:7": -2.0}, {"token_id:4": -0.1}]}
    values, ids = vllm_answers.parse_logprobs([payload])
    assert ids == [[[3, 7], [4, 9]]]  # by descending probability, the sampled token always there
    assert values == [[[-0.5, -2.0], [-0.1, None]]]  # NaN (a token vLLM could not score) -> None
    assert vllm_answers.parse_logprobs([None]) == (None, None)
    assert not math.isnan(values[0][0][0])


def test_the_token_routes_answers_are_read_into_the_same_shapes_and_each_tokens_version():
    """/inference/v1/generate (in-flight weight updates): its log-probs as parse_logprobs gives them, and vLLM's
    weight-version spans as one version per token (vLLM's "default", before any tagged update: None)."""
    payload = {"content": [{"token_id": 7, "logprob": -2.0, "top_logprobs": [{"token_id": 3, "logprob": -0.5}]},
                           {"token_id": 9, "logprob": float("nan"), "top_logprobs": []}]}
    assert vllm_answers.parse_token_logprobs([payload]) == ([[[-0.5, -2.0], [None]]], [[[3, 7], [9]]])
    assert vllm_answers.parse_token_logprobs([None]) == (None, None)
    spans = [{"version": "default", "start": 0, "end": 1}, {"version": "3", "start": 1, "end": 4},
             {"version": "4", "start": 4, "end": 6}]
    assert vllm_answers.token_versions(spans, 6) == [None, 3, 3, 3, 4, 4]
    assert vllm_answers.token_versions(None, 2) == [None, None]


def test_version_spans_are_runs_of_one_version_and_the_table_shows_where_they_change():
    from trainers.sampling.metrics import spans_text
    from trainers.sampling.rollout import version_spans

    assert version_spans([3, 3, 4, None, 4]) == [[3, 0, 2], [4, 2, 3], [None, 3, 4], [4, 4, 5]]
    assert spans_text(version_spans([3, 3, 4, None, 4])) == "3>4@2"
    assert spans_text(version_spans([5, 5])) == "5" and spans_text([]) == "-"


def test_same_model_compares_folders_by_path(tmp_path):
    assert vllm_client.same_model(str(tmp_path), os.path.relpath(tmp_path) + "/")
    assert vllm_client.same_model("Qwen/Qwen2.5-0.5B", "Qwen/Qwen2.5-0.5B")
    assert not vllm_client.same_model("Qwen/Qwen2.5-0.5B", "Qwen/Qwen2.5-1.5B")
    assert not vllm_client.same_model(str(tmp_path), str(tmp_path / "other"))


def test_the_transport_follows_the_servers_device():
    """--weight_transfer auto: vLLM's NCCL engine when the server's Python sees a CUDA device, else our gloo engine;
    given, as given."""
    args, _ = command("--model", "m")
    assert vllm_server.resolve_transfer(args, has_cuda=lambda: True) == "nccl"
    assert vllm_server.resolve_transfer(args, has_cuda=lambda: False) == "gloo"
    args, cmd = command("--model", "m", "--weight_transfer", "nccl")
    assert vllm_server.resolve_transfer(args, has_cuda=lambda: False) == "nccl"
    assert json.loads(flag(cmd, "--weight-transfer-config")) == {"backend": "nccl"}
    _, cmd = command("--model", "m", "--weight_transfer", "gloo")
    assert json.loads(flag(cmd, "--weight-transfer-config")) == {"backend": weight_transport.GLOO_ENGINE}


class EngineHandler(http.server.BaseHTTPRequestHandler):
    """A server that answers the client's checks, its weight transfer engine ``backend``."""

    backend = "nccl"

    def do_GET(self):
        answers = {"/health": {}, "/v1/models": {"data": [{"id": "m"}]}, "/is_paused": {"is_paused": False},
                   "/server_info": {"vllm_config": {"weight_transfer_config": {"backend": self.backend}}}}
        body = json.dumps(answers[self.path.split("?")[0]]).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a trainer without a CUDA device")
def test_a_server_taking_weights_over_nccl_is_refused_by_a_trainer_without_cuda_naming_the_way_out():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), EngineHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        for backend, said in (("nccl", "takes weights over NCCL .* no CUDA device.* --weight_transfer gloo"),
                              ("other", "has weight transfer 'other', not one of")):
            EngineHandler.backend = backend
            with pytest.raises(VLLMServerError, match=said):
                vllm_client.VLLMClient(url, connection_timeout=5).check_server("m")
    finally:
        server.shutdown()
