"""SDPA attention alone, forward + backward, as the small model's training forward calls it (CPU): the bf16
flash kernel, the bf16 math kernel, and the flash kernel on float32 copies of bf16 inputs (what
``trainers/parallel/host.py`` runs under bf16 autocast), at several sequence lengths. Median of 8 after 3 warm-ups.

    python benchmarks/attention.py
"""

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from trainers.parallel.host import keep_host_memory  # noqa: E402  (as the trainers run)


def median_ms(fn, repeats: int = 8) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2] * 1e3


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--lengths", type=int, nargs="+", default=[48, 80, 112, 144, 176, 208, 272])
    cli = parser.parse_args()
    keep_host_memory()
    B, H, KV, D = cli.rows, 12, 4, 64  # the small benchmark model: 12 query heads, 4 KV heads, head dim 64
    variants = {
        "flash bf16": (SDPBackend.FLASH_ATTENTION, torch.bfloat16, False),
        "math bf16": (SDPBackend.MATH, torch.bfloat16, False),
        "flash fp32 from bf16": (SDPBackend.FLASH_ATTENTION, torch.bfloat16, True),
        "flash fp32": (SDPBackend.FLASH_ATTENTION, torch.float32, False),
    }
    print("| tokens | " + " | ".join(variants) + " |")
    print("|---" * (len(variants) + 1) + "|")
    for T in cli.lengths:
        mask = torch.tril(torch.ones(T, T, dtype=torch.bool)).expand(B, 1, T, T).clone()  # [B, 1, T, T]
        mask[: B // 2, :, :, :3] = False  # left padding on half the rows, as GRPO prompts have
        mask |= torch.eye(T, dtype=torch.bool)
        cells = []
        for backend, dtype, upcast in variants.values():
            q = torch.randn(B, H, T, D, dtype=dtype, requires_grad=True)
            k = torch.randn(B, KV, T, D, dtype=dtype, requires_grad=True)
            v = torch.randn(B, KV, T, D, dtype=dtype, requires_grad=True)
            grad = torch.randn(B, H, T, D, dtype=dtype)

            def step():
                with sdpa_kernel([backend]):
                    args = (q.float(), k.float(), v.float()) if upcast else (q, k, v)
                    out = F.scaled_dot_product_attention(*args, attn_mask=mask, enable_gqa=True)
                out.to(dtype).backward(grad)

            cells.append(f"{median_ms(step):.1f} ms")
        print(f"| {T} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
