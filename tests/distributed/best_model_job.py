"""Best-checkpoint and model-only checkpoints under 2 processes, launched by test_best_model_distributed.py.

argv: model_dir output_dir. Writes report-<rank>.json with what each run found.
"""

import json
import os
import sys

import torch

from trainers import SFTConfig, SFTTrainer
from trainers.parallel.distributed import gathered_parameters
from trainers.errors import ConfigError
from trainers.cli.tiny import as_sft_rows, reverse_digits_rows


def config(output_dir, **overrides):
    return SFTConfig(output_dir=output_dir, per_device_train_batch_size=4, learning_rate=1e-3, max_steps=6,
                     logging_steps=1, disable_tqdm=True, seed=0, bf16=False, **overrides)


def main():
    model_dir, output_dir = sys.argv[1], sys.argv[2]
    rows = as_sft_rows(reverse_digits_rows(48, seed=3))
    report = {}
    # The eval loss falls, so "greater is better" makes step 2 the best: training must end on its weights.
    best = SFTTrainer(model=model_dir, train_dataset=rows, eval_dataset=rows[:12], args=config(
        os.path.join(output_dir, "best"), eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2,
        save_total_limit=1, load_best_model_at_end=True, greater_is_better=True))
    best.train()
    report["evals"] = [r["eval_loss"] for r in best.state.log_history if "eval_loss" in r]
    report["best_metric"] = best.state.best_metric
    report["eval_after"] = best.evaluate()["eval_loss"]
    report["rank"] = best.accelerator.process_index
    # Model-only checkpoints: the gathered weights, in Hugging Face format.
    only = SFTTrainer(model=model_dir, train_dataset=rows, args=config(
        os.path.join(output_dir, "only"), save_strategy="steps", save_steps=3, save_only_model=True))
    only.train()
    with gathered_parameters(only.accelerator, only.model):
        report["final_weights"] = {name: float(p.detach().double().sum())
                                   for name, p in only.unwrapped_model.named_parameters()}
    try:
        SFTTrainer(model=model_dir, train_dataset=rows, eval_dataset=rows[:12], args=config(
            os.path.join(output_dir, "refused"), eval_strategy="steps", save_steps=10, eval_steps=10,
            load_best_model_at_end=True, save_only_model=True))
        report["refused"] = None
    except ConfigError as error:
        report["refused"] = str(error)
    with open(os.path.join(output_dir, f"report-{report['rank']}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
