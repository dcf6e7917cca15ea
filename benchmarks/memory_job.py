"""One memory-measurement job; ``benchmarks/memory.py`` launches it under each template with 2 processes.

Trains a few SFT or GRPO steps and writes, per rank, a JSON report: RSS at each stage (after loading,
after prepare, after each step), the peak RSS of each phase, and the model-state bytes held by kind.

    accelerate launch --config_file accelerate_configs/zero3.yaml --num_processes 2 \\
        benchmarks/memory_job.py --model PATH --method sft --steps 2 --out DIR
"""

import argparse
import json
import os
import time

import torch

from memory_probe import live_tensor_bytes, model_state_bytes, peak_rss_bytes, reset_peak_rss, rss_bytes
from trainers import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer
from trainers.parallel.distributed import zero_stage

GB = 1024 ** 3


class Recorder:
    """RSS and peak RSS per phase; the peak is reset at the start of each phase."""

    def __init__(self):
        self.stages: list[dict] = []
        reset_peak_rss()

    def mark(self, name: str, **extra) -> None:
        self.stages.append({"stage": name, "rss_gb": rss_bytes() / GB, "phase_peak_gb": peak_rss_bytes() / GB,
                            "time": time.time(), **extra})
        reset_peak_rss()


def probing(base):
    """A trainer class that records RSS after loading and after prepare."""

    class Probe(base):
        recorder: Recorder

        def after_load(self, model):
            self.recorder.mark("after_load", local_param_gb=sum(
                (p.ds_tensor if hasattr(p, "ds_tensor") else p).numel() * p.element_size()
                for p in model.parameters()) / GB)
            super().after_load(model)

        def after_prepare(self):
            super().after_prepare()
            self.recorder.mark("after_prepare")

    return Probe


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--method", choices=["sft", "grpo"], default="sft")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--per_device", type=int, default=4)
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--bf16", choices=["template", "true", "false"], default="template")
    parser.add_argument("--out", required=True)
    cli = parser.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // int(os.environ.get("WORLD_SIZE", "1"))))
    bf16 = {"template": None, "true": True, "false": False}[cli.bf16]
    common = dict(output_dir=cli.out, per_device_train_batch_size=cli.per_device, max_steps=cli.steps,
                  logging_steps=1, save_strategy="no", disable_tqdm=True, bf16=bf16, learning_rate=1e-5)

    recorder = Recorder()
    text = "the quick brown fox jumps over the lazy dog " * 64
    if cli.method == "sft":
        rows = [{"text": text[i:i + cli.seq_len]} for i in range(64)]
        trainer_class, args = probing(SFTTrainer), SFTConfig(max_length=cli.seq_len, **common)
        kwargs = {}
    else:
        rows = [{"prompt": text[i:i + cli.seq_len // 2]} for i in range(64)]
        trainer_class = probing(GRPOTrainer)
        args = GRPOConfig(num_generations=cli.per_device, max_completion_length=cli.seq_len // 2, **common)
        kwargs = {"reward_funcs": lambda completions, **kw: [float(len(c)) for c in completions]}
    trainer_class.recorder = recorder
    trainer = trainer_class(model=cli.model, args=args, train_dataset=rows, **kwargs)

    for step in range(cli.steps):
        trainer.max_steps = step + 1
        trainer.train()
        recorder.mark(f"after_step_{step + 1}")
    states = {k: v / GB for k, v in model_state_bytes(trainer.model_wrapped, trainer.optimizer).items()}
    report = {
        "rank": trainer.accelerator.process_index, "num_processes": trainer.accelerator.num_processes,
        "distributed_type": str(trainer.accelerator.distributed_type), "zero_stage": zero_stage(trainer.accelerator),
        "mixed_precision": trainer.accelerator.mixed_precision, "method": cli.method,
        "num_parameters": sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in trainer.model.parameters()),
        "stages": recorder.stages, "model_states_gb": states, "live_tensors_gb": live_tensor_bytes() / GB,
        "steady_rss_gb": rss_bytes() / GB,
        "peak_rss_gb": max(s["phase_peak_gb"] for s in recorder.stages),
    }
    if torch.cuda.is_available():  # on a GPU the planner's figure is the device's peak (GiB, torch's allocator)
        report["peak_gpu_gb"] = torch.cuda.max_memory_allocated() / GB
    os.makedirs(cli.out, exist_ok=True)
    with open(os.path.join(cli.out, f"memory-{report['rank']}.json"), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
