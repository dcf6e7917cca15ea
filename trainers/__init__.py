"""trainers: lean RL and supervised fine-tuning for language models, with TRL's names and contracts."""

from trainers.configs import ConfigError, GRPOConfig, SFTConfig, TrainingConfig
from trainers.grpo import GRPOTrainer
from trainers.sft import SFTTrainer

__all__ = ["ConfigError", "GRPOConfig", "GRPOTrainer", "SFTConfig", "SFTTrainer", "TrainingConfig"]
__version__ = "0.1.0"
