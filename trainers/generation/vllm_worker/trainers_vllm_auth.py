"""Every route of a ``trainers vllm-serve`` server behind its key: an ASGI middleware that vLLM's API server loads
with ``--middleware trainers_vllm_auth.RequireKey`` (this folder is on the server's PYTHONPATH), which
``trainers vllm-serve`` adds when the server has a key (--api-key, TRAINERS_VLLM_API_KEY, or one it generated).

vLLM's own ``--api-key`` guards only ``/v1/*`` and a few other prefixes: ``/pause``, ``/resume``, the weight-transfer
routes (``/init_weight_transfer_engine``, ``/update_weights``, ...) and the other development routes answer without
it. This middleware wraps the whole application, so every request, whatever its path or method, needs
``Authorization: Bearer <key>``; one without it gets 401 before any route runs (a websocket is closed before it is
accepted). The key reaches the server in the environment, never on its command line (which ``ps`` shows).

Standard library only: it runs inside vLLM's environment, which may not have the ``trainers`` package.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os

KEY_VARIABLE = "TRAINERS_VLLM_API_KEY"  # trainers.generation.vllm_server.KEY_VARIABLE


class RequireKey:
    """ASGI middleware: a request passes only with ``Authorization: Bearer <the server's key>``."""

    def __init__(self, app) -> None:
        key = os.environ.get(KEY_VARIABLE)
        if not key:  # loaded without a key: refusing every request would look like a wrong key to the trainer
            raise RuntimeError(f"trainers_vllm_auth.RequireKey needs the server's key in {KEY_VARIABLE}.")
        self.app = app
        self.digest = hashlib.sha256(key.encode()).digest()

    def allowed(self, headers: list[tuple[bytes, bytes]]) -> bool:
        for name, value in headers:
            if name.lower() == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                given = hashlib.sha256(token.strip().encode()).digest()
                return scheme.lower() == "bearer" and hmac.compare_digest(given, self.digest)
        return False

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket") or self.allowed(scope.get("headers", [])):
            await self.app(scope, receive, send)  # lifespan events, and requests with the key
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})  # policy violation, before it is accepted
            return
        body = json.dumps({"error": "Unauthorized: this server needs its key (Authorization: Bearer <key>); "
                                    "the trainer sends it from vllm_server_api_key or TRAINERS_VLLM_API_KEY."}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
