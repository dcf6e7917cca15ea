"""A short SFT job launched by tests/distributed/test_templates.py (2 processes, or 1 for the references); writes a
JSON report per run and rank.

argv: model_dir output_dir RUN [RUN ...]
Each RUN trains a trainer of its own, one after the other in the same processes (one launch for all the runs a
template's tests compare), and writes output_dir/NAME/report-<rank>.json and the trained model to
output_dir/NAME/final. A RUN is a name in RUNS, or NAME=JSON: RUNS[NAME] and the JSON object's options (a folder
the test made: the MoE model a run trains, the donor of a chat template).
Every run trains 5 steps at per-device 2 with 2 accumulation steps unless RUNS says otherwise:
  one             per-device 8, no accumulation: with 1 process, the global batch of 8 the 2-process runs use
  one_sgd         the same with optimizers=(SGD with momentum, a decaying LambdaLR) on a model instance
  plain           nothing else
  ddp_option      ddp_find_unused_parameters=True (under DeepSpeed it changes nothing, and says so)
  tensorboard     report_to="tensorboard" (under ZeRO-3 a tracker's end of training must leave the process group
                  to save_model's gathering)
  split_batches   accelerator_config's split_batches: per-device 4 is the batch of both processes together
  neftune         neftune_noise_alpha=5
  moe_plain       router_aux_loss_coef=0 (with model: a MoE folder)
  moe_routed      router_aux_loss_coef=0.5 (with model: a MoE folder)
  chat_template   (with chat_template_path: a donor tokenizer's folder)
  sgd             optimizers=(SGD with momentum, a decaying LambdaLR) on a model instance
"""

import json
import os
import sys

import torch

from trainers import SFTConfig, SFTTrainer
from trainers.parallel.distributed import gathered_parameters, zero_stage
from trainers.cli.tiny import as_sft_rows, reverse_digits_rows

RUNS = {  # name -> per_device, accumulation, optimizer ("sgd"), model (a folder) and SFTConfig fields it changes
    "one": {"per_device": 8, "accumulation": 1},
    "one_sgd": {"per_device": 8, "accumulation": 1, "optimizer": "sgd"},
    "plain": {},
    "ddp_option": {"ddp_find_unused_parameters": True},
    "tensorboard": {"report_to": "tensorboard"},
    "split_batches": {"per_device": 4, "accelerator_config": {"split_batches": True}},
    "neftune": {"neftune_noise_alpha": 5},
    "moe_plain": {"router_aux_loss_coef": 0.0},
    "moe_routed": {"router_aux_loss_coef": 0.5},
    "chat_template": {},
    "sgd": {"optimizer": "sgd"},
}


def run(model_dir: str, output_dir: str, per_device=2, accumulation=2, optimizer=None, model=None,
        **config) -> SFTTrainer:
    """One run's training, report and saved model; returns its trainer (the last one ends the job)."""
    model_dir = model or model_dir
    rows = as_sft_rows(reverse_digits_rows(40, seed=3))
    rows[0]["completion"] = "a much longer completion than the others"  # uneven token counts per micro-batch
    args = SFTConfig(output_dir=output_dir, per_device_train_batch_size=per_device,
                     gradient_accumulation_steps=accumulation, learning_rate=1e-3, max_steps=5, logging_steps=1,
                     save_strategy="no", disable_tqdm=True, seed=0, bf16=False, **config)
    model, optimizers = model_dir, (None, None)
    if optimizer == "sgd":  # transformers' optimizers=(optimizer, lr_scheduler)
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        optimizers = (sgd, torch.optim.lr_scheduler.LambdaLR(sgd, lambda step: 1.0 / (1 + step)))
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
    return trainer


def main():
    model_dir, output_dir, specs = sys.argv[1], sys.argv[2], sys.argv[3:]
    trainer = None
    for spec in specs:
        name, _, given = spec.partition("=")
        os.makedirs(os.path.join(output_dir, name), exist_ok=True)
        trainer = run(model_dir, os.path.join(output_dir, name), **RUNS[name], **json.loads(given or "{}"))
    # the trackers and the process group, once everything that needs the other processes is done: after the last
    # run only (the next run's trainer would have no process group)
    trainer.end()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
