"""What runs inside the vLLM server for `trainers vllm-serve`: a weight-transfer engine over gloo (CPU tensors,
TCP), registered in vLLM's worker process.

vLLM's own transfer engines (nccl, ipc, ...) need CUDA. This one receives the trainer's tensors over a gloo process
group of its own (the trainer is rank 0, the server's workers ranks 1..W; rendezvous on a TCPStore the trainer hosts
at ``master_address:master_port``, GRPOConfig.vllm_group_port) and loads them in place, re-running each layer's
post-load processing (the CPU backend repacks linear weights for oneDNN, so a plain ``load_weights`` on the running
model would not do). An unquantized model on CPU reloads with `LeanReload` (below), half the time of vLLM's layer-wise
reload, which the NCCL engine uses and which stays the path for everything else.

This file imports only torch, vLLM and the standard library, never the ``trainers`` package: the server may run in
an environment of its own (vLLM pins another transformers) that lacks the trainer's dependencies. The launcher
(trainers/generation/vllm_server.py) puts this folder, which holds only this module, on PYTHONPATH and passes
``--worker-extension-cls trainers_vllm_worker.TrainersWorkerExtension``: vLLM's worker imports this module by that
name, which registers the engine before the worker builds it from ``--weight-transfer-config``.

The client side is trainers/generation/vllm_client.py (``VLLMClient.update_weights``).
"""

from __future__ import annotations

import socket
from collections.abc import Callable
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
        self.lean: LeanReload | None = None  # built at the first update, when the model is one it can reload
        self.lean_checked = False

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
        if not self.lean_checked:
            self.lean_checked = True
            if self.device.type == "cpu" and self.model_config.quantization is None:
                self.lean = LeanReload.for_model(self.model)
        if self.lean is not None:
            self.lean.start()
            return
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
            self.model.load_weights(self.lean.renamed(views) if self.lean is not None else views)

    def finish_weight_update(self) -> None:
        if self.lean is not None:
            self.lean.finish()
            return
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.shutdown()
            self.group = None


class LeanReload:
    """An in-place reload for an unquantized model on CPU, with vLLM's own pieces, for half the time of its layer-wise
    reload (on the demo's width-128 model 9 ms a push against 18, the same weights bit for bit).

    The layer-wise reload puts every layer back on the meta device, buffers each loader call (running it once on
    meta to count the elements) and processes a layer once all of it has come. On CPU without quantization, loading
    is simpler: only the weights the CPU backend repacked (oneDNN keeps the linear weights; the layer's own is
    emptied) are missing from the model, and every layer's processing rebuilds its kernels from model-format
    weights. So ``start`` gives each repacked weight a fresh model-format tensor (from the metadata vLLM recorded at
    load time), ``model.load_weights`` then loads every weight straight into place, and ``finish`` re-runs the
    processing of each layer that has a quantization method (``UnquantizedLinearMethod`` / ``...EmbeddingMethod``:
    a new oneDNN handler; a tied output head included, whose weight is the embedding's), then puts the layer's own
    (emptied) tensors back, as the layer-wise reload does. A repacked weight that nothing was loaded into keeps its
    kernel (a push of some layers only); one loaded in part is an error, not a kernel built on uninitialized memory.
    Until the finish, a linear layer computes with its old kernel, while the weights loaded in place (norms,
    embeddings, biases) are already new, as with the layer-wise reload: a push in flight pauses the engine first
    (``begin_weight_update(pause=True)``), so that no step runs on half of them.
    """

    def __init__(self, layers: list[torch.nn.Module], aliases: dict[str, str]) -> None:
        self.layers = layers  # every module with a quantization method, in model order
        self.aliases = aliases  # a tied embedding's other names -> the name vLLM loads it by
        self.kernels: dict[torch.nn.Module, dict[str, torch.Tensor]] = {}  # per layer: its tensors set aside
        self.loaded: dict[torch.nn.Module, dict[str, int]] = {}  # per layer: elements loaded into each fresh tensor

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> LeanReload | None:
        """The reload for this model, or None where it is not the kind described above (another quantization method,
        a tensor changed after loading by a layer without one, no metadata recorded): the layer-wise reload then."""
        from vllm.model_executor.layers.linear import UnquantizedLinearMethod
        from vllm.model_executor.layers.vocab_parallel_embedding import (
            UnquantizedEmbeddingMethod,
            VocabParallelEmbedding,
        )
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

        aliases, first = {}, {}  # as vLLM's loader finds tied embeddings: one parameter under two names
        for prefix, module in model.named_modules(remove_duplicate=False):
            if isinstance(module, VocabParallelEmbedding):
                for name, param in module.named_parameters(remove_duplicate=False):
                    qualname = f"{prefix}.{name}" if prefix else name
                    if first.setdefault(id(param), qualname) != qualname:
                        aliases[qualname] = first[id(param)]
        layers = []
        for module in model.modules():
            info = LAYERWISE_INFO.get(module)
            method = getattr(module, "quant_method", None)
            if info is None:
                return None
            if isinstance(method, (UnquantizedLinearMethod, UnquantizedEmbeddingMethod)):
                if any(module._parameters.get(name) is None for name in info.restore_metadata[0]):
                    return None  # a weight its processing removed: nothing to put back after a reload
                layers.append(module)
            elif method is not None or any(_repacked(module, name, meta)
                                           for name, meta in info.restore_metadata[0].items()):
                return None
        return cls(layers, aliases)

    def renamed(self, weights: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """A tied output head under the embedding's name. vLLM's loader skips ``lm_head.weight`` of a tied model and
        refuses a call that has it without ``model.embed_tokens.weight`` (a chunk of an update may); loaded in place,
        either name is the one tensor. (The layer-wise reload never meets this: it gives the head a tensor of its
        own while it loads.)"""
        return [(self.aliases.get(name, name), tensor) for name, tensor in weights]

    def start(self) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
        from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor
        from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

        for layer, set_aside in self.kernels.items():  # an update that failed before its finish: its layers back
            _put_back(layer, set_aside)
        self.kernels, self.loaded = {}, {}
        for layer in self.layers:
            info = LAYERWISE_INFO[layer]
            for name, meta in info.restore_metadata[0].items():
                if not _repacked(layer, name, meta):
                    continue
                with info.restore_device:
                    fresh = restore_layer_refs(materialize_meta_tensor(meta), layer)  # its own copy of the attributes
                self.kernels.setdefault(layer, {})[name] = layer._parameters[name]
                self.loaded.setdefault(layer, {})[name] = 0
                fresh.weight_loader = _counting(self.loaded[layer], name, _original_loader(fresh.weight_loader))
                setattr(layer, name, fresh)

    def finish(self) -> None:
        from vllm.model_executor.model_loader.reload.utils import get_tensor_load_numel  # without declared padding

        kernels, loaded, self.kernels, self.loaded = self.kernels, self.loaded, {}, {}
        short = {f"{type(layer).__name__}.{name}": (count, get_tensor_load_numel(getattr(layer, name)))
                 for layer, counts in loaded.items() if any(counts.values())
                 for name, count in counts.items() if count < get_tensor_load_numel(getattr(layer, name))}
        if short:
            for layer, set_aside in kernels.items():
                _put_back(layer, set_aside)
            raise ValueError(f"weight update: layers received part of their weights (elements loaded / expected: "
                             f"{short}); send every tensor of a layer (q, k and v together, gate and up together) in "
                             f"one update.")
        for layer in self.layers:
            set_aside = kernels.get(layer, {})
            if set_aside and not any(loaded[layer].values()):  # nothing sent for this layer: it keeps its kernels
                _put_back(layer, set_aside)
                continue
            layer.quant_method.process_weights_after_loading(layer)
            for name, kernel in set_aside.items():  # as the layer-wise reload: the kernel tensors stay the layer's
                processed = getattr(layer, name)
                if processed.shape == kernel.shape and processed.dtype == kernel.dtype:
                    kernel.data.copy_(processed)
            _put_back(layer, set_aside)


def _repacked(layer: torch.nn.Module, name: str, meta: torch.Tensor) -> bool:
    """Whether the layer's tensor ``name`` is no longer in model format (its shape or dtype changed after loading)."""
    tensor = layer._parameters.get(name)
    return tensor is None or tensor.shape != meta.shape or tensor.dtype != meta.dtype


def _counting(counts: dict[str, int], name: str, loader: Callable) -> Callable:
    """``loader``, adding the elements of each weight it is given to ``counts[name]``."""

    def counting_loader(*args, **kwargs):
        loaded_weight = args[1] if len(args) > 1 else kwargs["loaded_weight"]  # loader(param, loaded_weight, ...)
        counts[name] += loaded_weight.numel()
        return loader(*args, **kwargs)

    return counting_loader


def _original_loader(loader: Callable) -> Callable:
    # the layer-wise reload wraps the loaders of the metadata's tensors and leaves them wrapped
    while getattr(loader, "__name__", "") == "online_process_loader":
        loader = loader.__wrapped__
    return loader


def _put_back(layer: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    for name, tensor in tensors.items():
        delattr(layer, name)
        layer.register_parameter(name, tensor)


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
