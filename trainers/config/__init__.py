"""Configuration: TrainingConfig, opt() fields with declared constraints, and TRL's options accepted at their default."""
