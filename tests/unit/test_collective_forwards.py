"""distributed.forwards_are_collective: a DDP forward is a collective when it broadcasts the module's buffers,
which GRPO's per-process forward counts (shared prompt forwards, rows out of the backward) must avoid."""

import socket
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as torch_dist
from accelerate.utils import DistributedType

from trainers.parallel.distributed import forwards_are_collective


@pytest.fixture
def one_process_group():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch_dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=1, rank=0)
    yield
    torch_dist.destroy_process_group()


class WithBuffer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(2, 2)
        self.register_buffer("inv_freq", torch.ones(2), persistent=False)  # like a rotary embedding's


def test_ddp_forward_is_collective_only_when_it_broadcasts_buffers(one_process_group):
    ddp = SimpleNamespace(distributed_type=DistributedType.MULTI_CPU)
    broadcasting = torch.nn.parallel.DistributedDataParallel(WithBuffer(), broadcast_buffers=True)
    quiet = torch.nn.parallel.DistributedDataParallel(WithBuffer(), broadcast_buffers=False)
    no_buffers = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2), broadcast_buffers=True)
    assert forwards_are_collective(ddp, broadcasting)
    assert not forwards_are_collective(ddp, quiet)
    assert not forwards_are_collective(ddp, no_buffers)
    assert not forwards_are_collective(SimpleNamespace(distributed_type=DistributedType.NO), WithBuffer())
    assert forwards_are_collective(SimpleNamespace(distributed_type=DistributedType.FSDP), WithBuffer())
