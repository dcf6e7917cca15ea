"""A short distillation job for tests/distributed (2 processes, launched) and its one-process reference; writes a
JSON report per rank.

argv: model_dir output_dir [rows_per_process]
First 3 steps from the dataset's completions (lmbda=0: the same rows whatever the process count, so the run can be
compared with one process), then 2 on-policy steps (the student samples; under ZeRO-3 its weights are gathered
for it). The teacher is the model with its weights moved by seeded noise, prepared as a frozen model: under
ZeRO-3 each process holds its share of every teacher weight.
"""

import json
import os
import sys

import torch

from trainers import DistillationConfig, DistillationTrainer
from trainers.parallel.distributed import gathered_parameters, zero_stage

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # tests.conftest
from tests.conftest import noisy_model  # noqa: E402

PROMPTS = ["abc", "hello", "xyz", "12", "the", "cat", "sat", "on"]


def save_teacher(model_dir: str, output_dir: str) -> str:
    """The model with its weights moved by seeded noise, saved (each process its own copy) before any trainer: once
    a ZeRO-3 trainer exists, from_pretrained partitions what it loads, and the noise would miss the weights."""
    teacher = noisy_model(model_dir)
    path = os.path.join(output_dir, f"teacher-{os.environ.get('RANK', '0')}")
    teacher.save_pretrained(path)
    return path


def run(model_dir, teacher_dir, output_dir, rows, steps, lmbda):
    rows_ = [{"prompt": p, "completion": f"{len(p)}{p[::-1]}"} for p in PROMPTS]
    trainer = DistillationTrainer(
        model=model_dir, teacher_model=teacher_dir, train_dataset=rows_,
        args=DistillationConfig(output_dir=output_dir, per_device_train_batch_size=rows, max_completion_length=6,
                                learning_rate=1e-2, max_steps=steps, beta=0.5, lmbda=lmbda, logging_steps=1,
                                save_strategy="no", disable_tqdm=True, seed=0, bf16=False, report_to="none"))
    trainer.train()
    return trainer


def main():
    model_dir, output_dir = sys.argv[1], sys.argv[2]
    rows = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    teacher_dir = save_teacher(model_dir, output_dir)
    trainer = run(model_dir, teacher_dir, output_dir, rows, 3, 0.0)
    acc = trainer.accelerator
    teacher = trainer.teacher_model
    # under ZeRO-3 a parameter's local shard (ds_tensor) against its full size (ds_numel)
    held = sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in teacher.parameters())
    full = sum(getattr(p, "ds_numel", p.numel()) for p in teacher.parameters())
    with gathered_parameters(acc, trainer.model):
        checksum = [float(p.detach().double().sum()) for p in trainer.model.parameters()]
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    on_policy = run(model_dir, teacher_dir, output_dir, rows, 2, 1.0)
    report = {"rank": acc.process_index, "zero_stage": zero_stage(acc), "losses": losses, "checksum": checksum,
              "teacher_held": held, "teacher_full": full,
              "on_policy_losses": [r["loss"] for r in on_policy.state.log_history if "loss" in r]}
    with open(os.path.join(output_dir, f"report-{acc.process_index}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
