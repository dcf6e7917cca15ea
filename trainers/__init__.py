"""trainers: lean RL and supervised fine-tuning for language models, with TRL's names and contracts."""

from trainers.configs import TrainingConfig
from trainers.distillation import DistillationConfig, DistillationTrainer
from trainers.dpo import DPOConfig, DPOTrainer
from trainers.errors import ConfigError
from trainers.grpo import AsyncGRPOConfig, AsyncGRPOTrainer, GRPOConfig, GRPOTrainer
from trainers.kto import KTOConfig, KTOTrainer
from trainers.reward import RewardConfig, RewardTrainer
from trainers.rloo import RLOOConfig, RLOOTrainer
from trainers.sft import SFTConfig, SFTTrainer

__all__ = ["AsyncGRPOConfig", "AsyncGRPOTrainer", "ConfigError", "DistillationConfig", "DistillationTrainer", "DPOConfig", "DPOTrainer", "GRPOConfig",
           "GRPOTrainer", "KTOConfig", "KTOTrainer", "RewardConfig", "RewardTrainer", "RLOOConfig", "RLOOTrainer",
           "SFTConfig", "SFTTrainer", "TrainingConfig"]
__version__ = "0.1.0"
