"""trainers: lean RL, preference and supervised fine-tuning for language models, with TRL's names and contracts.

The names below are imported on first use (PEP 562), so that ``import trainers.parallel.distributed`` or the CLI's
``trainers vllm-serve`` (every launched worker, every server start) does not pay for transformers, peft and all
nine trainers (~4 s of a 2-core host's start-up) before it needs them. ``from trainers import GRPOTrainer`` and
``trainers.GRPOTrainer`` work as with eager imports."""

import importlib
from typing import TYPE_CHECKING

# Eager, and light (torch, no transformers): it registers the fork hook that releases OpenMP's threads before
# accelerate's notebook_launcher forks, so `import trainers` in a notebook is what makes that safe
# (docs/distributed.md).
from trainers.parallel import notebook_fork as _notebook_fork  # noqa: F401

# each exported name -> the module that defines it
_EXPORTS = {
    "TrainingConfig": "trainers.config.training",
    "ConfigError": "trainers.errors",
    "DistillationConfig": "trainers.distillation", "DistillationTrainer": "trainers.distillation",
    "DPOConfig": "trainers.dpo", "DPOTrainer": "trainers.dpo",
    "AsyncGRPOConfig": "trainers.grpo", "AsyncGRPOTrainer": "trainers.grpo",
    "GRPOConfig": "trainers.grpo", "GRPOTrainer": "trainers.grpo",
    "KTOConfig": "trainers.kto", "KTOTrainer": "trainers.kto",
    "RewardConfig": "trainers.reward", "RewardTrainer": "trainers.reward",
    "RLOOConfig": "trainers.rloo", "RLOOTrainer": "trainers.rloo",
    "SFTConfig": "trainers.sft", "SFTTrainer": "trainers.sft",
}
__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'trainers' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups do not come back here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:  # for type checkers and editors: the same names, eagerly
    from trainers.config.training import TrainingConfig  # noqa: F401
    from trainers.distillation import DistillationConfig, DistillationTrainer  # noqa: F401
    from trainers.dpo import DPOConfig, DPOTrainer  # noqa: F401
    from trainers.errors import ConfigError  # noqa: F401
    from trainers.grpo import AsyncGRPOConfig, AsyncGRPOTrainer, GRPOConfig, GRPOTrainer  # noqa: F401
    from trainers.kto import KTOConfig, KTOTrainer  # noqa: F401
    from trainers.reward import RewardConfig, RewardTrainer  # noqa: F401
    from trainers.rloo import RLOOConfig, RLOOTrainer  # noqa: F401
    from trainers.sft import SFTConfig, SFTTrainer  # noqa: F401
