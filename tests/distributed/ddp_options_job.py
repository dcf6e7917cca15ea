"""2-process DDP checks launched by tests/distributed/test_ddp_options.py (multi_gpu.yaml on CPU: DDP over gloo);
writes a JSON report per run and rank.

argv: model_dir output_dir RUN [RUN ...]
Each RUN (a name in RUNS) runs one after the other in the same processes (one launch for the test file) and writes
output_dir/RUN/report-<rank>.json. The SFT runs train 3 steps under DDP with transformers' ddp_* options:
  options       ddp_find_unused_parameters, ddp_bucket_cap_mb, ddp_broadcast_buffers and ddp_timeout set; reports
                what DistributedDataParallel and the process group were given. It must be the first run: the
                process group is made by the first trainer of a process (later ones share it), so only the first
                run's ddp_timeout reaches it.
  unused        the model has a parameter its forward never uses, without ddp_find_unused_parameters: training
                fails with a DistributedError, which the report holds. Runs after it were seen to work, but its
                failed step leaves that DDP's reducer mid-step: it goes last, so nothing depends on that.
  unused-found  the same parameter, with ddp_find_unused_parameters=True: training runs.
  extremes      no model: trainers.loop.stats.reduce_extremes over the 2 processes; the report is what it returned.
"""

import json
import os
import sys

import torch
from transformers import AutoModelForCausalLM

from trainers import SFTConfig, SFTTrainer
from trainers.parallel import distributed as dist
from trainers.cli.tiny import as_sft_rows, reverse_digits_rows
from trainers.errors import DistributedError
from trainers.loop.stats import Extreme, reduce_extremes

RUNS = {  # name -> the SFTConfig fields it sets
    "options": dict(ddp_find_unused_parameters=True, ddp_bucket_cap_mb=1, ddp_broadcast_buffers=False,
                    ddp_timeout=123),
    "unused": {},
    "unused-found": dict(ddp_find_unused_parameters=True),
}


def train(model_dir: str, output_dir: str, name: str) -> dict:
    args = SFTConfig(output_dir=output_dir, per_device_train_batch_size=2, learning_rate=1e-3, max_steps=3,
                     logging_steps=1, save_strategy="no", disable_tqdm=True, seed=0, bf16=False, **RUNS[name])
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    if name.startswith("unused"):
        model.model.layers[0].unused = torch.nn.Parameter(torch.zeros(4))  # never reaches the loss
    trainer = SFTTrainer(model=model, args=args, train_dataset=as_sft_rows(reverse_digits_rows(24, seed=3)))
    report = {"rank": trainer.accelerator.process_index, "wrapper": type(trainer.model_wrapped).__name__}
    try:
        trainer.train()
        report["steps"] = trainer.state.global_step
    except DistributedError as error:
        report["error"] = str(error)
    ddp = trainer.model_wrapped
    if name == "options":
        group = torch.distributed.distributed_c10d._get_default_group()
        report.update(find_unused_parameters=ddp.find_unused_parameters, bucket_bytes_cap=ddp.bucket_bytes_cap,
                      broadcast_buffers=ddp.broadcast_buffers,
                      timeout_seconds=group._get_backend(torch.device("cpu")).options._timeout.total_seconds())
    return report


def extremes() -> dict:
    """Per-micro-batch min/max statistics (TRL's clip_ratio/low_min, high_max), NaN where a rank measured nothing,
    reduced over the processes."""
    accelerator = dist.build_accelerator(1)
    rank = accelerator.process_index
    # per micro-batch:       rank 0          rank 1
    low = [(0.2, 0.1), (float("nan"), 0.4), (0.3, float("nan")), (float("nan"), float("nan"))]
    high = [(0.5, 0.7), (0.0, 0.1), (0.6, float("nan")), (0.2, 0.2)]
    measured = {"low_min": [Extreme(torch.tensor(pair[rank]), "min") for pair in low],
                "high_max": [Extreme(torch.tensor(pair[rank]), "max") for pair in high]}
    return reduce_extremes(accelerator, measured)


def main():
    model_dir, output_dir, names = sys.argv[1], sys.argv[2], sys.argv[3:]
    for name in names:
        folder = os.path.join(output_dir, name)
        os.makedirs(folder, exist_ok=True)
        report = extremes() if name == "extremes" else train(model_dir, folder, name)
        with open(os.path.join(folder, f"report-{torch.distributed.get_rank()}.json"), "w") as f:
            json.dump(report, f)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
