"""The sampling interface's engine choice: generation_engine="auto" takes the lean engine on CPU only; on any
other device (CUDA) it takes HF generate, since the lean engine has not been measured on a GPU."""

import pytest
import torch

from trainers.generation import engine, sampling
from trainers.generation.sampling import SamplingParams, generate


class FakeParams(torch.nn.Module):
    """A module whose parameters sit on ``device`` (meta stands in for CUDA: neither is the CPU)."""

    def __init__(self, device: str):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, device=device))


@pytest.fixture
def calls(monkeypatch) -> list[str]:
    seen = []
    monkeypatch.setattr(engine, "supports", lambda model, extra=None: True)  # a family the lean engine knows
    monkeypatch.setattr(engine, "generate", lambda *a, **k: seen.append("lean") or [[1]])
    monkeypatch.setattr(sampling, "hf_generate", lambda *a, **k: seen.append("hf") or [[1]])
    return seen


@pytest.mark.parametrize("device, engine_name, expected", [
    ("cpu", "auto", "lean"), ("meta", "auto", "hf"), ("cpu", "hf", "hf"), ("meta", "lean", "lean"),
])
def test_auto_takes_the_lean_engine_on_cpu_only(calls, device, engine_name, expected):
    generate(FakeParams(device), [[5, 6]], SamplingParams(max_new_tokens=2), pad_id=0, eos_ids={1},
             engine=engine_name)
    assert calls == [expected]
