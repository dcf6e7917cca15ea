"""The training forward + backward of one GRPO micro-batch with some completions at advantage 0, with and without
skip_zero_gradient_rows (docs/benchmarks.md, "Completions without a gradient").

    python benchmarks/zero_gradient_rows.py                 # the small model (width 768, 12 layers), 16 x 64 tokens
    python benchmarks/zero_gradient_rows.py --model tiny

Prints the median over --repeats of compute_loss + backward per micro-batch, for 0, 4, 8, 12 and 16 of its 16
completions at advantage 0 (whole groups, as a group whose rewards are all equal gives), skipping on and off.
"""

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.compare_trl import build_models  # noqa: E402
from trainers import GRPOConfig, GRPOTrainer  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["tiny", "small"], default="small")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "trainers-bench"))
    cli = parser.parse_args()
    os.makedirs(cli.workdir, exist_ok=True)
    model = build_models(cli.workdir, [cli.model])[cli.model]
    prompts = [{"prompt": p} for p in ["the cat sat on the mat", "alpha beta gamma", "a policy learns fast",
                                            "the model learns"]]
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
                          train_dataset=prompts, args=GRPOConfig(
                              output_dir=tempfile.mkdtemp(dir=cli.workdir), per_device_train_batch_size=16,
                              num_generations=4, max_completion_length=cli.tokens, report_to="none",
                              generation_kwargs={"min_new_tokens": cli.tokens}, disable_tqdm=True, seed=0))
    trainer.prepare_step(0)
    batch = trainer.micro_batch(0, 0)
    print(f"{cli.model} model, 16 completions of {cli.tokens} tokens (prompts {batch.prompt_ids.shape[1]} tokens)")
    print("| completions at advantage 0 | all trained (s) | skipping (s) | skipping / all |")
    print("|---|---|---|---|")
    for idle in (0, 4, 8, 12, 16):
        advantages = batch.advantages.clone()
        advantages[:idle] = 0.0
        idle_batch = dataclasses.replace(batch, advantages=advantages)
        counts = trainer._count([idle_batch])[0]
        times = {}
        for skip in (False, True):
            trainer.args.skip_zero_gradient_rows = skip
            trainer.scorer.__dict__.pop("skips_zero_gradient_rows", None)
            runs = []
            for _ in range(cli.repeats + 1):  # the first is a warm-up
                trainer.model.zero_grad(set_to_none=True)
                started = time.perf_counter()
                loss, _ = trainer.compute_loss(trainer.model, idle_batch, counts)
                loss.backward()
                runs.append(time.perf_counter() - started)
            times[skip] = statistics.median(runs[1:])
        print(f"| {idle} / 16 | {times[False]:.3f} | {times[True]:.3f} | {times[True] / times[False]:.2f} |")


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
