"""On-policy distillation (TRL 1.16's DistillationTrainer): the config, the trainer on the sampling base, the
teacher (local or served) and the divergence."""

from trainers.distillation.config import DistillationConfig
from trainers.distillation.trainer import DistillationTrainer

__all__ = ["DistillationConfig", "DistillationTrainer"]
