"""Generation alone: the lean engine against HF ``generate`` (and the engine without oneDNN packed weights), on
the benchmark models, for one GRPO round (2 prompts x 8 completions of 64 tokens, forced to full length).

    python benchmarks/generation.py [--tokens 64] [--repeats 3] [--bf16]
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.compare_trl import MODELS, build_models  # noqa: E402
from trainers import engine  # noqa: E402
from trainers.generation import SamplingParams, generate  # noqa: E402


def timed(function, repeats: int) -> float:
    function()  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bf16", action="store_true", help="Under bf16 autocast, as bf16 mixed precision samples.")
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "trainers-bench"))
    cli = parser.parse_args()
    os.makedirs(cli.workdir, exist_ok=True)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print("| model | HF generate s | lean s | lean without packed weights s | HF / lean |")
    print("|---|---|---|---|---|")
    for name, path in build_models(cli.workdir).items():
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        tokenizer = AutoTokenizer.from_pretrained(path)
        prompts = [tokenizer("alpha beta gamma delta the model learns")["input_ids"]] * 8 + \
                  [tokenizer("a cat sat on the mat")["input_ids"]] * 8
        params = SamplingParams(max_new_tokens=cli.tokens, extra={"min_new_tokens": cli.tokens})
        eos = {tokenizer.eos_token_id}

        def run(kind):
            torch.manual_seed(0)
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=cli.bf16):
                generate(model, prompts, params, tokenizer.pad_token_id, eos, engine=kind)

        hf = timed(lambda: run("hf"), cli.repeats)
        lean = timed(lambda: run("lean"), cli.repeats)
        can_pack = engine._can_pack
        engine._can_pack = lambda *a: False
        unpacked = timed(lambda: run("lean"), cli.repeats)
        engine._can_pack = can_pack
        print(f"| {name} ({MODELS[name]['hidden_size']} x {MODELS[name]['num_layers']}) | {hf:.2f} | {lean:.2f} | "
              f"{unpacked:.2f} | {hf / lean:.1f}x |", flush=True)


if __name__ == "__main__":
    main()
