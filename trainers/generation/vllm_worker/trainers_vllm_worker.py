"""What runs inside the vLLM server for `trainers vllm-serve`: a weight-transfer engine over gloo (CPU tensors,
TCP), registered in vLLM's worker process.

vLLM's own transfer engines (nccl, ipc, ...) need CUDA. This one receives the trainer's tensors over a gloo process
group of its own (the trainer is rank 0, the server's workers ranks 1..W; rendezvous on a TCPStore the trainer hosts
at ``master_address:master_port``, GRPOConfig.vllm_group_port) and loads them with vLLM's layer-wise reload, as the
NCCL engine does: in place, re-running each layer's post-load processing (the CPU backend repacks linear weights for
oneDNN, so a plain ``load_weights`` on the running model would not do).

This file imports only torch, vLLM and the standard library, never the ``trainers`` package: the server may run in
an environment of its own (vLLM pins another transformers) that lacks the trainer's dependencies. The launcher
(trainers/generation/vllm_server.py) puts this folder, which holds only this module, on PYTHONPATH and passes
``--worker-extension-cls trainers_vllm_worker.TrainersWorkerExtension``: vLLM's worker imports this module by that
name, which registers the engine before the worker builds it from ``--weight-transfer-config``.

The client side is trainers/generation/vllm_client.py (``VLLMClient.update_weights``).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer import WeightTransferEngineFactory
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

ENGINE_NAME = "trainers_gloo"  # --weight-transfer-config '{"backend": "trainers_gloo"}'; vllm_client.py checks it
STORE_PREFIX = "trainers_weights"  # the keys of this group in the trainer's TCPStore


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    """Sent once by the trainer (POST /init_weight_transfer_engine)."""

    master_address: str  # where the trainer's TCPStore listens
    master_port: int
    world_size: int  # the trainer (rank 0) + every worker of the server
    rank_offset: int = 1  # this worker's rank in the group: its global worker rank + rank_offset
    timeout_s: float = 300.0  # a rendezvous or transfer that waits longer fails (the trainer died)
    # a secret the trainer draws for this group and sends only in this (authenticated) call: the group's keys in
    # the trainer's store are under it, so only servers the trainer called can join (anyone can reach the store)
    group_key: str = ""


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """Sent per chunk of tensors (POST /update_weights): what the trainer broadcasts next, in this order."""

    names: list[str]
    dtype_names: list[str]  # "float32", "bfloat16", ...
    shapes: list[list[int]]
    # tensors per broadcast, in order: a bucket of several (one dtype) arrives as one flat buffer of their elements
    # one after the other; None: one broadcast per tensor
    bucket_sizes: list[int] | None = None

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(f"update_info: names ({len(self.names)}), dtype_names ({len(self.dtype_names)}) and "
                             f"shapes ({len(self.shapes)}) must have one entry per tensor.")
        if self.bucket_sizes is not None and (sum(self.bucket_sizes) != len(self.names)
                                              or min(self.bucket_sizes, default=1) < 1):
            raise ValueError(f"update_info: bucket_sizes {self.bucket_sizes} must be positive and add up to the "
                             f"{len(self.names)} tensors.")
        unknown = [name for name in self.dtype_names if not isinstance(getattr(torch, name, None), torch.dtype)]
        if unknown:
            raise ValueError(f"update_info: unknown dtypes {unknown}.")


def local_address(peer_host: str, peer_port: int) -> str:
    """The address of this host on the route to the peer (a UDP 'connect' sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((peer_host, peer_port))
        return probe.getsockname()[0]


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """Receives the trainer's tensors over gloo and reloads them layer-wise into the worker's model."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: dist.ProcessGroupGloo | None = None

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        self.shutdown()  # a new trainer replaces the previous one's group
        parallel = self.parallel_config
        # a unique rank across data-parallel replicas, as vLLM's NCCL engine computes it
        rank = parallel.data_parallel_index * parallel.world_size + parallel.rank + init_info.rank_offset
        timeout = timedelta(seconds=init_info.timeout_s)
        store = dist.TCPStore(init_info.master_address, init_info.master_port, init_info.world_size,
                              is_master=False, timeout=timeout)
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        # bind gloo to the interface that reaches the trainer (its default resolves the hostname, which may not)
        options._devices = [dist.ProcessGroupGloo.create_device(
            hostname=local_address(init_info.master_address, init_info.master_port))]
        prefix = dist.PrefixStore(f"{STORE_PREFIX}/{init_info.group_key}", store)
        self.group = dist.ProcessGroupGloo(prefix, rank, init_info.world_size, options)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # the base class ends with torch.accelerator.synchronize(), which has no device to synchronize on CPU;
        # gloo's wait() has already completed each receive
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("trainers_gloo weight transfer is not initialized: POST /init_weight_transfer_engine "
                               "first (VLLMClient does).")
        entries = list(zip(update_info.names, update_info.dtype_names, update_info.shapes))
        start = 0
        for size in update_info.bucket_sizes or [1] * len(entries):
            bucket = entries[start:start + size]
            start += size
            dtypes = {dtype_name for _, dtype_name, _ in bucket}
            if len(dtypes) != 1:
                raise ValueError(f"update_info: a bucket mixes dtypes {sorted(dtypes)}.")
            numels = [torch.Size(shape).numel() for _, _, shape in bucket]
            flat = torch.empty(sum(numels), dtype=getattr(torch, bucket[0][1]))  # on CPU: gloo's transport
            self.group.broadcast(flat, 0).wait()
            # inside start/finish_weight_update the model's loaders buffer each layer until it is complete,
            # then load and re-process it in place (the tied head included when the trainer sends it); each
            # bucket has a buffer of its own, so what a loader keeps is never overwritten
            views, offset = [], 0
            for (name, _, shape), numel in zip(bucket, numels):
                views.append((name, flat[offset:offset + numel].view(shape).to(self.device)))
                offset += numel
            self.model.load_weights(views)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.shutdown()
            self.group = None


class TrainersWorkerExtension:
    """Passed as ``--worker-extension-cls``: importing this module registers the transfer engine in the worker.
    It adds no methods to the worker."""


if ENGINE_NAME not in WeightTransferEngineFactory._registry:  # the module may be imported twice in one process
    WeightTransferEngineFactory.register_engine(ENGINE_NAME, GlooWeightTransferEngine)

# The kernel lets a process run AMX tile instructions only after it asked; vLLM's bf16 CPU attention uses them
# without asking and dies with SIGILL on a CPU that has AMX (trainers.parallel.host.allow_amx_tiles, restated here: this
# module never imports the trainers package). A no-op without AMX.
if torch.cpu._is_amx_tile_supported():
    torch.cpu._init_amx()
