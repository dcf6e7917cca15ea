"""The demo's RL stage in this project and in TRL, from the same SFT start with the same settings.

    python benchmarks/demo_parity.py --seed 2                      # the demo's settings (lr 2e-4, cosine)
    python benchmarks/demo_parity.py --seed 2 --learning_rate 4e-4 --lr_scheduler_type constant
    python benchmarks/demo_parity.py --seed 0 --runs ours ours-rloo  # RLOO beside GRPO (docs/rloo.md)

Builds the demo's warm start (``examples/grpo_arithmetic.py``: tiny model, SFT until 45% on validation),
then trains it with GRPO in each framework (``--runs``: ours, trl; ours-rloo is this project's RLOOTrainer with
the same settings) and prints held-out greedy accuracy every 100 steps. Learning the same thing from the same
start is the check that our GRPO is TRL's GRPO; wall times include the evaluations.
"""

import argparse
import os
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "examples")]

import grpo_arithmetic as demo  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from trainers.cli.tiny import save_tiny_model  # noqa: E402

EVERY = 100


def config_fields(cli, out: str) -> dict:
    return {**demo.grpo_settings(out, cli.learning_rate, cli.steps, lr_scheduler_type=cli.lr_scheduler_type),
            "disable_tqdm": True}


def run_ours(cli, start: str, held_out, train, out: str, algorithm: str = "grpo") -> list[float]:
    """This project's GRPOTrainer, or with ``algorithm="rloo"`` its RLOOTrainer (the same fields)."""
    import trainers

    base, config_class = {"grpo": (trainers.GRPOTrainer, trainers.GRPOConfig),
                          "rloo": (trainers.RLOOTrainer, trainers.RLOOConfig)}[algorithm]
    tokenizer, curve = AutoTokenizer.from_pretrained(start), []

    class Trainer(base):  # evaluation hook: held-out greedy accuracy instead of eval_dataset metrics
        def has_eval_data(self):
            return True

        def evaluate(self):
            curve.append(demo.greedy_accuracy(self.unwrapped_model, tokenizer, held_out))
            return {}

    Trainer(model=AutoModelForCausalLM.from_pretrained(start), processing_class=tokenizer,
            reward_funcs=demo.exact_answer, train_dataset=train,
            args=config_class(eval_strategy="steps", eval_steps=EVERY, **config_fields(cli, out))).train()
    return curve


def run_trl(cli, start: str, held_out, train, out: str) -> list[float]:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    tokenizer, curve = AutoTokenizer.from_pretrained(start), []

    class Evaluate(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step % EVERY == 0:
                curve.append(demo.greedy_accuracy(model, tokenizer, held_out))

    GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(start), processing_class=tokenizer,
                reward_funcs=demo.exact_answer, train_dataset=Dataset.from_list(train), callbacks=[Evaluate()],
                args=GRPOConfig(use_cpu=True, gradient_checkpointing=False, **config_fields(cli, out))).train()
    return curve


RUNS = {"ours": run_ours, "trl": run_trl,
        "ours-rloo": lambda cli, start, held_out, train, out: run_ours(cli, start, held_out, train, out, "rloo")}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0, help="The demo's --seed: which SFT start.")
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--learning_rate", type=float, default=2e-4)
    parser.add_argument("--lr_scheduler_type", default="cosine")
    parser.add_argument("--runs", nargs="+", choices=sorted(RUNS), default=["ours", "trl"])
    cli = parser.parse_args()

    held_out, validation, train = demo.make_splits()
    with tempfile.TemporaryDirectory() as work:
        base = save_tiny_model(os.path.join(work, "base"), **demo.MODEL_SHAPE)
        model, tokenizer = demo.warm_up(base, train, validation, os.path.join(work, "sft"), 0.45, cli.seed)
        start = os.path.join(work, "start")
        model.save_pretrained(start)
        tokenizer.save_pretrained(start)
        before = demo.greedy_accuracy(model, tokenizer, held_out)
        rows = []
        for name in cli.runs:
            began = time.perf_counter()
            curve = RUNS[name](cli, start, held_out, train, os.path.join(work, name))
            rows.append((name, curve, time.perf_counter() - began))

    print(f"\nSFT start (seed {cli.seed}): held-out {before:.1%}; GRPO lr {cli.learning_rate} {cli.lr_scheduler_type}, "
          f"{cli.steps} steps; held-out greedy accuracy every {EVERY} steps:")
    for name, curve, seconds in rows:
        print(f"  {name:9s} {' '.join(f'{a:.1%}' for a in curve)}   ({seconds:.0f} s)")


if __name__ == "__main__":
    main()
