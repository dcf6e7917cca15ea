"""A short SFT, GRPO, RLOO, distillation, DPO, reward-model or KTO run for the exact-resume and kill tests; run as a
script (1 process or launched).

    python tests/resume_job.py RUN [--then RUN ...]
    RUN: METHOD MODEL OUT TOTAL_STEPS [STOP_AFTER] [--resume] [--save_steps N] [--step_sleep S] [--nan_at STEP ...]
         [--max_nonfinite N] [--extra JSON]

TOTAL_STEPS fixes the schedule (linear decay over all of them); STOP_AFTER ends the run early with a checkpoint, as
a preemption would. The final weights go to OUT/final. GRPO and RLOO use 2 optimizer steps per generation round, so
a checkpoint can fall in the middle of a round. Distillation (from the model with its weights moved by seeded
noise) generates once per step (2 accumulation steps), half its rounds from the dataset (lmbda).

Each `--then` starts another run, trained after the one before in the same process(es): a run builds its own
trainer (which reseeds), so it trains as it would in a process of its own, without paying for another start-up.
The exact-resume tests make the straight and the stopped runs in one process and the resumed runs in a second
one; the kill tests run one run per process, as they must.
"""

import argparse
import json
import os
import sys
import time

import torch

from trainers import (DistillationConfig, DistillationTrainer, DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer,
                      KTOConfig, KTOTrainer, RewardConfig, RewardTrainer, RLOOConfig, RLOOTrainer, SFTConfig,
                      SFTTrainer)
from trainers.cli.tiny import as_sft_rows, reverse_digits_rows

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests.conftest
from tests.conftest import digits, noisy_model  # noqa: E402


def build(method, model, out, total, save_steps, extra, wrap=lambda cls: cls):
    """The trainer of ``method``, of ``wrap(its class)`` (a subclass that changes one public method)."""
    common = {**dict(output_dir=out, max_steps=total, learning_rate=1e-2 if method == "grpo" else 3e-3,
                     lr_scheduler_type="linear", logging_steps=1, save_strategy="steps", save_steps=save_steps,
                     disable_tqdm=True, seed=0, bf16=False), **extra}  # extra wins (logging_steps, ...)
    if method == "sft":
        return wrap(SFTTrainer)(model=model, train_dataset=as_sft_rows(reverse_digits_rows(48, seed=5)),
                          args=SFTConfig(per_device_train_batch_size=4, gradient_accumulation_steps=2, **common))
    if method in ("dpo", "reward", "kto"):  # KTO unpairs them
        pairs = [{"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1)}
                 for a in range(6) for b in range(4)]
        trainer, config = {"dpo": (DPOTrainer, DPOConfig), "reward": (RewardTrainer, RewardConfig),
                           "kto": (KTOTrainer, KTOConfig)}[method]
        return wrap(trainer)(model=model, train_dataset=pairs,
                       args=config(per_device_train_batch_size=4, gradient_accumulation_steps=2, **common))
    rows = [{"prompt": p} for p in ["abc", "hello", "xyz", "12", "the", "cat"]]
    if method == "distill":
        return wrap(DistillationTrainer)(model=model, teacher_model=noisy_model(model),
                                   train_dataset=[{**row, "completion": "123"} for row in rows],
                                   args=DistillationConfig(per_device_train_batch_size=2, gradient_accumulation_steps=2,
                                                           max_completion_length=6, lmbda=0.5, **common))
    trainer, config = (RLOOTrainer, RLOOConfig) if method == "rloo" else (GRPOTrainer, GRPOConfig)
    return wrap(trainer)(model=model, reward_funcs=digits, train_dataset=rows,
                   args=config(per_device_train_batch_size=4, num_generations=4, max_completion_length=6,
                               steps_per_generation=2, **common))


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("method", choices=["sft", "grpo", "rloo", "distill", "dpo", "reward", "kto"])
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("total", type=int)
    parser.add_argument("stop_after", type=int, nargs="?")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--save_steps", type=int, default=1000)
    parser.add_argument("--step_sleep", type=float, default=0.0, help="Slow each step down (kill tests).")
    parser.add_argument("--nan_at", type=int, nargs="*", default=[], help="Steps whose loss is made NaN.")
    parser.add_argument("--max_nonfinite", type=int, default=10)
    parser.add_argument("--extra", type=json.loads, default={}, help="More config fields, as JSON.")
    return parser


def slowed_or_poisoned(cls, cli):
    """``cls`` whose compute_loss sleeps cli.step_sleep seconds and returns NaN at the steps in cli.nan_at."""

    class Poisoned(cls):
        def compute_loss(self, model, batch, counts):
            time.sleep(cli.step_sleep)
            loss, stats = super().compute_loss(model, batch, counts)
            if self.state.global_step + 1 in cli.nan_at:
                loss = loss * float("nan")
            return loss, stats

    return Poisoned


def run(cli: argparse.Namespace) -> None:
    wrap = (lambda cls: slowed_or_poisoned(cls, cli)) if cli.step_sleep or cli.nan_at else (lambda cls: cls)
    trainer = build(cli.method, cli.model, cli.out, cli.total, cli.save_steps,
                    {"max_consecutive_nonfinite_steps": cli.max_nonfinite, **cli.extra}, wrap)
    if cli.stop_after is not None:
        trainer.max_steps = cli.stop_after  # the schedule still spans `total` steps
    trainer.train(resume_from_checkpoint=True if cli.resume else None)
    if cli.stop_after is not None:
        trainer.save_checkpoint()
    trainer.save_model(os.path.join(cli.out, "final"))


def main():
    argv, runs = sys.argv[1:], [[]]
    for arg in argv:  # RUN --then RUN ...
        if arg == "--then":
            runs.append([])
        else:
            runs[-1].append(arg)
    clis = [parser().parse_args(args) for args in runs]  # every run's arguments checked before the first trains
    torch.set_num_threads(1)
    for index, cli in enumerate(clis):
        if len(clis) > 1:  # which run a failure's traceback belongs to
            print(f"resume_job.py: run {index + 1}/{len(clis)}: {' '.join(runs[index])}", flush=True)
        run(cli)


if __name__ == "__main__":
    main()
