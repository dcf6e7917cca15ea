"""A route of our own on a ``trainers vllm-serve`` server for the trainer's weight pushes, in place of vLLM's pause,
start, update, finish, prefix-cache reset and resume routes: an ASGI middleware that vLLM's API server loads with
``--middleware trainers_vllm_routes.WeightRoutes`` (this folder is on the server's PYTHONPATH; the key's
middleware, when there is one, wraps it).

``POST /trainers/weight_update`` ``{"begin": bool, "pause": bool, "update_info": dict | None, "end": bool,
"weight_version": str | None, "resume": bool}`` does, in this order, the parts it is given:

- ``begin``: with ``pause``, the scheduler stops between two decode steps keeping its requests (vLLM's
  ``/pause?mode=keep`` without the 20 ms ``asyncio.sleep`` its ``pause_generation`` adds after it, which only
  orders output events for the caller's convenience); then ``start_weight_update`` (one left open by a push that
  failed half-way is finished first);
- ``update_info``: vLLM's ``update_weights`` with it (the transfer engine receives the tensors the trainer is
  sending meanwhile), as vLLM's own ``/update_weights``;
- ``end``: ``finish_weight_update`` (tagging the tokens sampled from here on with ``weight_version``), the prefix
  cache dropped (its KV was computed with the old weights) and, with ``resume``, the paused requests resumed.

The trainer's client (generation/vllm_client.py) sends a push as a request that begins, one per chunk of tensors
and one that ends. It answers ``{"ok": true}``, or HTTP 500 with ``{"error": ...}`` (the parts after the one that
failed are not done). Every other request goes to vLLM unchanged. Standard library and vLLM only (and the engine
the application holds): it runs in vLLM's environment.
"""

from __future__ import annotations

import json

from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

ROUTE = "/trainers/weight_update"


class WeightRoutes:
    """ASGI middleware: ``ROUTE`` (module docstring) answered here, from the application's engine."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] != ROUTE:
            await self.app(scope, receive, send)
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        engine = scope["app"].state.engine_client
        try:
            given = json.loads(body or b"{}")
            if given.get("begin"):
                await begin(engine, bool(given.get("pause")))
            if given.get("update_info") is not None:
                await update(engine, given["update_info"])
            if given.get("end"):
                await end(engine, given.get("weight_version"), bool(given.get("resume")))
            status, answer = 200, {"ok": True}
        except Exception as error:  # the trainer's client raises it, naming the server
            status, answer = 500, {"error": f"{scope['path']}: {type(error).__name__}: {error}"}
        payload = json.dumps(answer).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})


async def begin(engine, pause: bool) -> None:
    if pause:
        await engine.engine_core.pause_scheduler_async(mode="keep", clear_cache=False)
    try:
        await engine.start_weight_update()
    except Exception as error:
        if "already active" not in str(error):
            raise
        await finish_abandoned(engine)
        await engine.start_weight_update()


async def finish_abandoned(engine) -> None:
    """Close the update a push that failed or died half-way left open; its partial weights are overwritten by the
    update that follows. Its finish may refuse a layer the push sent in part (trainers_vllm_worker.LeanReload), which
    leaves vLLM's update open: that is not this trainer's error, and a second finish, with nothing left to load,
    closes it."""
    try:
        await engine.finish_weight_update(None)
    except Exception:
        await engine.finish_weight_update(None)


async def update(engine, update_info: dict) -> None:
    await engine.update_weights(request=WeightTransferUpdateRequest(update_info=update_info))


async def end(engine, version: str | None, resume: bool) -> None:
    await engine.finish_weight_update(None if version is None else str(version))
    await engine.reset_prefix_cache()
    if resume:
        await engine.resume_generation()
