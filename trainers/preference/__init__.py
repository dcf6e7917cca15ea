"""The base of the trainers on preference data (DPO, KTO, the reward model): rows, TRL's tokenization, padding,
evaluation batches."""
