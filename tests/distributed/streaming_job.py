"""A short SFT run on a stream (a datasets.IterableDataset), launched with 2 processes by
tests/distributed/test_streaming_distributed.py; writes a JSON report per rank: the rows each micro-batch of each
step trained on, and the final weights (OUT/run-RANK.json, or OUT/resumed-RANK.json for a resumed run).

    python streaming_job.py RUN [--then RUN ...]
    RUN: MODEL OUT TOTAL_STEPS [STOP_AFTER] [--resume] [--workers N]

STOP_AFTER stops the run after that step (with 3: right after the checkpoint of step 3, as a preemption). Each
`--then` starts another run, trained after the one before in the same processes (a trainer of its own, which
reseeds and builds its own stream): the resume test makes its straight and stopped runs in one launch and resumes
in a second one.
"""

import argparse
import contextlib
import json
import os
import sys
from unittest import mock

import torch
from datasets import Dataset
from transformers import TrainerCallback

import trainers.data.streaming
from trainers import SFTConfig, SFTTrainer
from trainers.parallel.distributed import gathered_parameters
from trainers.cli.tiny import as_sft_rows, reverse_digits_rows

ROWS = as_sft_rows(reverse_digits_rows(20, seed=1))  # distinct rows; 2 global batches of 8 span a pass


class StopAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        control.should_training_stop = self.step is not None and state.global_step >= self.step


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("total", type=int)
    parser.add_argument("stop_after", type=int, nargs="?")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--workers", type=int, default=0)
    return parser


def run(cli: argparse.Namespace) -> SFTTrainer:
    with contextlib.ExitStack() as patches:  # this run's hooks, undone before the next run
        patches.enter_context(mock.patch.object(trainers.data.streaming, "CHUNK_ROWS", 7))  # batches span chunks
        stream = Dataset.from_list(ROWS).to_iterable_dataset(num_shards=2).shuffle(seed=3, buffer_size=6)
        args = SFTConfig(output_dir=cli.out, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                         max_steps=cli.total, learning_rate=1e-3, logging_steps=1, save_strategy="steps", save_steps=3,
                         disable_tqdm=True, seed=0, bf16=False, dataloader_num_workers=cli.workers)
        seen = []

        class Recording(SFTTrainer):  # each micro-batch's rows as the loop takes them
            def micro_batch(self, step, accumulation_index):
                batch = super().micro_batch(step, accumulation_index)
                rows = [row[mask.bool()].tolist() for row, mask in zip(batch.input_ids, batch.attention_mask)]
                seen.append({"step": step, "accumulation": accumulation_index, "rows": rows})
                return batch

        trainer = Recording(model=cli.model, args=args, train_dataset=stream, callbacks=[StopAt(cli.stop_after)])
        trainer.train(resume_from_checkpoint=True if cli.resume else None)
    with gathered_parameters(trainer.accelerator, trainer.model):
        checksum = [float(p.detach().double().sum()) for p in trainer.model.parameters()]
    rank = trainer.accelerator.process_index
    suffix = "resumed" if cli.resume else "run"
    with open(os.path.join(cli.out, f"{suffix}-{rank}.json"), "w") as f:
        json.dump({"seen": seen, "checksum": checksum}, f)
    return trainer


def main():
    runs = [[]]
    for arg in sys.argv[1:]:  # RUN --then RUN ...
        if arg == "--then":
            runs.append([])
        else:
            runs[-1].append(arg)
    clis = [parser().parse_args(args) for args in runs]  # every run's arguments checked before the first trains
    torch.set_num_threads(1)
    for index, cli in enumerate(clis):
        if len(clis) > 1:  # which run a failure's traceback belongs to
            print(f"streaming_job.py: run {index + 1}/{len(clis)}: {' '.join(runs[index])}", flush=True)
        trainer = run(cli)
    trainer.end()  # destroys the process group the runs share: once, after the last


if __name__ == "__main__":
    main()
