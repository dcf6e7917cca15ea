"""How close a float must be to its reference, measured across the CPUs these tests run on (docs/testing.md,
"Floats"). A test never pins a float tighter than the variation between hosts: AMD with AVX-512, AMD with AVX2 only,
Intel with AMX, and torch's and MKL's vector kernels switched off (ATEN_CPU_CAPABILITY=default,
MKL_ENABLE_INSTRUCTIONS=SSE4_2), the way the numbers below were measured.

The TRL comparisons (DPO, KTO, reward model) store TRL 1.16's loss on a fixed batch with the model cast to float64:
a reference without float32's rounding, which a loss computed in float32 on any host is compared to."""

# A float32 loss against the float64 reference: 3.0e-6 measured at worst for DPO's losses (2e-7 for KTO's and the
# reward model's); 2e-5 leaves 7x, and still sees a wrong option: beta 0.31 instead of 0.3 moves the sigmoid loss
# (near log 2 on this batch) by 1.3e-4.
FLOAT32_REL = 2e-5
# The same for the losses that exponentiate the log-ratios (DPO's forward_kl and alpha_divergence), which amplify
# their rounding: 1.6e-5 measured at worst; 1e-4 leaves 6x.
FLOAT32_REL_EXP = 1e-4
# The float64 reference recomputed on another host: its inputs (the model's random init and the perturbation,
# drawn by float32 vector kernels) and the model's float32 rotary embedding differ in their last bits; 8.3e-6
# measured at worst (forward_kl).
FLOAT64_REL = 5e-5
# TRL's float32 loss against this package's on the same host: the chunked output head sums in another order; 1.5e-7
# measured at worst.
SAME_HOST_REL = 1e-5


def assert_trained_alike(weights, reference, learning_rate: float) -> None:
    """Two runs of the same training that differ only in the order of their float sums (micro-batches versus
    accumulation, a precomputed reference, a partitioned model): Adam turns that rounding into differences of a small
    share of the learning rate on weights whose gradient is near 0 (its step is lr x m / sqrt(v) whatever the
    gradient's size); 1.1e-6 measured at lr 1e-3 (AVX2 host). So the bound is 1% of the learning rate, where a real
    difference (another batch, a wrong accumulation scale) moves most weights by about the learning rate each step.
    ``weights`` and ``reference``: dicts of tensors (a state dict) or lists of tensors, in the same order."""
    import torch

    pairs = zip(weights.values(), reference.values()) if isinstance(weights, dict) else zip(weights, reference)
    for got, expected in pairs:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=0.01 * learning_rate)
