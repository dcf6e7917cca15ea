"""RLOO (TRL 1.16's RLOOTrainer) on GRPO's rollout stage: its objective (``objective.py``), config and trainer."""

from trainers.rloo.config import RLOOConfig
from trainers.rloo.trainer import RLOOTrainer

__all__ = ["RLOOConfig", "RLOOTrainer"]
