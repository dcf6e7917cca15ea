"""On-policy distillation (TRL 1.16's DistillationTrainer): its divergence (``divergence.py``) so far; the trainer on
GRPO's rollout stage is issue 46's next step."""
