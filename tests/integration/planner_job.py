"""A short SFT run whose peak resident memory the planner test compares with ``trainers plan --device cpu``.

    python tests/integration/planner_job.py --model PATH --out DIR [--batch 4 --seq_len 128 --steps 2]
    accelerate launch --config_file accelerate_configs/zero3.yaml --num_processes 2 tests/integration/planner_job.py ...

Each process writes ``DIR/peak-<rank>.json`` with its peak RSS (VmHWM): run in its own process, so the peak is
this training run's alone (the pytest process's memory does not count).
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository
from benchmarks.memory_probe import peak_rss_bytes  # noqa: E402
from trainers import SFTConfig, SFTTrainer


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--gradient_checkpointing", action="store_true")
    cli = parser.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // int(os.environ.get("WORLD_SIZE", "1"))))
    text = "the quick brown fox jumps over the lazy dog " * 64
    rows = [{"text": text[i:i + cli.seq_len + 8]} for i in range(64)]  # longer than max_length: full rows
    args = SFTConfig(output_dir=cli.out, per_device_train_batch_size=cli.batch, max_length=cli.seq_len,
                     max_steps=cli.steps, use_cpu=True, bf16=False, save_strategy="no", report_to="none",
                     disable_tqdm=True, logging_steps=1, learning_rate=1e-5,
                     gradient_checkpointing=cli.gradient_checkpointing)
    trainer = SFTTrainer(model=cli.model, args=args, train_dataset=rows)
    trainer.train()
    rank = trainer.accelerator.process_index
    os.makedirs(cli.out, exist_ok=True)
    with open(os.path.join(cli.out, f"peak-{rank}.json"), "w") as f:
        json.dump({"rank": rank, "num_processes": trainer.accelerator.num_processes,
                   "peak_rss_bytes": peak_rss_bytes()}, f)


if __name__ == "__main__":
    main()
