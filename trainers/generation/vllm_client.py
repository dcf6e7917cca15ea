"""The trainer's side of ``vllm_mode="server"``: a client of the server ``trainers vllm-serve`` starts.

``VLLMClient`` has TRL's names and contracts (``generate(...) -> {"prompt_ids", "completion_ids", "logprobs",
"logprob_token_ids"}``, ``update_named_param``, ``update_model_params``, ``weight_update()``, ``reset_prefix_cache``)
and is ``trainer.vllm_generation.vllm_client`` as in TRL 1.16. It differs where TRL's does not work on CPU:

- weights travel over a gloo process group of their own (rank 0 here, the server's workers after it; rendezvous on a
  TCPStore this process hosts at ``group_port``, GRPOConfig.vllm_group_port) into the transfer engine that
  ``trainers vllm-serve`` registers in the server (trainers/generation/vllm_worker/trainers_vllm_worker.py), which reloads
  them layer-wise in place. TRL's client needs NCCL (a CUDA device) for this;
- ``update_model_params`` sends the full state dict: a tied output head is not among ``named_parameters()``, and
  without it the engine's head would silently keep the old weights;
- every failure is a ``VLLMServerError`` naming the server's URL (unreachable, another model, dead mid-run), so
  the trainer can stop with a checkpoint instead of a bare connection error;
- it needs only torch and the standard library (no ``requests``, no vLLM in the trainer's environment).
"""

from __future__ import annotations

import json
import math
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, FIRST_EXCEPTION, Future, wait
from contextlib import contextmanager
from datetime import timedelta
from http.client import HTTPException

import torch

from trainers.errors import VLLMServerError
from trainers.generation.vllm_answers import (finite_or_minus_inf, parse_logprobs, parse_token_logprobs,
                                             token_versions)
from trainers.generation.weight_transport import NCCL_ENGINE, TRANSPORTS, nccl_refusal
from trainers.generation.weight_wire import in_thread, local_address, wire_tensor

START_HINT = "start it with `trainers vllm-serve --model MODEL --port PORT` (docs/grpo.md, Server mode)"
WEIGHT_ROUTE = "/trainers/weight_update"  # trainers_vllm_routes.ROUTE, `trainers vllm-serve`'s own
FAILED_SEND_GRACE_S = 30.0  # how long a failed update waits for its sending thread to leave gloo
KEY_VARIABLE = "TRAINERS_VLLM_API_KEY"  # the server's key when none is given (vllm_server.KEY_VARIABLE)


class VLLMKeyError(VLLMServerError):
    """The server refused the trainer's key (HTTP 401): not a server that is down, so never waited for."""


class VLLMServerDown(VLLMServerError):
    """The server did not answer (refused, reset, timed out) or failed inside (HTTP 5xx): with several servers,
    the others take its requests (generation/vllm_servers.py). A request it refused (another 4xx) is not this."""


class VLLMClient:
    """A vLLM server started by ``trainers vllm-serve``: generation, and weight updates from the trainer.

    Args:
        base_url: the server's URL (``http://host:port``); when given, ``host`` and ``server_port`` are unused.
        host, server_port: the server's address otherwise.
        group_port: the port of the weight-transfer rendezvous this process hosts (it must be free here and
            reachable from the server).
        connection_timeout: seconds to wait for the server to answer before it is an error.
        transfer_timeout: seconds a weight-transfer rendezvous or tensor may wait for the other side.
        request_timeout: seconds an HTTP request may wait for the server's bytes (None: no limit, as TRL).
        api_key: the key the server was started with (``trainers vllm-serve --api-key``), sent with every request;
            None: the environment variable TRAINERS_VLLM_API_KEY, else none.
    """

    def __init__(self, base_url: str | None = None, host: str = "0.0.0.0", server_port: int = 8000,
                 group_port: int = 51216, connection_timeout: float = 0.0, transfer_timeout: float = 300.0,
                 request_timeout: float | None = None, api_key: str | None = None):
        if base_url is not None:
            parsed = urllib.parse.urlparse(base_url)
            if parsed.scheme not in ("http", "https") or not parsed.hostname:
                raise VLLMServerError(f"vllm_server_base_url {base_url!r} must look like http://host:port.")
            self.base_url = base_url.rstrip("/")
            self.host = parsed.hostname
            self.server_port = parsed.port or (443 if parsed.scheme == "https" else 80)
        else:
            self.host, self.server_port = host, server_port
            self.base_url = f"http://{host}:{server_port}"
        self.group_port = group_port
        self.transfer_timeout = transfer_timeout
        self.request_timeout = request_timeout
        self.api_key = api_key if api_key is not None else os.environ.get(KEY_VARIABLE) or None
        self._transport = None  # the open weight-transfer group (generation/weight_transport.py), if any
        self._in_update = False  # inside weight_update()
        self._paused = False  # begin_weight_update(pause=True) paused the server's requests; end_weight_update resumes
        # the update's chunks sent and still loading on the server: (request, transfer, what) each
        self._loading: list[tuple[Future, Future, str]] = []
        self._server_dtype: torch.dtype | None | bool = None  # server_dtype(): None until read, False if unknown
        # (name, version) of the adapter requests name (vllm_lora_sync: generation/vllm_lora.py); None: the base model
        self.adapter: tuple[str, int | None] | None = None
        self._adapters: list[str] = []  # the adapters this client loaded and has not unloaded, oldest first
        self.wait_for_server(connection_timeout)
        self.model = self.served_model()

    # ---- HTTP ----

    def _request(self, method: str, path: str, body: dict | None = None, params: dict | None = None) -> dict:
        url = self.base_url + path + ("?" + urllib.parse.urlencode(params) if params else "")
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(url, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=self.request_timeout) as response:
                payload = response.read()
        except urllib.error.HTTPError as error:  # the server answered with an error status
            if error.code == 401:
                given = ("the key the trainer sent was not its key" if self.api_key else
                         "the trainer sent none")
                raise VLLMKeyError(f"The vLLM server at {self.base_url} refused {method} {path} (HTTP 401): it was "
                                   f"started with a key (trainers vllm-serve --api-key, or one it generated and "
                                   f"printed) and {given}. Set vllm_server_api_key (or the environment variable "
                                   f"{KEY_VARIABLE}) to the server's key.") from None
            detail = error.read().decode(errors="replace")[:2000]
            raise (VLLMServerDown if error.code >= 500 else VLLMServerError)(f"The vLLM server at {self.base_url} answered {method} {path} with HTTP "
                                  f"{error.code}: {detail}") from error
        except (urllib.error.URLError, HTTPException, OSError) as error:  # refused, reset, timed out, closed
            reason = getattr(error, "reason", None) or error
            raise VLLMServerDown(f"The vLLM server at {self.base_url} did not answer {method} {path}: {reason}. "
                                  f"Is it still running? (its log says why it stopped)") from error
        if not payload:
            return {}
        try:
            return json.loads(payload)
        except ValueError:  # vLLM's LoRA routes answer in plain text
            return {"text": payload.decode(errors="replace")}

    def _get(self, path: str, params: dict | None = None) -> dict:
        return self._request("GET", path, params=params)

    def _post(self, path: str, body: dict | None = None, params: dict | None = None) -> dict:
        return self._request("POST", path, body if body is not None else {}, params)

    # ---- the server ----

    def wait_for_server(self, timeout: float = 0.0, retry_interval: float = 1.0) -> None:
        """Return once ``/health`` answers; after ``timeout`` seconds without an answer, a VLLMServerError."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._get("/health")
                return
            except VLLMKeyError:
                raise  # it answered: waiting will not change the key
            except VLLMServerError as error:
                if time.monotonic() >= deadline:
                    raise VLLMServerError(f"The vLLM server at {self.base_url} cannot be reached (waited "
                                          f"{timeout:g} s: {getattr(error.__cause__, 'reason', error.__cause__)}); {START_HINT}, and point "
                                          f"the trainer at it (vllm_server_base_url, or vllm_server_host and "
                                          f"vllm_server_port).") from None
            time.sleep(min(retry_interval, max(0.0, deadline - time.monotonic())))

    def served_model(self) -> str:
        """The model the server serves, as /v1/models names it (its --model, or --served-model-name)."""
        models = self._get("/v1/models").get("data") or []
        if not models:
            raise VLLMServerError(f"The vLLM server at {self.base_url} serves no model (/v1/models is empty).")
        return models[0]["id"]

    def check_server(self, expected_model: str | None = None) -> None:
        """Before training: the server answers, serves ``expected_model`` (the trainer's model: a Hub id or a
        folder) and can take weight updates; one left paused (an in-flight push that failed half-way, this run's or
        a trainer's that died) is resumed. Each failure is a VLLMServerError that names the URL."""
        self.wait_for_server(0.0)
        served = self.served_model()
        if expected_model is not None and not same_model(served, expected_model):
            raise VLLMServerError(
                f"The vLLM server at {self.base_url} serves {served!r}, but the trainer trains {expected_model!r}: "
                f"restart the server with --model {expected_model} (or, for the same model under another name, "
                f"pass vLLM's --served-model-name {expected_model}).")
        refusal = nccl_refusal(self.base_url) if self.transfer_engine() == NCCL_ENGINE else None
        if refusal is not None:  # said now, not at the first push
            raise refusal
        if self._get("/is_paused").get("is_paused"):  # left paused by a push that failed half-way (in flight)
            self._post("/resume")

    def get_server_info(self) -> dict:
        """The server's resolved VllmConfig (dev mode's /server_info)."""
        try:
            return self._get("/server_info", {"config_format": "json"})["vllm_config"]
        except VLLMServerError as error:
            if "HTTP 404" in str(error):
                raise VLLMServerError(
                    f"The vLLM server at {self.base_url} does not expose its development endpoints (weight "
                    f"updates need VLLM_SERVER_DEV_MODE=1): {START_HINT}.") from None
            raise

    def lora_config(self) -> dict | None:
        """The server's LoRA settings (``max_lora_rank``, ``max_loras``, ...): None unless started with
        --enable-lora."""
        return self.get_server_info().get("lora_config")

    def load_adapter(self, adapter, keep: int = 2) -> None:
        """Serve ``adapter`` (generation/vllm_lora.py's ``Adapter``: a name, the folder of its files, its version):
        the requests from here on name it, and their tokens carry its version; of the adapters this client loaded,
        the newest ``keep`` stay loaded (requests in flight keep theirs in any case). Needs a server started with
        --enable-lora, and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 in its environment (`trainers vllm-serve` sets it)."""
        try:
            self._post("/v1/load_lora_adapter", {"lora_name": adapter.name, "lora_path": adapter.path})
        except VLLMServerError as error:
            if "HTTP 404" in str(error) and "load_lora_adapter" in str(error) and "Not Found" in str(error):
                raise VLLMServerError(f"The vLLM server at {self.base_url} cannot load adapters at run time: start "
                                      f"it with `trainers vllm-serve ... --enable-lora`, which sets "
                                      f"VLLM_ALLOW_RUNTIME_LORA_UPDATING=1.") from None
            raise
        self.adapter = (adapter.name, adapter.version)
        self._adapters.append(adapter.name)
        while len(self._adapters) > keep:
            self._post("/v1/unload_lora_adapter", {"lora_name": self._adapters.pop(0)})

    def get_world_size(self) -> int:
        """The server's workers (tensor x pipeline x data parallel)."""
        return int(self._get("/get_world_size")["world_size"])

    def reset_prefix_cache(self) -> None:
        """Drop cached prompt KV (computed with the previous weights)."""
        self._post("/reset_prefix_cache")

    # ---- generation ----

    def generate(self, prompts: list[str] | list[list[int]], n: int = 1, repetition_penalty: float = 1.0,
                 temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0,
                 max_tokens: int = 16, logprobs: int | None = 0, structured_outputs_regex: str | None = None,
                 generation_kwargs: dict | None = None) -> dict[str, list]:
        """Completions for ``prompts`` (texts or token-id lists), ``n`` per prompt, as TRL's ``VLLMClient.generate``.

        Returns ``prompt_ids`` (one row per prompt), ``completion_ids`` (``n`` rows per prompt, prompt-major),
        ``logprobs`` and ``logprob_token_ids`` ([row][token][k], by descending probability: with ``logprobs=0``
        the sampled token's alone, with N > 0 the top N and the sampled token among them or added; None when
        ``logprobs=None``).
        """
        body = {
            "model": self.adapter[0] if self.adapter else self.model, "prompt": list(prompts), "n": n, "repetition_penalty": repetition_penalty,
            "temperature": temperature, "top_p": top_p, "top_k": top_k, "min_p": min_p, "max_tokens": max_tokens,
            "logprobs": logprobs, "return_token_ids": True, "return_tokens_as_token_ids": True,
        }
        if structured_outputs_regex is not None:
            body["structured_outputs"] = {"regex": structured_outputs_regex}
        body.update(generation_kwargs or {})
        choices = sorted(self._post("/v1/completions", body)["choices"], key=lambda choice: choice["index"])
        if len(choices) != len(prompts) * n:
            raise VLLMServerError(f"The vLLM server at {self.base_url} returned {len(choices)} completions for "
                                  f"{len(prompts)} prompts x n={n}.")
        values, token_ids = parse_logprobs([choice.get("logprobs") for choice in choices])
        return {
            "prompt_ids": [choice["prompt_token_ids"] for choice in choices[::n]],
            "completion_ids": [choice["token_ids"] for choice in choices],
            "logprobs": values,
            "logprob_token_ids": token_ids,
        }

    def generate_tokens(self, prompt_ids: list[int], n: int = 1, seed: int | None = None,
                        sampling_params: dict | None = None) -> dict[str, list]:
        """``n`` completions of one prompt (token ids), by vLLM's token route (``/inference/v1/generate``, which
        ``trainers vllm-serve`` enables with ``--enable-scale-out``), each token tagged with the weight version that
        sampled it: a request in flight across a weight update (``begin_weight_update(pause=True)``) has tokens of
        two versions. ``sampling_params``: vllm.SamplingParams arguments (``structured_outputs``, ``logprobs``, ...).

        Returns ``completion_ids``, ``logprobs`` / ``logprob_token_ids`` as ``generate`` (None without
        ``logprobs``) and ``versions`` ([row][token]: the ``version`` given to ``end_weight_update``, None before
        any; with an adapter, the adapter's, for every token)."""
        params = {**(sampling_params or {}), "n": n} | ({} if seed is None else {"seed": seed})
        if not params.get("stop"):  # stop strings are matched on text: only they need the server's detokenizer
            # we read token ids alone: the server skips detokenizing each token and each log-prob's token (7-9% of
            # a round of the GRPO demo: benchmarks/token_route.py)
            params.setdefault("detokenize", False)
        adapter = self.adapter  # a request keeps the adapter it is sent with, whatever loads meanwhile
        body = {"model": adapter[0] if adapter else self.model, "token_ids": list(map(int, prompt_ids)),
                "sampling_params": params, "output_mode": "tokens"}
        try:
            answer = self._post("/inference/v1/generate", body)
        except VLLMServerError as error:
            if "HTTP 403" not in str(error) and "HTTP 404" not in str(error):
                raise
            raise VLLMServerError(f"The vLLM server at {self.base_url} does not serve /inference/v1/generate, which "
                                  f"in-flight weight updates sample through (each token's weight version): restart it "
                                  f"with this version's `trainers vllm-serve` (it passes --enable-scale-out), or set "
                                  f"in_flight_weight_updates=False.") from None
        choices = sorted(answer["choices"], key=lambda choice: choice["index"])
        if len(choices) != n:
            raise VLLMServerError(f"The vLLM server at {self.base_url} returned {len(choices)} completions for n={n}.")
        values, token_ids = parse_token_logprobs([choice.get("logprobs") for choice in choices])
        return {"completion_ids": [choice["token_ids"] for choice in choices], "logprobs": values,
                "logprob_token_ids": token_ids,
                "versions": [[adapter[1]] * len(choice["token_ids"]) if adapter else
                             token_versions(choice.get("weight_versions"), len(choice["token_ids"]))
                             for choice in choices]}

    def get_sequence_logprobs(self, sequences: list[list[int]], prompt_lengths: list[int], top_logprobs: int = 100,
                              temperature: float = 1.0) -> dict[str, list]:
        """The served model's log-probs of given token sequences (prompt + completion) at each completion
        position, without generating (vLLM's prompt log-probs), as TRL's ``VLLMClient.get_sequence_logprobs``:
        ``logprobs`` / ``logprob_token_ids`` [row][position][top_logprobs] by descending probability (padded with
        -inf / 0), ``actual_logprobs`` / ``actual_token_ids`` [row][position][1] for the token in the sequence.
        The log-probs are at temperature 1: vLLM applies no sampling processors to prompt log-probs."""
        if temperature != 1.0:
            raise VLLMServerError(f"get_sequence_logprobs(temperature={temperature}): vLLM computes prompt log-probs "
                                  f"from the raw logits, so only temperature 1.0 is available from a server.")
        body = {"model": self.model, "prompt": [list(map(int, s)) for s in sequences], "max_tokens": 1,
                "temperature": 1.0, "prompt_logprobs": top_logprobs}
        choices = sorted(self._post("/v1/completions", body)["choices"], key=lambda choice: choice["index"])
        if len(choices) != len(sequences):
            raise VLLMServerError(f"The vLLM server at {self.base_url} returned {len(choices)} answers for "
                                  f"{len(sequences)} sequences.")
        out: dict[str, list] = {"logprobs": [], "logprob_token_ids": [], "actual_logprobs": [], "actual_token_ids": []}
        for choice, sequence, start in zip(choices, sequences, prompt_lengths):
            rows = [[], [], [], []]
            for position in range(start, len(sequence)):
                given = choice["prompt_logprobs"][position] or {}
                ranked = sorted(given.items(), key=lambda item: item[1]["rank"])[:top_logprobs]
                values = [finite_or_minus_inf(item["logprob"]) for _, item in ranked]
                rows[0].append(values + [-math.inf] * (top_logprobs - len(values)))
                rows[1].append([int(token) for token, _ in ranked] + [0] * (top_logprobs - len(ranked)))
                actual = given.get(str(sequence[position]))
                rows[2].append([-math.inf if actual is None else finite_or_minus_inf(actual["logprob"])])
                rows[3].append([int(sequence[position])])
            for key, values in zip(out, rows):
                out[key].append(values)
        return out

    # ---- weights ----

    def init_communicator(self, device: torch.device | str | int | None = None) -> None:
        """Open the weight-transfer group with the server's workers (done by the first update if not before), over
        the transport the server's engine names (generation/weight_transport.py: gloo on a CPU server, NCCL on a
        GPU one). ``device`` is accepted for TRL's signature: NCCL sends from the current CUDA device."""
        if self._transport is not None:
            return
        world_size = self.get_world_size() + 1  # this process is rank 0
        address = local_address(self.host, self.server_port)  # where the server's workers reach this process
        transport = TRANSPORTS[self.transfer_engine()](address, self.group_port, world_size,
                                                       timedelta(seconds=self.transfer_timeout), self.base_url)
        self._transport = transport  # dropped again if the group does not open
        request = in_thread(lambda: self._post("/init_weight_transfer_engine", {"init_info": transport.init_info}))
        self._raise_first_error(request, in_thread(transport.join), "opening the weight-transfer group")

    def transfer_engine(self) -> str:
        """The server's weight-transfer engine (its --weight-transfer-config backend): one of TRANSPORTS."""
        backend = (self.get_server_info().get("weight_transfer_config") or {}).get("backend")
        if backend not in TRANSPORTS:
            raise VLLMServerError(
                f"The vLLM server at {self.base_url} has weight transfer {backend!r}, not one of {sorted(TRANSPORTS)}: "
                f"the trainer cannot update its weights. {START_HINT[0].upper() + START_HINT[1:]}.")
        return backend

    @contextmanager
    def weight_update(self) -> Iterator[None]:
        """One weight update of several ``update_named_params`` calls (e.g. one per gathered module): the server
        reloads layer-wise as the tensors arrive and finishes once, then drops its prefix cache."""
        self.begin_weight_update()
        try:
            yield
        finally:
            self._in_update = False
        self.end_weight_update()

    def begin_weight_update(self, pause: bool = False) -> None:
        """Open the server's weight update (``weight_update()`` in two calls, for several servers updated
        together): the transfer group if not open, then the update, in one request (``/trainers/weight_update``,
        generation/vllm_worker/trainers_vllm_routes.py). One left open by a transfer that failed half-way (this
        run's, or a trainer that died mid-transfer) is closed first, its partial weights to be overwritten by this
        update. ``pause``: requests in flight are paused between decode steps first (as vLLM's
        ``/pause?mode=keep``) and go on with the new weights once ``end_weight_update`` resumes them. (A request of
        its own: were it the first chunk's, a server refusing it would leave that chunk's sending blocked in gloo
        until transfer_timeout.)"""
        self.init_communicator()
        self._loading = []  # a failed update's chunks: the server finishes that update first
        self._weight_route({"begin": True, "pause": pause})
        self._paused, self._in_update = pause, True

    def end_weight_update(self, version: int | None = None) -> None:
        """Finish the update ``begin_weight_update`` opened: once the server has loaded every chunk sent, one
        request: the server reloads (tagging the tokens it samples from here on with ``version``, when given),
        drops its prefix cache and resumes the requests it paused. A chunk the server failed to load is raised
        here."""
        self._in_update = False
        loading, self._loading = self._loading, []
        for request, transfer, what in loading:
            self._raise_first_error(request, transfer, what)
        self._weight_route({"end": True, "weight_version": None if version is None else str(version),
                            "resume": self._paused})
        self._paused = False

    def update_named_params(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Send these tensors (checkpoint names, e.g. ``model.layers.0.mlp.up_proj.weight``) into the server's
        model; inside ``weight_update()`` they join its update, else they are an update of their own. Inside an
        update it returns once the tensors have left (the caller may change them), while the server loads them:
        ``end_weight_update`` waits for that."""
        if not self._in_update:
            with self.weight_update():
                self.update_named_params(named_tensors)
            return
        # references, not copies, unless the server holds a narrower dtype: then cast here (on the tensor's device),
        # so half the bytes cross host memory and the wire; the server's loader would round them the same way
        server_dtype = self.server_dtype()
        tensors = [(name, wire_tensor(tensor.detach(), server_dtype)) for name, tensor in named_tensors]
        if not tensors:
            return
        update_info, send = self._transport.plan(tensors)
        # the server receives inside this request, so the request and the sending run together
        request = in_thread(lambda: self._weight_route({"update_info": update_info}))
        transfer, what = in_thread(send), f"sending {len(tensors)} tensors"
        wait([request, transfer], return_when=FIRST_COMPLETED)
        if transfer.done() and transfer.exception() is None and not request.done():
            self._loading.append((request, transfer, what))  # sent; the server loads them (end_weight_update)
            return
        self._raise_first_error(request, transfer, what)  # a failure, or the server's answer came first

    def _weight_route(self, body: dict) -> None:
        try:
            self._post(WEIGHT_ROUTE, body)
        except VLLMServerError as error:
            if "HTTP 404" not in str(error):
                raise
            raise VLLMServerError(f"The vLLM server at {self.base_url} does not serve {WEIGHT_ROUTE}: restart it "
                                  f"with this version's `trainers vllm-serve`.") from None

    def server_dtype(self) -> torch.dtype | None:
        """The dtype of the server's weights (its --dtype as resolved), read once from /server_info; None if the
        server does not say."""
        if self._server_dtype is None:
            name = str(self.get_server_info().get("model_config", {}).get("dtype", ""))
            dtype = getattr(torch, name.removeprefix("torch."), None) if name else None
            self._server_dtype = dtype if isinstance(dtype, torch.dtype) else False
        return self._server_dtype or None

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The server's weights := these (name, tensor) pairs, in one update."""
        with self.weight_update():
            self.update_named_params(named_tensors)

    def update_named_param(self, name: str, weights: torch.Tensor) -> None:
        """TRL's: one tensor."""
        self.update_named_params([(name, weights)])

    def update_model_params(self, model: torch.nn.Module) -> None:
        """The server's weights := ``model``'s full state dict (a tied output head included)."""
        self.update_weights(model.state_dict().items())

    def _raise_first_error(self, request: Future, transfer: Future, what: str) -> None:
        """Wait for the server's request and this side's transfer; the first failure (a dead server, a tensor it
        refused, a gloo timeout: each transfer waits at most transfer_timeout) closes the group and is raised."""
        done, _ = wait([request, transfer], return_when=FIRST_EXCEPTION)
        failed = [f for f in (request, transfer) if f in done and f.exception() is not None]
        if not failed:
            return
        self._drop_group()  # the other side may still wait in it: a new update opens a new one
        # a sending thread still inside gloo when the process exits aborts the process (std::terminate): give it
        # the time a dead server's reset takes to reach it (a server that refused the update and lives on is not
        # waited for: the send ends at its transfer_timeout; aborting the group does not end it sooner)
        wait([request, transfer], timeout=min(self.transfer_timeout, FAILED_SEND_GRACE_S))
        error = failed[0].exception()
        if isinstance(error, VLLMServerError):
            raise error
        raise VLLMServerError(f"Weight transfer to the vLLM server at {self.base_url} failed while {what}: "
                              f"{error}") from error

    def _drop_group(self) -> None:
        transport, self._transport = self._transport, None
        if transport is not None:
            transport.drop()

    def close_communicator(self) -> None:
        """Close the weight-transfer group (the server keeps serving)."""
        if self._transport is None:
            return
        try:
            self._post("/shutdown_weight_transfer_engine")
        except VLLMServerError:  # the server is gone: nothing to tell it
            pass
        self._drop_group()

    def close(self) -> None:
        """Release this client's group; idempotent. The server is not stopped (it is not the trainer's)."""
        self.close_communicator()

    def abandon(self) -> None:
        """Release this client's group without a word to the server (it is down, or hung: a request would wait for
        it)."""
        self._drop_group()


def same_model(served: str, expected: str) -> bool:
    """Whether the server's model name and the trainer's model are the same: equal Hub ids, or the same folder."""
    def normal(name: str) -> str:
        return os.path.realpath(name) if os.path.isdir(name) else name.rstrip("/")

    return normal(served) == normal(expected)
