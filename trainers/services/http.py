"""The small JSON-over-HTTP layer under ``trainers sandbox-serve`` and ``trainers reward-serve`` (trainers/cli/), and
their client (the remote executor, the remote reward model).

Server: ``POST <route>`` with a JSON body, a JSON answer; ``GET /health``. With a key, every request (``/health``
too) must carry ``Authorization: Bearer KEY`` or gets 401. Loopback (127.0.0.1) unless told otherwise. Threaded:
requests run concurrently (what a request may run at once is the handler's business: the sandbox's pool, the
reward model's lock).

Client: ``post_json`` raises ``RemoteServiceError`` naming the URL for anything but a JSON answer with 200 (the
server unreachable, a timeout, a wrong key, the server's own error), so the trainer stops with a checkpoint.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import os
import secrets
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from trainers.errors import RemoteServiceError

MAX_BODY = 256 << 20  # bytes of one request


class JsonServer:
    """Serves ``routes`` ({"/run": handler(payload) -> dict}) on ``host:port`` behind ``api_key`` (None: no key).
    A handler raising ValueError answers 400 with its message; anything else 500."""

    def __init__(self, routes: dict[str, Callable[[dict], dict]], host: str, port: int, api_key: str | None,
                 name: str):
        self.routes, self.api_key, self.name = routes, api_key, name
        self.httpd = ThreadingHTTPServer((host, port), self._handler())
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet: a trainer's requests would flood the terminal
                pass

            def _answer(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _authorized(self) -> bool:
                if server.api_key is None:
                    return True
                given = self.headers.get("Authorization", "")
                if hmac.compare_digest(given.encode(), f"Bearer {server.api_key}".encode()):
                    return True
                self._answer(401, {"error": f"{server.name}: a key is required (Authorization: Bearer KEY)"})
                return False

            def do_GET(self):
                if not self._authorized():
                    return
                if self.path == "/health":
                    self._answer(200, {"status": "ok", "service": server.name})
                else:
                    self._answer(404, {"error": f"no route GET {self.path}"})

            def do_POST(self):
                if not self._authorized():
                    return
                handler = server.routes.get(self.path)
                if handler is None:
                    self._answer(404, {"error": f"no route POST {self.path}; routes: {sorted(server.routes)}"})
                    return
                length = int(self.headers.get("Content-Length") or 0)
                if length > MAX_BODY:
                    self._answer(413, {"error": f"request over {MAX_BODY} bytes"})
                    return
                try:
                    payload = json.loads(self.rfile.read(length) or b"{}")
                    self._answer(200, handler(payload))
                except ValueError as error:  # a request the handler cannot take (json's errors are ValueErrors)
                    self._answer(400, {"error": str(error)})
                except Exception as error:  # noqa: BLE001 -- the server stays up; the client is told
                    self._answer(500, {"error": f"{type(error).__name__}: {error}"})

        return Handler

    def serve_forever(self) -> None:
        """Serve until interrupted; the socket is closed when it stops."""
        try:
            self.httpd.serve_forever()
        finally:
            self.httpd.server_close()


def is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this machine alone (a host name other than localhost: assume not). As
    trainers/generation/vllm_server.py's, which must stay free of the package (it runs in vLLM's environment)."""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def server_key(host: str, api_key: str | None, variable: str) -> tuple[str | None, bool]:
    """(a server's key, whether it was generated): ``api_key``, else the environment's ``variable``, else on a host
    that is not a loopback address a new one (none on a loopback host: only this machine can reach it)."""
    key = api_key or os.environ.get(variable) or None
    if key is None and not is_loopback(host):
        return secrets.token_urlsafe(24), True
    return key, False


def add_server_arguments(parser, port: int, variable: str) -> None:
    """--host (loopback by default), --port and --api-key, as ``trainers vllm-serve`` has them."""
    parser.add_argument("--host", default="127.0.0.1", help="The address to listen on. Default 127.0.0.1 (this "
                        "machine only); 0.0.0.0 for trainers on other machines, which needs a key.")
    parser.add_argument("--port", type=int, default=port, help=f"The port (default {port}; 0: any free one).")
    parser.add_argument("--api-key", "--api_key", dest="api_key", default=None,
                        help=f"The key every request must carry (Authorization: Bearer KEY). Default: {variable}; "
                             f"with neither, none on a loopback host, one generated and printed otherwise.")


def serve(command: str, cli, build_server: Callable, variable: str) -> int:
    """``trainers <command>``: the key (``server_key``), the server (``build_server(cli, key)``), what it prints
    when it starts (where it listens and, for a generated key, the key), then serve until interrupted."""
    key, generated = server_key(cli.host, cli.api_key, variable)
    server = build_server(cli, key)
    if generated:
        print(f"[trainers {command}] {cli.host} is reachable from other machines and no key was given: every "
              f"request must carry this one. Give it to the trainer as {variable}:\n{variable}={key}", flush=True)
    print(f"[trainers {command}] serving on http://{cli.host}:{server.port} "
          f"({'a key is required' if key else 'no key'})", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


def post_json(url: str, route: str, payload: dict, api_key: str | None, timeout: float, what: str) -> dict:
    """POST ``payload`` to ``url + route``; the JSON answer, or a RemoteServiceError naming ``what`` and the URL."""
    request = urllib.request.Request(url.rstrip("/") + route, data=json.dumps(payload).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return json.loads(answer.read())
    except urllib.error.HTTPError as error:
        try:
            message = json.loads(error.read()).get("error", "")
        except (ValueError, OSError):
            message = ""
        hint = " (give the server's key)" if error.code == 401 else ""
        raise RemoteServiceError(f"The {what} at {url} answered {route} with HTTP {error.code}{hint}: "
                                 f"{message}") from error
    except (urllib.error.URLError, OSError, ValueError) as error:  # refused, reset, timed out, not JSON
        reason = getattr(error, "reason", error)
        raise RemoteServiceError(f"The {what} at {url} did not answer {route} within {timeout:g} s: "
                                 f"{type(reason).__name__}: {reason}") from error
