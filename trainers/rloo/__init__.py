"""RLOO (TRL 1.16's RLOOTrainer) on the sampling base (a sibling of GRPO): its objective (``objective.py``), config and trainer."""

from trainers.rloo.config import RLOOConfig
from trainers.rloo.trainer import RLOOTrainer

__all__ = ["RLOOConfig", "RLOOTrainer"]
