"""2 processes (DDP over gloo), callbacks that ask for things on one rank only: rank 1 asks for a checkpoint at
step 1, rank 0 for the end of training at step 2. Both ranks must act on both (a save or a stop taken alone
would leave the other rank waiting in a collective). Writes report-<rank>.json.

argv: model_dir output_dir
"""

import json
import os
import sys

import torch
from transformers import TrainerCallback

from trainers import SFTConfig, SFTTrainer
from trainers.cli.tiny import as_sft_rows, reverse_digits_rows


class OneRankAsks(TrainerCallback):
    def __init__(self):
        self.steps_seen = []

    def on_step_end(self, args, state, control, **kwargs):
        self.steps_seen.append(state.global_step)
        rank = int(os.environ["RANK"])
        if rank == 1 and state.global_step == 1:
            control.should_save = True
        if rank == 0 and state.global_step == 2:
            control.should_training_stop = True


def main():
    model_dir, output_dir = sys.argv[1], sys.argv[2]
    callback = OneRankAsks()
    args = SFTConfig(output_dir=output_dir, per_device_train_batch_size=4, learning_rate=1e-3, max_steps=6,
                     logging_steps=1, save_strategy="no", disable_tqdm=True, report_to="none", seed=0)
    trainer = SFTTrainer(model=model_dir, args=args, train_dataset=as_sft_rows(reverse_digits_rows(32, seed=3)),
                         callbacks=[callback])
    trainer.train()
    report = {"rank": trainer.accelerator.process_index, "global_step": trainer.state.global_step,
              "steps_seen": callback.steps_seen, "checkpoints": sorted(os.listdir(output_dir))}
    with open(os.path.join(output_dir, f"report-{report['rank']}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
