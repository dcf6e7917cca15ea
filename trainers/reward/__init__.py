"""Reward modelling: a sequence classifier trained on preference pairs (Bradley-Terry)."""

from trainers.reward.config import RewardConfig
from trainers.reward.trainer import RewardTrainer

__all__ = ["RewardConfig", "RewardTrainer"]
