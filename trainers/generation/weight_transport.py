"""How the weights travel from the trainer to a `trainers vllm-serve` server, chosen by the server's device: the
server's transfer engine (its /server_info ``weight_transfer_config.backend``) names the transport, and
``VLLMClient`` (generation/vllm_client.py) drives either through the same calls (open the group while the server's
``/init_weight_transfer_engine`` joins it; per chunk of tensors, ``/update_weights`` with the transport's update info
while it sends them).

- ``GlooTransport`` (``trainers_gloo``, a server on CPU): our engine in the server's worker
  (generation/vllm_worker/trainers_vllm_worker.py), a gloo group over TCP, tensors through host memory in buckets
  of one dtype. It works on a GPU too (copies through the host).
- ``NCCLTransport`` (``nccl``, a server on CUDA): vLLM's own NCCL engine, tensors broadcast device to device. The
  trainer's side joins with vLLM's ``trainer_init`` (so it needs vLLM and a CUDA device here, as TRL's client does);
  NCCL cannot put two ranks on one GPU, so the trainer and the server need a GPU each.

Each transport: ``init_info`` (the server's ``init_weight_transfer_engine`` payload), ``join()`` (blocks until the
server's workers have joined), ``plan(tensors)`` -> (the ``update_weights`` payload, a function that sends them),
``drop()``.
"""

from __future__ import annotations

import secrets
import sys
import threading
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from trainers.errors import VLLMServerError
from trainers.generation.weight_wire import BUCKET_BYTES, host_buffer, hosted_store, plan_buckets

GLOO_ENGINE = "trainers_gloo"  # trainers_vllm_worker.ENGINE_NAME
NCCL_ENGINE = "nccl"  # vLLM's
STORE_PREFIX = "trainers_weights"  # trainers_vllm_worker.STORE_PREFIX


def metas(tensors: list[tuple[str, torch.Tensor]]) -> dict:
    """The names, dtypes and shapes of ``tensors``, in order, as both engines' update info has them."""
    return {"names": [name for name, _ in tensors],
            "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in tensors],
            "shapes": [list(t.shape) for _, t in tensors]}


class GlooTransport:
    """A gloo group with the server's workers (this process rank 0, the workers after it; rendezvous on the TCPStore
    this process hosts at ``port``, shared by the clients of several servers, each group's keys under a secret)."""

    engine = GLOO_ENGINE

    def __init__(self, address: str, port: int, world_size: int, timeout: timedelta, server_url: str):
        self.address, self.world_size, self.timeout = address, world_size, timeout
        self.store = hosted_store(address, port, timeout, server_url)  # kept alive with the group
        self.key = secrets.token_hex(16)  # only the servers this (authenticated) call reaches can join the group
        self.init_info = {"master_address": address, "master_port": port, "world_size": world_size,
                          "rank_offset": 1, "timeout_s": timeout.total_seconds(), "group_key": self.key}
        self.group: dist.ProcessGroupGloo | None = None

    def join(self) -> None:
        options = dist.ProcessGroupGloo._Options()
        options._timeout = self.timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=self.address)]
        self.group = dist.ProcessGroupGloo(dist.PrefixStore(f"{STORE_PREFIX}/{self.key}", self.store), 0,
                                           self.world_size, options)

    def plan(self, tensors: list[tuple[str, torch.Tensor]]) -> tuple[dict, Callable[[], None]]:
        buckets = plan_buckets([t for _, t in tensors], BUCKET_BYTES)
        group = self.group

        def send() -> None:
            for bucket in buckets:  # one bucket in host memory at a time (a GPU's weights are copied here)
                group.broadcast(host_buffer([tensors[i][1] for i in bucket]), 0).wait()

        return metas(tensors) | {"bucket_sizes": [len(b) for b in buckets]}, send

    def drop(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            try:
                group.abort()
            except RuntimeError as error:  # already broken: nothing left to release
                print(f"[trainers] closing the weight-transfer group: {error}", file=sys.stderr)


_NCCL_PORTS: dict[str, int] = {}  # server URL -> the port its NCCL rendezvous uses (one store per group)
_NCCL_LOCK = threading.Lock()


def nccl_port(base_port: int, server_url: str) -> int:
    """vLLM's NCCL rendezvous hosts a store of its own per group: the first server's on ``base_port``
    (vllm_group_port), the next one's on the port after it, ...; a server keeps its port when it joins again."""
    with _NCCL_LOCK:
        if server_url not in _NCCL_PORTS:
            _NCCL_PORTS[server_url] = base_port + len(_NCCL_PORTS)
        return _NCCL_PORTS[server_url]


def nccl_missing() -> str | None:
    """Why this process cannot join a server's NCCL group (None: it can)."""
    if not torch.cuda.is_available():
        return "this process has no CUDA device"
    try:
        from vllm.distributed.weight_transfer.nccl_common import trainer_init  # noqa: F401
    except Exception as error:  # ImportError, or a broken install
        return f"vLLM is not importable here ({type(error).__name__}: {error}), and its NCCL rendezvous needs it"
    return None


def nccl_refusal(server_url: str) -> VLLMServerError | None:
    """The error for a server that takes weights over NCCL when this process cannot join it (None: it can)."""
    missing = nccl_missing()
    if missing is None:
        return None
    return VLLMServerError(f"The vLLM server at {server_url} takes weights over NCCL (a server on a GPU), and "
                           f"{missing}. Run the trainer on a GPU with vLLM installed, or start the server with "
                           f"`trainers vllm-serve ... --weight_transfer gloo`.")


class NCCLTransport:
    """vLLM's NCCL engine: this process rank 0 of a group with the server's workers, the tensors broadcast from this
    process's CUDA device (one at a time, unpacked: the server decodes as ``init_info`` says)."""

    engine = NCCL_ENGINE

    def __init__(self, address: str, port: int, world_size: int, timeout: timedelta, server_url: str):
        refusal = nccl_refusal(server_url)
        if refusal is not None:
            raise refusal
        self.port = nccl_port(port, server_url)
        self.rendezvous = {"master_address": address, "master_port": self.port, "world_size": world_size}
        self.init_info = self.rendezvous | {"rank_offset": 1, "packed": False}
        self.group = None  # vLLM's PyNcclCommunicator

    def join(self) -> None:
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        self.group = trainer_init(self.rendezvous)

    def plan(self, tensors: list[tuple[str, torch.Tensor]]) -> tuple[dict, Callable[[], None]]:
        group, device = self.group, torch.device("cuda", torch.cuda.current_device())

        def send() -> None:
            stream = torch.cuda.current_stream()
            for _, tensor in tensors:  # the server receives them in this order (update info)
                group.broadcast(tensor.to(device).contiguous(), src=0, stream=stream)
            stream.synchronize()  # landed before the caller changes the weights again

        return metas(tensors), send

    def drop(self) -> None:
        group, self.group = self.group, None
        if group is not None and hasattr(group, "destroy"):
            group.destroy()


TRANSPORTS = {GLOO_ENGINE: GlooTransport, NCCL_ENGINE: NCCLTransport}
