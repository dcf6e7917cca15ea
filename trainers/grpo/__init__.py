"""GRPO: the trainer, its rollout stage (rewards, advantages, masks, log-probs over a generation backend), its
objectives and metrics."""

from trainers.grpo.asynchronous import AsyncGRPOConfig, AsyncGRPOTrainer
from trainers.grpo.config import GRPOConfig
from trainers.grpo.trainer import GRPOTrainer

__all__ = ["AsyncGRPOConfig", "AsyncGRPOTrainer", "GRPOConfig", "GRPOTrainer"]
