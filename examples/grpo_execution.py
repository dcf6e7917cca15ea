"""A demo that learns through code execution alone: a tiny model learns to let Python do the arithmetic.

    python examples/grpo_execution.py             # about 90 s on 2 CPU cores, no network, no GPU

Each prompt is a two-digit addition, "17+25="; the completion is a Python expression, and the reward is the
``code_execution`` reward with ``template="print({completion})"``: the expression runs in the sandbox and passes
when it prints 42. No reward looks at the text.

1. Build a tiny Qwen2 (the arithmetic demo's: width 128, 4 layers) and a byte-level tokenizer offline.
2. Warm up with a short SFT (300 steps) on a mix: 60% of the completions are the sum written out ("42", in the
   usual digit order, which a model this small has barely begun to compute) and 40% (``--copy_share``) the
   expression itself ("17+25"). Afterwards about half of its greedy answers are expressions, and nearly only those
   are right.
3. GRPO on ``code_execution`` alone (60 steps). An expression passes wherever Python evaluates it, a number only
   when the model got the sum right: the policy moves to writing expressions. Over seeds 0-2 on 2 CPU cores,
   held-out accuracy (greedy completions run through the same sandbox) went 52.2% -> 99.2%, 54.2% -> 88.4% and
   47.2% -> 100.0%, every answer an expression after RL (docs/grpo.md). What it learns is to hand the arithmetic
   to Python, which only a reward that runs the code can teach.
"""

import argparse
import os
import random
import sys
import time

from trainers import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer
from trainers.cli.tiny import save_tiny_model
from trainers.rewards import code_execution_reward

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from grpo_arithmetic import MODEL_SHAPE, greedy_texts  # noqa: E402  (examples/grpo_arithmetic.py)

TEMPLATE = "print({completion})"


def make_splits(seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Every two-digit addition as a row: the prompt, the expected stdout as the row's test, the sum for SFT."""
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    random.Random(seed).shuffle(pairs)
    rows = [{"prompt": f"{a}+{b}=", "tests": [{"input": "", "output": str(a + b)}], "expression": f"{a}+{b}",
             "sum": str(a + b)} for a, b in pairs]
    return rows[:500], rows[500:]  # held out, train


def warm_up(model_path: str, train: list[dict], output_dir: str, copy_share: float, steps: int, seed: int):
    """SFT on digits, with ``copy_share`` of the rows answered by their expression instead."""
    rng = random.Random(seed)
    rows = [{"prompt": r["prompt"], "completion": r["expression"] if rng.random() < copy_share else r["sum"]}
            for r in train]
    trainer = SFTTrainer(model=model_path, train_dataset=rows, args=SFTConfig(
        output_dir=output_dir, per_device_train_batch_size=64, learning_rate=1e-3, max_steps=steps,
        lr_scheduler_type="constant_with_warmup", warmup_steps=20, save_strategy="no", logging_steps=steps,
        disable_tqdm=True, seed=seed, bf16=False, report_to="none"))
    trainer.train()
    return trainer.unwrapped_model, trainer.processing_class


def held_out_accuracy(model, tokenizer, rows: list[dict], reward) -> tuple[float, float]:
    """(share of greedy completions whose expression prints the sum, share written as an expression)."""
    texts = greedy_texts(model, tokenizer, rows, max_new_tokens=8)
    scores = reward(completions=texts, tests=[r["tests"] for r in rows])
    return sum(scores) / len(rows), sum("+" in t for t in texts) / len(rows)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default="outputs/grpo-execution")
    parser.add_argument("--copy_share", type=float, default=0.4, help="Share of SFT rows answered by the expression.")
    parser.add_argument("--sft_steps", type=int, default=300)
    parser.add_argument("--grpo_steps", type=int, default=60)
    parser.add_argument("--learning_rate", type=float, default=3e-4)
    parser.add_argument("--seed", type=int, default=0)
    cli = parser.parse_args(argv)

    started = time.time()
    held_out, train = make_splits(cli.seed)
    reward = code_execution_reward(template=TEMPLATE)
    base = save_tiny_model(os.path.join(cli.output_dir, "base-model"), **MODEL_SHAPE)
    print(f"1. tiny model built offline; {len(train)} training / {len(held_out)} held-out problems", flush=True)
    print(f"2. SFT warm-up: {cli.sft_steps} steps, {cli.copy_share:.0%} of the answers written as the expression",
          flush=True)
    model, tokenizer = warm_up(base, train, os.path.join(cli.output_dir, "sft"), cli.copy_share, cli.sft_steps,
                               cli.seed)
    before, before_expressions = held_out_accuracy(model, tokenizer, held_out, reward)
    print(f"   held-out accuracy after SFT: {before:.1%} ({before_expressions:.1%} written as expressions; "
          f"{time.time() - started:.0f} s)", flush=True)

    print(f"3. GRPO: {cli.grpo_steps} steps on code_execution alone (isolation "
          f"{reward.executor.isolation})", flush=True)
    trainer = GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=reward, train_dataset=train,
                          args=GRPOConfig(output_dir=cli.output_dir, per_device_train_batch_size=64,
                                          num_generations=8, max_completion_length=8,
                                          learning_rate=cli.learning_rate, lr_scheduler_type="constant",
                                          max_steps=cli.grpo_steps, logging_steps=10, save_strategy="no",
                                          bf16=False, beta=0.0, seed=cli.seed, report_to="none"))
    trainer.train()
    after, after_expressions = held_out_accuracy(trainer.unwrapped_model, tokenizer, held_out, reward)
    trainer.save_model(os.path.join(cli.output_dir, "final"))
    print(f"\nheld-out accuracy (greedy, {len(held_out)} unseen problems, run in the sandbox): "
          f"before RL {before:.1%} -> after RL {after:.1%}  ({after - before:+.1%}); written as expressions "
          f"{before_expressions:.1%} -> {after_expressions:.1%}")
    print(f"total time {time.time() - started:.0f} s; model saved to {os.path.join(cli.output_dir, 'final')}")
    return before, after


if __name__ == "__main__":
    main()
