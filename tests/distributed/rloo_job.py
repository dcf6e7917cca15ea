"""A short RLOO job launched by tests/distributed with 2 processes; writes a JSON report per rank.

argv: model_dir output_dir
Layout: per-device 2 completions, num_generations 4, 2 processes: each round has one prompt whose group of 4 is
split 2 + 2 across the processes, so each completion's leave-one-out baseline needs the other process's rewards
(and its KL penalty, the other process's log-probs).
"""

import json
import os
import sys

import torch
from transformers import TrainerCallback

from trainers import RLOOConfig, RLOOTrainer
from trainers.parallel.distributed import gathered_parameters, zero_stage
from trainers.rloo.objective import sequence_kl


class Rounds(TrainerCallback):
    """Each round this process holds: its advantages, sequence KL and metrics."""

    def __init__(self):
        self.rounds = []

    def on_rollout_end(self, args, state, control, rollout=None, metrics=None, **kwargs):
        kl = sequence_kl(rollout.old_logps, rollout.ref_logps, rollout.loss_mask)
        self.rounds.append({"advantages": rollout.advantages.tolist(), "kl": kl.tolist(),
                            "tokens": float(rollout.loss_mask.sum()), "metrics": metrics})


def main():
    model_dir, output_dir = sys.argv[1], sys.argv[2]
    given = []

    def length_mod(completions, **kwargs):
        values = [float(len(c) % 3) for c in completions]
        given.append(values)
        return values

    rounds = Rounds()
    trainer = RLOOTrainer(model=model_dir, reward_funcs=length_mod, callbacks=[rounds],
                          train_dataset=[{"prompt": p} for p in ["abc", "hello", "xyz", "12"]],
                          args=RLOOConfig(output_dir=output_dir, per_device_train_batch_size=2, num_generations=4,
                                          max_completion_length=6, learning_rate=1e-2, max_steps=3, beta=0.1,
                                          logging_steps=1, save_strategy="no", disable_tqdm=True, seed=0, bf16=False,
                                          report_to="none"))
    trainer.train()
    acc = trainer.accelerator
    with gathered_parameters(acc, trainer.model):
        checksum = [float(p.detach().double().sum()) for p in trainer.model.parameters()]
    report = {"rank": acc.process_index, "zero_stage": zero_stage(acc), "rounds": rounds.rounds, "rewards": given,
              "checksum": checksum, "history": [r for r in trainer.state.log_history if "loss" in r]}
    with open(os.path.join(output_dir, f"report-{acc.process_index}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
