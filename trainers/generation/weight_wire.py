"""The trainer's side of the weight transfer into a vLLM server (generation/vllm_client.py): the rendezvous this
process hosts for the servers' workers, and the tensors as they travel (in the server's dtype, in buckets of one
dtype, through host memory). Torch and the standard library only."""

from __future__ import annotations

import socket
import threading
from concurrent.futures import Future
from datetime import timedelta

import torch
import torch.distributed as dist

from trainers.errors import VLLMServerError

BUCKET_BYTES = 64 * 2**20  # tensors of one dtype sent as one flat buffer, up to this many bytes (a larger one alone)


_HOSTED_STORES: dict[int, dist.TCPStore] = {}  # vllm_group_port -> the rendezvous this process hosts there
_HOSTED_LOCK = threading.Lock()


def hosted_store(address: str, port: int, timeout: timedelta, server_url: str) -> dist.TCPStore:
    """The weight-transfer rendezvous this process hosts on ``port``, started by the first client that needs it:
    the clients of several servers share it (one port to open), each group's keys under its own secret."""
    with _HOSTED_LOCK:
        if port not in _HOSTED_STORES:
            try:
                _HOSTED_STORES[port] = dist.TCPStore(address, port, 1, is_master=True, timeout=timeout,
                                                     wait_for_workers=False)
            except Exception as error:  # the port is taken (another run?) or not bindable here
                raise VLLMServerError(f"Cannot host the weight-transfer rendezvous on {address}:{port} "
                                      f"(vllm_group_port) for the vLLM server at {server_url}: {error}. Pick a "
                                      f"free port.") from error
        return _HOSTED_STORES[port]


def wire_tensor(tensor: torch.Tensor, server_dtype: torch.dtype | None) -> torch.Tensor:
    """The tensor as it is sent: in the server's dtype when that is narrower (float32 weights to a bfloat16 server:
    half the bytes), else as it is (a wider server widens it exactly)."""
    if (server_dtype is None or not tensor.is_floating_point() or not server_dtype.is_floating_point
            or server_dtype.itemsize >= tensor.element_size()):
        return tensor
    return tensor.to(server_dtype)


def plan_buckets(tensors: list[torch.Tensor], bucket_bytes: int) -> list[list[int]]:
    """Consecutive tensors of one dtype grouped into buckets of at most ``bucket_bytes`` (a larger tensor is a bucket
    of its own): each bucket is one broadcast instead of one per tensor. -> the tensors' indices, per bucket."""
    buckets: list[list[int]] = []
    size = 0
    for index, tensor in enumerate(tensors):
        nbytes = tensor.numel() * tensor.element_size()
        last = buckets[-1] if buckets else None
        if last is None or tensors[last[0]].dtype != tensor.dtype or size + nbytes > bucket_bytes:
            buckets.append([index])
            size = nbytes
        else:
            last.append(index)
            size += nbytes
    return buckets


def host_buffer(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One tensor alone: itself in host memory. Several (one dtype): their elements one after the other in one flat
    host buffer, pinned when they come from a GPU so the copies run asynchronously and wait once, not per tensor."""
    if len(tensors) == 1:
        return tensors[0].to("cpu").contiguous()
    on_gpu = any(t.device.type == "cuda" for t in tensors)
    flat = torch.empty(sum(t.numel() for t in tensors), dtype=tensors[0].dtype, pin_memory=on_gpu)  # [total]
    offset = 0
    for tensor in tensors:
        flat[offset:offset + tensor.numel()].copy_(tensor.reshape(-1), non_blocking=on_gpu)
        offset += tensor.numel()
    if on_gpu:
        torch.cuda.synchronize()  # the pinned copies are asynchronous: complete before gloo reads the buffer
    return flat


def local_address(peer_host: str, peer_port: int) -> str:
    """This host's address on the route to the peer (a UDP 'connect' sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((peer_host, peer_port))
        return probe.getsockname()[0]


def in_thread(function) -> Future:
    """Run ``function`` in a daemon thread (one blocked in a transfer must not keep the process alive)."""
    future: Future = Future()

    def run():
        try:
            future.set_result(function())
        except BaseException as error:  # noqa: BLE001  (handed to the waiting thread)
            future.set_exception(error)

    threading.Thread(target=run, daemon=True).start()
    return future
