"""GRPO: the trainer, its rollout stage (rewards, advantages, masks, log-probs over a generation backend), its
objectives and metrics."""

from trainers.grpo.config import GRPOConfig
from trainers.grpo.trainer import GRPOTrainer

__all__ = ["GRPOConfig", "GRPOTrainer"]
