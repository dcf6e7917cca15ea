"""A short SFT job launched by tests/distributed with 2 processes; writes a JSON report per rank.

argv: model_dir output_dir per_device accumulation [extra SFTConfig fields as key=JSON value]
"""

import json
import os
import sys

import torch

from trainers import SFTConfig, SFTTrainer
from trainers.distributed import gathered_parameters, zero_stage
from trainers.cli.tiny import as_sft_rows, reverse_digits_rows


def main():
    model_dir, output_dir, per_device, accumulation = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    extra = {key: json.loads(value) for key, value in (arg.split("=", 1) for arg in sys.argv[5:])}
    rows = as_sft_rows(reverse_digits_rows(40, seed=3))
    rows[0]["completion"] = "a much longer completion than the others"  # uneven token counts per micro-batch
    args = SFTConfig(output_dir=output_dir, per_device_train_batch_size=per_device,
                     gradient_accumulation_steps=accumulation, learning_rate=1e-3, max_steps=5, logging_steps=1,
                     save_strategy="no", disable_tqdm=True, seed=0, bf16=False, **extra)
    model, optimizers = model_dir, (None, None)
    if os.environ.get("SFT_JOB_OPTIMIZER") == "sgd":  # transformers' optimizers=(optimizer, lr_scheduler)
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        optimizers = (optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step)))
    trainer = SFTTrainer(model=model, args=args, train_dataset=rows, optimizers=optimizers)
    trainer.train()
    optimizer_classes = []  # the wrappers down to the optimizer that steps (Accelerate's, DeepSpeed's, torch's)
    inner = trainer.optimizer
    while inner is not None and len(optimizer_classes) < 5:
        optimizer_classes.append(type(inner).__name__)
        inner = getattr(inner, "optimizer", None)

    model = trainer.model
    local_numel = sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in model.parameters())
    with gathered_parameters(trainer.accelerator, model):
        total_numel = sum(p.numel() for p in model.parameters())
        checksum = [float(p.detach().double().sum()) for p in model.parameters()]
    trainer.save_model(os.path.join(output_dir, "final"))
    report = {
        "rank": trainer.accelerator.process_index,
        "num_processes": trainer.accelerator.num_processes,
        "distributed_type": str(trainer.accelerator.distributed_type),
        "zero_stage": zero_stage(trainer.accelerator),
        "effective_batch_size": trainer.effective_batch_size,
        "model_class": type(trainer.model).__name__,  # transformers' pair: the model, and what trains it
        "model_wrapped_class": type(trainer.model_wrapped).__name__,
        "model_tags": trainer.model.model_tags,
        "losses": [r["loss"] for r in trainer.state.log_history if "loss" in r],  # not train()'s summary
        "learning_rates": [r["learning_rate"] for r in trainer.state.log_history if "loss" in r],
        "aux_losses": [r["aux_loss"] for r in trainer.state.log_history if "aux_loss" in r and "loss" in r],  # MoE
        "optimizer_classes": optimizer_classes,
        "local_numel": local_numel,
        "total_numel": total_numel,
        "checksum": checksum,
    }
    with open(os.path.join(output_dir, f"report-{report['rank']}.json"), "w") as f:
        json.dump(report, f)
    trainer.end()  # the trackers and the process group, once everything that needs the other processes is done


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
