"""GRPO's training step on ragged completions: padded micro-batches of rows, padding_free, and padding_free with
token_budget (docs/benchmarks.md, "Token-budget micro-batches").

    python benchmarks/token_budget.py                      # the tiny model with Qwen2.5's 151,936 vocabulary
    python benchmarks/token_budget.py --model small --longest 1024 --budgets 1536 3072 --modes padding_free

Each mode runs in a process of its own (its peak RSS is its own): 16 completions per step (8 per prompt), their
lengths drawn log-uniformly from 8 to --longest tokens by a rollout function (the same ones in every mode, so only the
training forward and backward differ), beta=0, one micro-batch of 16 rows per step. Prints the median step time
over --steps steps after one warm-up, the peak RSS during training (above the process's RSS once the trainer is
built), the forwards with a gradient per step, and the final loss (equal across modes: the dapo loss does not
depend on the grouping).
"""

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

PROMPTS = ["the cat sat on the mat and looked at the door", "alpha beta gamma", "a policy learns fast when",
           "write a short story about a small robot who wants to learn to paint the sea at night"]


def ragged(prompts, trainer):
    """Completions of log-uniform lengths in [8, max_completion_length] tokens, random ids below 8,192 (the
    same per step in every mode)."""
    draw, longest = random.Random(trainer.state.global_step), trainer.args.max_completion_length
    tokenizer = trainer.processing_class
    completions = [[draw.randrange(300, 8000) for _ in range(int(8 * (longest / 8) ** draw.uniform(0, 1)))]
                   for _ in prompts]
    return {"prompt_ids": [tokenizer(p)["input_ids"] for p in prompts], "completion_ids": completions,
            "logprobs": None}


def child(model: str, mode: str, steps: int, longest: int, workdir: str) -> dict:
    import torch
    from transformers import TrainerCallback

    from memory_probe import peak_rss_bytes, reset_peak_rss, rss_bytes
    from trainers import GRPOConfig, GRPOTrainer

    torch.manual_seed(0)
    forwards = []

    class Steps(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            forwards.append(0)

    options = {} if mode == "padded" else {"padding_free": True}
    if mode.startswith("budget="):
        options["token_budget"] = int(mode.split("=")[1])
    args = GRPOConfig(output_dir=tempfile.mkdtemp(dir=workdir), per_device_train_batch_size=16, num_generations=8,
                      max_completion_length=longest, max_steps=steps + 1, logging_steps=1, save_strategy="no",
                      report_to="none", disable_tqdm=True, seed=0, beta=0.0, learning_rate=1e-5, **options)
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [float(len(c) % 7) for c in completions],
                          train_dataset=[{"prompt": p} for p in PROMPTS], args=args, rollout_func=ragged,
                          callbacks=[Steps()])

    def count(module, call_args, kwargs):
        if torch.is_grad_enabled():
            forwards[-1] += 1

    trainer.model.register_forward_pre_hook(count, with_kwargs=True)
    base = rss_bytes()
    reset_peak_rss()
    started = time.perf_counter()
    trainer.train()
    records = [r for r in trainer.state.log_history if "step_time" in r]
    return {"step_time": statistics.median(r["step_time"] for r in records[1:]),
            "peak_mb": (peak_rss_bytes() - base) / 2**20, "forwards": statistics.median(forwards[1:]),
            "loss": records[-1]["loss"], "wall": time.perf_counter() - started}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["tiny", "tiny152k", "small"], default="tiny152k")
    parser.add_argument("--longest", type=int, default=256, help="max_completion_length")
    parser.add_argument("--budgets", type=int, nargs="+", default=[512, 1024])
    parser.add_argument("--modes", nargs="+", default=["padded", "padding_free"], help="besides the budgets")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "trainers-bench"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    cli = parser.parse_args()
    os.makedirs(cli.workdir, exist_ok=True)
    from compare_trl import build_models

    model = build_models(cli.workdir, [cli.model])[cli.model]
    if cli.child:
        print(json.dumps(child(model, cli.child, cli.steps, cli.longest, cli.workdir)))
        return
    print(f"{cli.model} model, 16 completions of 8-{cli.longest} tokens per step, {cli.steps} steps after a warm-up")
    print("| mode | step time (s) | peak RSS in training (MB) | forwards per step | final loss |")
    print("|---|---|---|---|---|")
    for mode in cli.modes + [f"budget={b}" for b in cli.budgets]:
        out = subprocess.run([sys.executable, __file__, "--model", cli.model, "--steps", str(cli.steps),
                              "--longest", str(cli.longest), "--workdir", cli.workdir, "--child", mode],
                             capture_output=True, text=True)
        if out.returncode:
            raise SystemExit(f"{mode} failed:\n{out.stderr[-3000:]}")
        result = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"| {mode} | {result['step_time']:.2f} | {result['peak_mb']:.0f} | {result['forwards']:g} | "
              f"{result['loss']:.6f} |", flush=True)


if __name__ == "__main__":
    main()
