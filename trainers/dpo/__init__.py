"""DPO: the trainer, how preference rows become token sequences, and the preference losses."""

from trainers.dpo.config import DPOConfig
from trainers.dpo.trainer import DPOTrainer

__all__ = ["DPOConfig", "DPOTrainer"]
