"""Models and the output head: loading, the one forward (per-token log-probs without full-vocabulary logits), losses,
the frozen reference."""
