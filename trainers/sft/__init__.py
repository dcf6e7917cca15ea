"""SFT: the trainer, how rows become token sequences (formats, loss masks, packing), and predictions."""

from trainers.sft.config import SFTConfig
from trainers.sft.trainer import SFTTrainer

__all__ = ["SFTConfig", "SFTTrainer"]
