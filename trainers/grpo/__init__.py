"""GRPO: the trainer, its rollout stage (samplers, rewards, advantages), its objectives and metrics."""

from trainers.grpo.config import GRPOConfig
from trainers.grpo.trainer import GRPOTrainer

__all__ = ["GRPOConfig", "GRPOTrainer"]
