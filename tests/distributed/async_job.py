"""Asynchronous GRPO (async_generation) with 2 processes, launched by tests/distributed/test_async_distributed.py;
writes a JSON report per rank. The engine is tests/copy_engine.py (a copy of the policy updated only by weight
syncs); each process's producer samples its own rows.

argv: model_dir output_dir
Runs 4 steps synchronously, then with max_staleness=0 (the same weights), then with max_staleness=1 and an
evaluation every 2 steps (each evaluation's weight push waits for both producers).
"""

import importlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # tests.*
from tests.conftest import digits  # noqa: E402
from trainers import GRPOConfig, GRPOTrainer  # noqa: E402

importlib.import_module("tests.copy_engine")  # registers the copy_engine backend

PROMPTS = [{"prompt": p} for p in ["abc", "hello", "xyz", "12", "the", "cat", "sat", "on"]]


def run(model_dir, out, **overrides):
    args = GRPOConfig(**{**dict(output_dir=out, per_device_train_batch_size=8, num_generations=8,
                                max_completion_length=6, learning_rate=1e-2, max_steps=4, logging_steps=1,
                                save_strategy="no", disable_tqdm=True, seed=0, report_to="none",
                                generation_backend="copy_engine"), **overrides})
    trainer = GRPOTrainer(model=model_dir, reward_funcs=digits, args=args, train_dataset=PROMPTS,
                          eval_dataset=PROMPTS[:2] if overrides.get("eval_strategy") else None)
    trainer.train()
    weights = [float(p.detach().double().sum()) for p in trainer.model.parameters()]
    history = [r for r in trainer.state.log_history if "train_runtime" not in r]
    return trainer, weights, history


def main():
    model_dir, out = sys.argv[1], sys.argv[2]
    _, sync, _ = run(model_dir, os.path.join(out, "sync"))
    _, bound0, history0 = run(model_dir, os.path.join(out, "bound0"), async_generation=True, max_staleness=0)
    last, bound1, history1 = run(model_dir, os.path.join(out, "bound1"), async_generation=True, max_staleness=1,
                                 eval_strategy="steps", eval_steps=2)
    rank = last.accelerator.process_index
    report = {"rank": rank, "sync": sync, "bound0": bound0, "bound1": bound1,
              "staleness0": [r["sample/staleness_max"] for r in history0 if "sample/staleness_max" in r],
              "staleness1": [r["sample/staleness_max"] for r in history1 if "sample/staleness_max" in r],
              "eval_rewards": [r["eval_reward"] for r in history1 if "eval_reward" in r]}
    with open(os.path.join(out, f"report-{rank}.json"), "w") as f:
        json.dump(report, f)
    last.end()  # the process group: one end, after every run (a second DeepSpeed engine joins the first's group)


if __name__ == "__main__":
    main()
