"""The floor under a GRPO benchmark row on this machine: the fewest seconds any implementation of its step needs,
from the matrix products the step cannot skip at the best rates this machine reaches, beside TRL's step.

    python benchmarks/floor.py --only grpo-small-256                 # the floor alone (~1 min)
    python benchmarks/floor.py --only grpo-small-256 --measure 2     # and TRL's and our step, alternating

A GRPO step samples `batch` completions of `completion_length` tokens, then trains on them. What no
implementation can skip (everything else, attention included, is left out, so this is a lower bound):

- training: a forward and a backward over each completion token, 2 FLOPs per weight forward and 4 backward
  (every weight is trained, so both the weight gradient and the gradient to the layer below are needed, down
  to the tied embedding): 6 x N x batch x completion_length, N being the weights a token meets in products
  (the layers and the tied output head). Prompt tokens are left out.
- sampling: completion_length - 1 decode steps (the first token comes from the prompt's forward, left out);
  each step meets every weight once for all rows, so it takes at least the longer of reading the weights
  (N x bytes per weight at the best read bandwidth) and their arithmetic (2 x N x batch FLOPs at the best
  product rate).

Rates are this machine's best, measured here: the fastest ``torch.mm`` among the step's own product shapes and
a 2048^3 one; read bandwidth as a sum over a tensor far larger than the caches. A row's floor divided by TRL's step
is the best ratio against TRL any implementation can reach on this machine (the targets ask for 0.5).
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import partial

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.compare_trl import MODELS, ROWS, alternating, build_models, matmul_parameters, summarize


@dataclass(frozen=True)
class Rates:
    """This machine's best measured rates."""

    flops_per_s: float  # matrix products, in the row's precision
    bytes_per_s: float  # reading memory


@dataclass(frozen=True)
class Floor:
    """Lower bounds, in seconds, for one GRPO step."""

    train_s: float
    sample_s: float

    @property
    def total_s(self) -> float:
        return self.train_s + self.sample_s


def grpo_floor(weights: int, batch: int, completion_length: int, rates: Rates, bytes_per_weight: int) -> Floor:
    """The floor of one GRPO step (module docstring): ``weights`` used in products per token, ``batch``
    completions of ``completion_length`` tokens each."""
    train_flops = 6 * weights * batch * completion_length
    step_read_s = weights * bytes_per_weight / rates.bytes_per_s
    step_math_s = 2 * weights * batch / rates.flops_per_s
    return Floor(train_s=train_flops / rates.flops_per_s,
                 sample_s=(completion_length - 1) * max(step_read_s, step_math_s))


def best_seconds(fn, repeats: int) -> float:
    fn()  # warm-up: first-touch page faults, kernel selection
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def product_rate(shapes: list[tuple[int, int, int]], dtype: torch.dtype, repeats: int = 5) -> float:
    """The best FLOP/s over ``[m, k] x [k, n]`` products of the given shapes."""
    best = 0.0
    for m, k, n in shapes:
        a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
        best = max(best, 2 * m * k * n / best_seconds(partial(torch.mm, a, b), repeats))
    return best


def read_bandwidth(megabytes: int = 1024, repeats: int = 5) -> float:
    """Bytes/s of a sum over a float32 tensor far larger than the caches."""
    x = torch.ones(megabytes * 2**20 // 4)
    return x.numel() * 4 / best_seconds(lambda: x.sum(), repeats)


def training_shapes(shape: dict, tokens: int) -> list[tuple[int, int, int]]:
    """The forward's and backward's product shapes for ``tokens`` tokens through an MLP (the largest weights),
    and a square 2048 product for comparison."""
    hidden, inner = shape["hidden_size"], shape["intermediate_size"]
    return [(tokens, hidden, inner),    # forward: x @ W_up
            (tokens, inner, hidden),    # backward: dY @ W_up^T (gradient to the layer below)
            (hidden, tokens, inner),    # backward: x^T @ dY (weight gradient)
            (2048, 2048, 2048)]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    grpo_names = sorted(name for name, row in ROWS.items() if row[1] == "grpo")
    parser.add_argument("--only", nargs="+", default=grpo_names, help=f"GRPO rows: {grpo_names}")
    parser.add_argument("--bf16", action="store_true",
                        help="bf16 products and bf16 weights for sampling (the rows' --bf16 runs).")
    parser.add_argument("--measure", type=int, default=0,
                        help="Also run TRL's and our step for each row this many times each, alternating.")
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "trainers-bench"))
    cli = parser.parse_args()
    unknown = [name for name in cli.only if name not in grpo_names]
    if unknown:
        parser.error(f"--only: not a GRPO row: {unknown}; known: {grpo_names}")
    if torch.cuda.is_available():
        parser.error("floor.py measures this machine's CPU; on a GPU the bound is a different calculation")
    os.makedirs(cli.workdir, exist_ok=True)
    models = build_models(cli.workdir, sorted({ROWS[name][0] for name in cli.only}))
    dtype, bytes_per_weight = (torch.bfloat16, 2) if cli.bf16 else (torch.float32, 4)
    bandwidth = read_bandwidth()
    print(f"read bandwidth: {bandwidth / 1e9:.1f} GB/s; torch {torch.__version__}, {torch.get_num_threads()} threads")

    print("\n| row | weights | best product rate | floor: training | floor: sampling | floor: step"
          + (" | TRL s/step | ours s/step | ours / TRL | floor / TRL |" if cli.measure else " |"))
    print("|---" * (10 if cli.measure else 6) + "|")
    for name in cli.only:
        model, _, options, steps, warmup = ROWS[name]
        batch, length = options.get("batch", 16), options["completion_length"]
        rate = product_rate(training_shapes(MODELS[model], batch * length), dtype)
        weights = matmul_parameters(models[model])
        floor = grpo_floor(weights, batch, length, Rates(rate, bandwidth), bytes_per_weight)
        cells = [name + ("-bf16" if cli.bf16 else ""), f"{weights / 1e6:.1f}M", f"{rate / 1e9:.0f} GFLOP/s",
                 f"{floor.train_s:.2f} s", f"{floor.sample_s:.2f} s", f"**{floor.total_s:.2f} s**"]
        if cli.measure:
            runs = alternating(models[model], "grpo", {**options, "bf16": cli.bf16}, steps, cli.workdir, cli.measure)
            row = summarize(name, "grpo", runs, warmup, steps)
            trl, ours = (statistics.median(row[framework]["s_per_step"]) for framework in ("trl", "ours"))
            cells += [f"{trl:.2f}", f"{ours:.2f}", f"{ours / trl:.2f}", f"**{floor.total_s / trl:.2f}**"]
        print("| " + " | ".join(cells) + " |")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
