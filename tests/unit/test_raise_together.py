"""dist.raise_together as a healthy process sees another's failure (the collectives faked: process 0 failed):
a DistributedError naming it, or, for a ``shared`` type, that type with its message (the vLLM server's
VLLMServerError, which every process answers together with a checkpoint)."""

from types import SimpleNamespace

import pytest
import torch

from trainers.parallel import distributed as dist
from trainers.errors import DistributedError, VLLMServerError


@pytest.fixture
def process_1_of_2(monkeypatch):
    """This process is rank 1 of 2; rank 0 failed with ``failure`` (set by the test)."""
    failure = {}

    def all_reduce_sum(accelerator, values):
        return values + 1.0  # rank 0's 1.0

    def gather_object(objects):
        error = failure["error"]
        kind = next((i for i, k in enumerate(failure["shared"]) if isinstance(error, k)), None)
        return [(type(error).__name__, str(error), kind)] + list(objects)

    monkeypatch.setattr(dist, "all_reduce_sum", all_reduce_sum)
    monkeypatch.setattr(dist, "gather_object", gather_object)
    return SimpleNamespace(num_processes=2, device=torch.device("cpu")), failure


def test_another_process_failure_is_a_distributed_error(process_1_of_2):
    accelerator, failure = process_1_of_2
    failure.update(error=ValueError("bad reward"), shared=())
    with pytest.raises(DistributedError, match="process 0 failed, so this process stops too: ValueError: bad reward"):
        dist.raise_together(accelerator, None)


def test_a_shared_error_type_is_raised_on_every_process(process_1_of_2):
    accelerator, failure = process_1_of_2
    message = "The vLLM server at http://h:8000 did not answer POST /v1/completions: refused."
    failure.update(error=VLLMServerError(message), shared=(VLLMServerError,))
    with pytest.raises(VLLMServerError) as raised:
        dist.raise_together(accelerator, None, shared=(VLLMServerError,))
    assert str(raised.value) == f"(process 0) {message}"
    # another type than the shared ones stays a DistributedError
    failure.update(error=ValueError("bad reward"), shared=(VLLMServerError,))
    with pytest.raises(DistributedError):
        dist.raise_together(accelerator, None, shared=(VLLMServerError,))


def test_nothing_failed_raises_nothing(monkeypatch):
    monkeypatch.setattr(dist, "all_reduce_sum", lambda accelerator, values: values)
    accelerator = SimpleNamespace(num_processes=2, device=torch.device("cpu"))
    dist.raise_together(accelerator, None, shared=(VLLMServerError,))
