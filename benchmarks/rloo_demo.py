"""RLOO on the GRPO demo's task, beside GRPO, from the same warm start with the same settings.

    python benchmarks/rloo_demo.py --seed 0        # ~5 minutes on 2 CPU cores

Builds the demo's warm start (``examples/grpo_arithmetic.py``: tiny model, SFT until 45% on validation), then
trains it with this project's GRPOTrainer and RLOOTrainer (the demo's settings: 800 steps, 8 completions per
prompt, lr 2e-4 cosine, no KL term: beta 0 in both) and prints held-out greedy accuracy every 100 steps.
"""

import argparse
import os
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "examples")]

import grpo_arithmetic as demo  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback  # noqa: E402

from trainers import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer  # noqa: E402
from trainers.cli.tiny import save_tiny_model  # noqa: E402

EVERY = 100


def curve_of(trainer_class, config_class, cli, start, held_out, train, out) -> list[float]:
    tokenizer, curve = AutoTokenizer.from_pretrained(start), []

    class Greedy(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step % EVERY == 0:
                curve.append(demo.greedy_accuracy(model, tokenizer, held_out))

    fields = {**demo.grpo_settings(out, cli.learning_rate, cli.steps, seed=cli.seed), "disable_tqdm": True}
    trainer_class(model=AutoModelForCausalLM.from_pretrained(start), processing_class=tokenizer,
                  reward_funcs=demo.exact_answer, train_dataset=train, callbacks=[Greedy()],
                  args=config_class(**fields)).train()
    return curve


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0, help="The demo's --seed: which SFT start.")
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--learning_rate", type=float, default=2e-4)
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
        for name, trainer_class, config_class in (("grpo", GRPOTrainer, GRPOConfig), ("rloo", RLOOTrainer, RLOOConfig)):
            began = time.perf_counter()
            curve = curve_of(trainer_class, config_class, cli, start, held_out, train, os.path.join(work, name))
            rows.append((name, curve, time.perf_counter() - began))
    print(f"\nSFT start (seed {cli.seed}): held-out {before:.1%}; lr {cli.learning_rate} cosine, {cli.steps} steps, "
          f"beta 0; held-out greedy accuracy every {EVERY} steps:")
    for name, curve, seconds in rows:
        print(f"  {name:5s} {' '.join(f'{a:.1%}' for a in curve)}   ({seconds:.0f} s)")


if __name__ == "__main__":
    main()
