"""The distributed core over Accelerate and DeepSpeed, and the host's tuning (allocator, OpenMP under
notebook_launcher)."""
