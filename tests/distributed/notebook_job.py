"""SFT or GRPO on 2 processes started by Accelerate's ``notebook_launcher``, as a notebook runs them: the processes
are forked from this one and the trainer is built inside the launched function. The same function also runs under
``accelerate launch`` (launcher "direct"), so a test can compare the two launches of one configuration.

argv: launcher (notebook | direct) methods (sft, grpo or sft,grpo) model_dir output_dir [key=value ...]
  port=N                  notebook_launcher's use_port (notebook only)
  mixed_precision=M       notebook_launcher's mixed_precision (notebook only; default "no")
  bf16=true|false|none    the config's bf16 (default false; none follows the launch)
  parent_threads=N        before launching, this process runs a matrix product on N torch threads, as a notebook
                          that used torch has (it starts OpenMP's thread pool; notebook only)
  import_trainers=1       this process imports trainers before launching (notebook only)
Each method trains in turn inside the one launch (a new trainer each) and each rank writes
OUTPUT/METHOD/report-<rank>.json. A script of its own rather than the test's process: forking pytest (its
threads, its plugins' state) is not what a notebook does, and a hang there would hang the suite.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # tests.conftest


def checksums(model) -> list[float]:
    return [float(p.detach().double().sum()) for p in model.parameters()]


def train(methods: str, model_dir: str, output_dir: str, bf16: bool | None) -> None:
    """The launched function: the imports and everything that builds the trainers happen in the started process,
    as the notebook_launcher docs ask. ``methods``: comma-separated, trained one after the other."""
    methods = methods.split(",")
    for method in methods:
        trainer = train_one(method, model_dir, os.path.join(output_dir, method), bf16)
    trainer.end()  # once, after the last: it destroys the process group the next trainer would use


def train_one(method: str, model_dir: str, output_dir: str, bf16: bool | None):
    os.makedirs(output_dir, exist_ok=True)
    from tests.conftest import digits_varied as digits  # it imports trainers: only here, after the fork
    from trainers import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer
    from trainers.cli.tiny import as_sft_rows, reverse_digits_rows

    common = {"output_dir": output_dir, "max_steps": 3, "logging_steps": 1, "save_strategy": "no",
              "disable_tqdm": True, "seed": 0, "bf16": bf16, "learning_rate": 1e-2}
    if method == "sft":
        args = SFTConfig(per_device_train_batch_size=2, gradient_accumulation_steps=2, **common)
        trainer = SFTTrainer(model=model_dir, args=args, train_dataset=as_sft_rows(reverse_digits_rows(24, seed=3)))
    else:
        args = GRPOConfig(per_device_train_batch_size=2, num_generations=4, max_completion_length=6, beta=0.0,
                          **common)
        rows = [{"prompt": p} for p in ["abc", "hello", "xyz", "12"]]
        trainer = GRPOTrainer(model=model_dir, reward_funcs=digits, args=args, train_dataset=rows)
    initial = checksums(trainer.model)
    trainer.train()
    accelerator = trainer.accelerator
    steps = [record for record in trainer.state.log_history if "loss" in record]
    report = {
        "rank": accelerator.process_index,
        "num_processes": accelerator.num_processes,
        "distributed_type": str(accelerator.distributed_type),
        "mixed_precision": accelerator.mixed_precision,
        "effective_batch_size": trainer.effective_batch_size,
        "losses": [record["loss"] for record in steps],
        "rewards": [record["reward"] for record in steps if "reward" in record],
        "initial": initial,
        "checksum": checksums(trainer.model),
    }
    with open(os.path.join(output_dir, f"report-{report['rank']}.json"), "w") as f:
        json.dump(report, f)
    return trainer


def main() -> None:
    launcher, methods, model_dir, output_dir, *options = sys.argv[1:]
    options = dict(option.split("=", 1) for option in options)
    bf16 = {"true": True, "false": False, "none": None}[options.get("bf16", "false")]
    if launcher == "direct":
        train(methods, model_dir, output_dir, bf16)
        return
    if options.get("import_trainers") == "1":
        import trainers  # noqa: F401  (its fork hook releases OpenMP's threads before notebook_launcher forks)
    elif "trainers" in sys.modules:  # the case the refusal is for: trainers imported only after the fork
        sys.exit("notebook_job: trainers was imported before the fork without import_trainers=1")
    if "parent_threads" in options:
        import torch

        torch.set_num_threads(int(options["parent_threads"]))
        matrix = torch.randn(512, 512)
        (matrix @ matrix).sum()  # [512, 512]: large enough that torch splits it over its threads
    from accelerate import notebook_launcher

    notebook_launcher(train, args=(methods, model_dir, output_dir, bf16), num_processes=2,
                      use_port=options.get("port", "29500"), mixed_precision=options.get("mixed_precision", "no"))


if __name__ == "__main__":
    main()
