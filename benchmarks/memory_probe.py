"""Where a process's memory goes: resident-set size, and the model-state bytes it holds, by kind.

Used by ``benchmarks/memory.py`` (per-rank breakdowns under every template) and by the ZeRO-3 regression
test. CPU-only figures come from /proc (RSS and its peak); tensor figures come from walking the model,
the optimizer and DeepSpeed's partition buffers, counting each storage once.
"""

from __future__ import annotations

import gc

import torch

_KB = 1024


def rss_bytes() -> int:
    """Current resident-set size of this process."""
    return _status_field("VmRSS")


def peak_rss_bytes() -> int:
    """Peak resident-set size since the process started or since the last ``reset_peak_rss``."""
    return _status_field("VmHWM")


def reset_peak_rss() -> None:
    """Restart peak-RSS tracking (Linux: writing 5 to /proc/self/clear_refs resets VmHWM)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _status_field(name: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(name + ":"):
                    return int(line.split()[1]) * _KB
    except OSError:
        pass
    return 0


def _storage_key(t: torch.Tensor):
    try:
        return t.untyped_storage().data_ptr(), t.device.type
    except (RuntimeError, NotImplementedError):
        return id(t), t.device.type


def _storage_bytes(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return t.numel() * t.element_size()


class _Ledger:
    """Assigns each tensor storage to the first category that claims it."""

    def __init__(self):
        self.seen: set = set()
        self.bytes: dict[str, int] = {}

    def add(self, category: str, tensors) -> None:
        for t in tensors:
            if not isinstance(t, torch.Tensor) or t.numel() == 0:
                continue
            key = _storage_key(t)
            if key in self.seen or key[0] == 0:
                continue
            self.seen.add(key)
            self.bytes[category] = self.bytes.get(category, 0) + _storage_bytes(t)


def _tensors_in(obj) -> list[torch.Tensor]:
    """Tensors inside a tensor, or (nested) lists, tuples and dicts of them."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in _tensors_in(item)]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors_in(v)]
    return []


def model_state_bytes(model: torch.nn.Module, optimizer=None) -> dict[str, int]:
    """Bytes this process holds for parameters, fp32 master weights, gradients and optimizer states.

    ``model`` is the prepared model (a DeepSpeed engine or DDP module, or a plain module); ``optimizer`` the
    prepared optimizer. Under ZeRO-3 a parameter counts only its local partition (``ds_tensor``); gathered
    full parameters are reported separately as ``gathered_parameters``. Storages are counted once: a
    DeepSpeed flat buffer that backs many parameters counts as one.
    """
    ledger = _Ledger()
    engine_optimizer = getattr(model, "optimizer", None)  # a DeepSpeed engine's ZeRO optimizer
    inner = getattr(optimizer, "optimizer", optimizer)  # unwrap Accelerate's wrapper
    params = list(model.parameters())
    partitions = [p.ds_tensor for p in params if hasattr(p, "ds_tensor")]
    if partitions:  # ZeRO-3: the local partitions are the parameters; their flat buffers too
        ledger.add("parameters", partitions)
        ledger.add("parameters", _tensors_in(getattr(engine_optimizer, "fp16_partitioned_groups_flat", [])))
        ledger.add("gathered_parameters", [p.data for p in params])
    else:
        ledger.add("parameters", [p.data for p in params])
        ledger.add("parameters", _tensors_in(getattr(engine_optimizer, "bit16_groups_flat", [])))
    ledger.add("master_weights", _tensors_in(getattr(engine_optimizer, "fp32_partitioned_groups_flat", [])))
    ledger.add("master_weights", _tensors_in(getattr(engine_optimizer, "single_partition_of_fp32_groups", [])))
    grads = [p.grad for p in params if p.grad is not None]
    for name in ("grad_partitions_flat_buffer", "averaged_gradients"):
        grads += _tensors_in(getattr(engine_optimizer, name, []))
    for group in ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups"):
        grads += [t.grad for t in _tensors_in(getattr(engine_optimizer, group, [])) if t.grad is not None]
    ledger.add("gradients", grads)
    states = []
    for candidate in (inner, getattr(engine_optimizer, "optimizer", None)):
        state = getattr(candidate, "state", None)
        if state:
            states += [t for s in state.values() for t in _tensors_in(s)]
    ledger.add("optimizer_states", states)
    return ledger.bytes


def live_tensor_bytes() -> int:
    """Bytes of every CPU tensor storage reachable from Python objects (each storage once)."""
    ledger = _Ledger()
    gc.collect()
    ledger.add("all", [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor) and obj.device.type == "cpu"])
    return ledger.bytes.get("all", 0)

