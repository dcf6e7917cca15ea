"""SFT under DDP with transformers' ddp_* options, launched by tests/distributed/test_ddp_options.py with 2
processes; writes a JSON report per rank.

argv: model_dir output_dir mode
  mode "options": ddp_find_unused_parameters, ddp_bucket_cap_mb, ddp_broadcast_buffers and ddp_timeout set;
                  reports what DistributedDataParallel and the process group were given.
  mode "unused" / "unused-found": the model has a parameter its forward never uses; without / with
                  ddp_find_unused_parameters=True.
"""

import json
import os
import sys

import torch
from transformers import AutoModelForCausalLM

from trainers import SFTConfig, SFTTrainer
from trainers.errors import DistributedError
from trainers.cli.tiny import as_sft_rows, reverse_digits_rows


def main():
    model_dir, output_dir, mode = sys.argv[1:4]
    options = {"options": dict(ddp_find_unused_parameters=True, ddp_bucket_cap_mb=1, ddp_broadcast_buffers=False,
                               ddp_timeout=123),
               "unused": {}, "unused-found": dict(ddp_find_unused_parameters=True)}[mode]
    args = SFTConfig(output_dir=output_dir, per_device_train_batch_size=2, learning_rate=1e-3, max_steps=3,
                     logging_steps=1, save_strategy="no", disable_tqdm=True, seed=0, bf16=False, **options)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    if mode.startswith("unused"):
        model.model.layers[0].unused = torch.nn.Parameter(torch.zeros(4))  # never reaches the loss
    trainer = SFTTrainer(model=model, args=args, train_dataset=as_sft_rows(reverse_digits_rows(24, seed=3)))
    report = {"rank": trainer.accelerator.process_index, "wrapper": type(trainer.model_wrapped).__name__}
    try:
        trainer.train()
        report["steps"] = trainer.state.global_step
    except DistributedError as error:
        report["error"] = str(error)
    ddp = trainer.model_wrapped
    if mode == "options":
        group = torch.distributed.distributed_c10d._get_default_group()
        report.update(find_unused_parameters=ddp.find_unused_parameters, bucket_bytes_cap=ddp.bucket_bytes_cap,
                      broadcast_buffers=ddp.broadcast_buffers,
                      timeout_seconds=group._get_backend(torch.device("cpu")).options._timeout.total_seconds())
    with open(os.path.join(output_dir, f"report-{report['rank']}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
