"""RLOO (TRL 1.16's RLOOTrainer): its objective (``objective.py``) so far; the trainer on GRPO's rollout stage is
issue 46's next step."""
