"""A 2-process GRPO job whose reward function fails on rank 1 only, in the second generation round; or
(--sleep) a job that just trains slowly, for signal tests."""

import os
import sys
import time

import torch

from trainers import GRPOConfig, GRPOTrainer


def main():
    model, out, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    rank = int(os.environ.get("RANK", "0"))
    calls = {"n": 0}

    def reward(completions, **kwargs):
        calls["n"] += 1
        if mode == "fail" and rank == 1 and calls["n"] == 2:
            raise RuntimeError("the judge service is down (simulated on rank 1)")
        if mode == "sleep":
            time.sleep(0.3)
        return [float(len(c)) for c in completions]

    args = GRPOConfig(output_dir=out, per_device_train_batch_size=4, num_generations=4, max_completion_length=4,
                      learning_rate=1e-3, max_steps=200, logging_steps=1, save_strategy="no", disable_tqdm=True,
                      bf16=False)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, train_dataset=[{"prompt": "abc"}, {"prompt": "xyz"}],
                          args=args)
    trainer.train()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
