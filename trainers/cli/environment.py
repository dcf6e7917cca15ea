"""``trainers env``: versions, devices, and the distributed set-up this process (or a template) gets."""

from __future__ import annotations

import importlib.metadata
import os
import platform

from trainers.cli.templates import resolve_template

PACKAGES = ("trainers", "torch", "transformers", "accelerate", "deepspeed", "peft", "datasets", "safetensors", "trl",
            "matplotlib", "tensorboard")
LAUNCH_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "ACCELERATE_USE_DEEPSPEED",
                    "ACCELERATE_USE_FSDP", "ACCELERATE_MIXED_PRECISION")


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def devices() -> dict[str, str]:
    import torch

    out = {"cpu cores": str(os.cpu_count())}
    try:
        pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        out["host memory"] = f"{pages * page_size / 2**30:.1f} GiB"
    except (ValueError, OSError):
        pass
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            out[f"cuda:{i}"] = f"{props.name}, {props.total_memory / 2**30:.1f} GiB"
        out["bf16 supported"] = str(torch.cuda.is_bf16_supported())
    else:
        out["gpu"] = "none (training runs on CPU; multi-process over gloo)"
    return out


def distributed_setup(template: str | None = None) -> dict[str, str]:
    """What this process was launched with, and (optionally) what a template would set."""
    out = {name: os.environ[name] for name in LAUNCH_VARIABLES if name in os.environ}
    if not out:
        out["launch"] = "single process (not started by accelerate launch / torchrun)"
    if template:
        import yaml

        path = resolve_template(template)
        with open(path) as f:
            config = yaml.safe_load(f)
        deepspeed = config.get("deepspeed_config") or {}
        out["template"] = path
        out["distributed_type"] = str(config.get("distributed_type"))
        out["num_processes"] = str(config.get("num_processes"))
        out["mixed_precision"] = str(config.get("mixed_precision"))
        if deepspeed:
            out["zero_stage"] = str(deepspeed.get("zero_stage"))
            out["offload"] = (f"optimizer: {deepspeed.get('offload_optimizer_device', 'none')}, "
                              f"params: {deepspeed.get('offload_param_device', 'none')}")
    return out


def describe(template: str | None = None) -> str:
    sections = {"versions": versions(), "devices": devices(), "distributed": distributed_setup(template)}
    lines = []
    for title, values in sections.items():
        lines.append(f"{title}:")
        width = max(len(k) for k in values)
        lines += [f"  {k.ljust(width)}  {v}" for k, v in values.items()]
    return "\n".join(lines)
