"""KTO: Kahneman-Tversky optimization on unpaired desirable / undesirable completions."""

from trainers.kto.config import KTOConfig
from trainers.kto.trainer import KTOTrainer

__all__ = ["KTOConfig", "KTOTrainer"]
