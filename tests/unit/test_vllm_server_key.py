"""A `trainers vllm-serve` server only the trainer can drive, without vLLM: the default bind, the key's resolution
(given, from the environment, generated for a host others can reach), the middleware that guards every route
(called as vLLM's server calls it, an ASGI application), the trainer's client sending the key and naming the
option when it is refused, and the key masked where the config is written. The real server's routes refused
without the key: tests/integration/test_vllm_server.py."""

import asyncio
import http.server
import importlib.util
import json
import os
import threading

import pytest

from trainers import GRPOConfig
from trainers.generation import vllm_client, vllm_server

AUTH_FILE = os.path.join(vllm_server.WORKER_DIR, "trainers_vllm_auth.py")


def load_middleware():
    spec = importlib.util.spec_from_file_location("trainers_vllm_auth", AUTH_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parse(*argv):
    return vllm_server.build_parser().parse_known_args(["--model", "m", *argv])[0]


def test_the_server_listens_on_loopback_unless_told_and_needs_a_key_when_others_can_reach_it(capsys):
    args = parse()
    assert args.host == "127.0.0.1" and vllm_server.resolve_key(args, environ={}) == (None, False)
    assert vllm_server.resolve_key(parse("--api-key", "k1"), environ={}) == ("k1", False)
    assert vllm_server.resolve_key(parse("--api_key", "k1"), environ={"TRAINERS_VLLM_API_KEY": "k2"}) == ("k1", False)
    assert vllm_server.resolve_key(args, environ={"TRAINERS_VLLM_API_KEY": "k2"}) == ("k2", False)
    key, generated = vllm_server.resolve_key(parse("--host", "0.0.0.0"), environ={})
    assert generated and len(key) >= 32
    assert vllm_server.resolve_key(parse("--host", "0.0.0.0"), environ={})[0] != key  # drawn each time
    assert vllm_server.is_loopback("localhost") and vllm_server.is_loopback("::1")
    assert not vllm_server.is_loopback("10.0.0.5") and not vllm_server.is_loopback("node-3")


def test_a_key_puts_every_route_behind_the_middleware_and_travels_in_the_environment():
    args, extra = vllm_server.build_parser().parse_known_args(["--model", "m", "--api-key", "secret-1"])
    command = vllm_server.build_command(args, extra, "secret-1")
    # the key's middleware last, so it wraps every other (vLLM adds each outside the ones before)
    middleware = [command[i + 1] for i, flag in enumerate(command) if flag == "--middleware"]
    assert middleware == ["trainers_vllm_routes.WeightRoutes", "trainers_vllm_auth.RequireKey"]
    assert "secret-1" not in " ".join(command)  # never on the command line (ps shows it)
    assert "--api-key" not in command  # vLLM's own guards only /v1: ours replaces it
    env = vllm_server.build_env(args, base={"TRAINERS_VLLM_API_KEY": "stale"}, key="secret-1")
    assert env["TRAINERS_VLLM_API_KEY"] == "secret-1"
    unkeyed = vllm_server.build_command(args, extra, None)
    assert [unkeyed[i + 1] for i, flag in enumerate(unkeyed) if flag == "--middleware"] == [
        "trainers_vllm_routes.WeightRoutes"]
    assert "TRAINERS_VLLM_API_KEY" not in vllm_server.build_env(args, base={"TRAINERS_VLLM_API_KEY": "x"}, key=None)


def call(app, scope) -> list[dict]:
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    return sent


@pytest.mark.parametrize("path", ["/v1/completions", "/health", "/pause", "/update_weights",
                                  "/init_weight_transfer_engine", "/openapi.json", "/anything/else"])
def test_the_middleware_refuses_every_path_without_the_key(monkeypatch, path):
    monkeypatch.setenv("TRAINERS_VLLM_API_KEY", "right")
    reached = []

    async def app(scope, receive, send):
        reached.append(scope.get("path"))
        await send({"type": "http.response.start", "status": 200, "headers": []})

    guarded = load_middleware().RequireKey(app)
    for headers in ([], [(b"authorization", b"Bearer wrong")], [(b"authorization", b"Basic right")],
                    [(b"x-api-key", b"right")]):
        sent = call(guarded, {"type": "http", "method": "POST", "path": path, "headers": headers})
        assert sent[0]["status"] == 401 and b"vllm_server_api_key" in sent[1]["body"]
    assert reached == []  # no route ran
    assert call(guarded, {"type": "http", "method": "GET", "path": path,
                          "headers": [(b"authorization", b"Bearer right")]})[0]["status"] == 200
    assert call(guarded, {"type": "websocket", "path": path, "headers": []}) == [{"type": "websocket.close",
                                                                                   "code": 1008}]
    assert call(guarded, {"type": "lifespan"}) == [{"type": "http.response.start", "status": 200, "headers": []}]
    assert reached == [path, None]  # the request with the key, and the lifespan event


def test_the_middleware_will_not_start_without_a_key(monkeypatch):
    monkeypatch.delenv("TRAINERS_VLLM_API_KEY", raising=False)
    with pytest.raises(RuntimeError, match="TRAINERS_VLLM_API_KEY"):
        load_middleware().RequireKey(lambda *a: None)


class KeyedHandler(http.server.BaseHTTPRequestHandler):
    """/health answers 200 with the key 'right', 401 otherwise; records the Authorization header it got."""

    seen: list = []

    def do_GET(self):
        self.seen.append(self.headers.get("Authorization"))
        ok = self.headers.get("Authorization") == "Bearer right"
        self.send_response(200 if ok else 401)
        body = json.dumps({"data": [{"id": "m"}]} if ok else {"error": "Unauthorized"}).encode()
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def keyed_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), KeyedHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    KeyedHandler.seen = []
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_the_client_sends_the_key_and_a_refusal_names_the_server_and_the_option(keyed_server, monkeypatch):
    monkeypatch.delenv("TRAINERS_VLLM_API_KEY", raising=False)
    for key, said in ((None, "the trainer sent none"), ("wrong", "was not its key")):
        with pytest.raises(vllm_client.VLLMKeyError) as error:
            vllm_client.VLLMClient(keyed_server, connection_timeout=30, api_key=key)  # refused at once, no wait
        message = str(error.value)
        assert keyed_server in message and "HTTP 401" in message and said in message
        assert "vllm_server_api_key" in message and "TRAINERS_VLLM_API_KEY" in message
    assert len(KeyedHandler.seen) == 2  # one request each: a refusal is not waited out
    client = vllm_client.VLLMClient(keyed_server, connection_timeout=5, api_key="right")
    assert client.served_model() == "m" and set(KeyedHandler.seen[2:]) == {"Bearer right"}
    monkeypatch.setenv("TRAINERS_VLLM_API_KEY", "right")  # the same variable as the server's
    assert vllm_client.VLLMClient(keyed_server, connection_timeout=5).api_key == "right"


def test_the_key_is_masked_where_the_config_is_written(tmp_path):
    args = GRPOConfig(output_dir=str(tmp_path), vllm_server_api_key="secret-2")
    assert "secret-2" not in json.dumps(args.to_dict())
    assert args.to_dict()["vllm_server_api_key"] == "<VLLM_SERVER_API_KEY>"
    assert args.vllm_server_api_key == "secret-2"  # the config itself keeps it
