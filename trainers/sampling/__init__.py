"""The sampling base: what every trainer that learns from its own samples shares (GRPO, RLOO, distillation)."""
