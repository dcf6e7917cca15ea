"""Adapter-only weight sync for a PEFT LoRA policy (``vllm_lora_sync``): the engine keeps the base weights and
serves the current adapter, so a sync sends the adapter's weights (1.4% of the bytes at r = 16 on Qwen2.5-0.5B's
shape: docs/benchmarks.md) instead of every weight of the model with each LoRA layer merged.

vLLM loads adapters from a folder (it has no in-memory adapter API): each sync saves the adapter, under a new name
(vLLM keys its prefix cache on the name, so a new name is a fresh cache and nothing computed with the old adapter
is served with the new one), and the engine serves it by that name: a server through ``/v1/load_lora_adapter``
(``trainers vllm-serve ... --enable-lora``), a colocated engine through ``LoRARequest``. A request keeps the
adapter it was sent with: under asynchronous generation a request in flight across a sync finishes on the adapter
it started with, so each of its tokens carries that adapter's version.

``lora_sync_choice`` decides, before the first sync, from what the policy is and what the engine can do; the
merged path stays for what vLLM's adapter format cannot hold (``adapter_problem``).
"""

from __future__ import annotations

import os
import secrets
import shutil
from dataclasses import dataclass

import torch

from trainers.errors import ConfigError
from trainers.logs import logger
from trainers.parallel import distributed as dist

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's accepted --max-lora-rank values


@dataclass(frozen=True)
class Adapter:
    """One saved version of the policy's adapter: the name the engine serves it by, its folder, the optimizer step
    whose weights it holds (the tokens it samples are tagged with it) and a number unique in the run (vLLM's
    ``lora_int_id``)."""

    name: str
    path: str
    version: int | None
    number: int


def is_peft(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def adapter_rank(model: torch.nn.Module) -> int:
    """The largest rank of the active adapter (its ``r``, or a larger one in ``rank_pattern``)."""
    config = model.peft_config[model.active_adapters[0]]
    return max([config.r, *(config.rank_pattern or {}).values()])


def served_rank(rank: int) -> int:
    """The smallest --max-lora-rank vLLM accepts that serves an adapter of ``rank``."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ConfigError(f"vllm_lora_sync: the adapter's rank {rank} is above the largest vLLM serves "
                      f"({VLLM_LORA_RANKS[-1]}); set vllm_lora_sync='merged'.")


def adapter_problem(model: torch.nn.Module) -> str | None:
    """Why the policy's adapter cannot be served by vLLM as an adapter (None: it can). What vLLM's adapter format
    has no place for would be dropped silently by the engine: the merged path sends those weights instead."""
    from peft import LoraConfig

    if len(model.active_adapters) != 1:
        return f"{len(model.active_adapters)} adapters are active ({model.active_adapters}); vLLM serves one"
    config = model.peft_config[model.active_adapters[0]]
    if not isinstance(config, LoraConfig):
        return f"the adapter is a {type(config).__name__}, not LoRA"
    if config.modules_to_save:
        return f"modules_to_save={config.modules_to_save} are trained whole, not as a low-rank delta"
    if config.use_dora:
        return "DoRA's magnitude vector has no place in vLLM's adapter format"
    if config.bias != "none":
        return f"bias={config.bias!r} trains biases, which a LoRA adapter does not carry"
    if getattr(config, "target_parameters", None):
        return "target_parameters (LoRA on MoE parameters) needs vLLM's mixed MoE adapter format"
    targets = [config.target_modules] if isinstance(config.target_modules, str) else list(config.target_modules or [])
    if any("lm_head" in t or "embed_tokens" in t for t in targets):
        return "LoRA on the output head or the embeddings: vLLM restricts those and its log-probs would drop them"
    return None


def lora_sync_choice(setting: str, model: torch.nn.Module, lora_configs: dict[str, dict | None] | None) -> bool:
    """Whether syncs send the adapter alone (vllm_lora_sync=``setting``). ``lora_configs``: in server mode each
    server's LoRA settings (its /server_info ``lora_config``: None when started without --enable-lora); None for
    a colocated engine, which is started to serve the adapter. 'auto' takes the adapter path where it can and says
    why not otherwise (a warning); 'adapter' makes each of those reasons an error; a server whose --max-lora-rank is
    below the adapter's rank is an error either way (it was asked to serve adapters, with too small a rank)."""
    if setting == "merged" or (setting == "auto" and not is_peft(model)):
        return False
    if not is_peft(model):
        raise ConfigError("vllm_lora_sync='adapter' needs a PEFT LoRA policy (peft_config, or a PeftModel); this "
                          "one has no adapter. Leave vllm_lora_sync='auto'.")
    problem = adapter_problem(model)
    if problem is None and lora_configs is not None:
        off = [url for url, config in lora_configs.items() if config is None]
        if off:
            problem = (f"the vLLM server{'s' if len(off) > 1 else ''} {', '.join(off)} "
                       f"{'were' if len(off) > 1 else 'was'} started without --enable-lora (restart with "
                       f"`trainers vllm-serve ... --enable-lora --max-lora-rank {served_rank(adapter_rank(model))}`)")
    if problem is not None:
        if setting == "adapter":
            raise ConfigError(f"vllm_lora_sync='adapter': the adapter alone cannot be synced: {problem}. Set "
                              f"vllm_lora_sync='auto' or 'merged' to send the merged weights.")
        logger.warning(f"vLLM weight sync sends the merged weights (every weight of the model) rather than the "
                       f"adapter alone: {problem}.")
        return False
    rank = adapter_rank(model)
    for url, config in (lora_configs or {}).items():
        if config["max_lora_rank"] < rank:
            raise ConfigError(f"vllm_lora_sync: the adapter has rank {rank} and the vLLM server {url} serves "
                              f"adapters up to --max-lora-rank {config['max_lora_rank']}. Restart it with "
                              f"--max-lora-rank {served_rank(rank)}, or set vllm_lora_sync='merged'.")
    return True


@torch.no_grad()
def adapter_state(accelerator, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The active adapter's LoRA weights (the model's state_dict names), on the CPU; under ZeRO-3 gathered one
    layer at a time. Every process calls it together."""
    from peft.tuners.lora import LoraLayer

    adapter = model.active_adapters[0]
    state = {}
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer) or adapter not in module.lora_A:
            continue
        with dist.gathered_parameters(accelerator, module.lora_A[adapter]), \
                dist.gathered_parameters(accelerator, module.lora_B[adapter]):
            state[f"{name}.lora_A.{adapter}.weight"] = module.lora_A[adapter].weight.detach().cpu().clone()
            state[f"{name}.lora_B.{adapter}.weight"] = module.lora_B[adapter].weight.detach().cpu().clone()
    return state


class AdapterFolders:
    """The policy's adapter saved at each sync under ``root``, as ``policy-<run>-<n>`` (``run``: random, so that a
    server still holding a previous run's adapters never sees a name twice); the newest ``keep`` folders are kept
    (an engine reads an adapter's files again when it was evicted from its cache and a request names it)."""

    def __init__(self, root: str, keep: int):
        self.root, self.keep = os.path.abspath(root), keep
        self.run = secrets.token_hex(4)
        self.count = 0
        self.saved: list[str] = []

    def save(self, accelerator, model: torch.nn.Module, version: int | None, write: bool = True) -> Adapter:
        """The adapter as it is now, saved (``write``: by this process; every process calls it together: under
        ZeRO-3 the gathers are collectives)."""
        self.count += 1
        adapter = Adapter(f"policy-{self.run}-{self.count}", os.path.join(self.root, f"policy-{self.run}-{self.count}"),
                          version, self.count)
        state = adapter_state(accelerator, model)
        if write:
            staging = os.path.join(self.root, f".{os.path.basename(adapter.path)}.tmp")
            shutil.rmtree(staging, ignore_errors=True)
            name = model.active_adapters[0]
            model.save_pretrained(staging, selected_adapters=[name], state_dict=state, safe_serialization=True)
            # PEFT nests an adapter not named "default" in a folder of its name; vLLM wants adapter_config.json
            os.rename(staging if name == "default" else os.path.join(staging, name), adapter.path)
            shutil.rmtree(staging, ignore_errors=True)
            self.saved.append(adapter.path)
            while len(self.saved) > self.keep:
                shutil.rmtree(self.saved.pop(0), ignore_errors=True)
        return adapter

    def remove(self) -> None:
        """Every folder this run saved (the engine that read them is gone)."""
        for path in self.saved:
            shutil.rmtree(path, ignore_errors=True)
        self.saved = []
