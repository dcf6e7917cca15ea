"""The ``trainers`` command: ``sft``, ``grpo``, ``rloo``, ``distill``, ``dpo``, ``reward``, ``kto``, ``vllm-serve``,
``sandbox-serve``, ``reward-serve``, ``plan``, ``report`` and ``env``.

    trainers grpo --config examples/grpo.yaml                        # one process, here
    trainers grpo --config grpo.yaml --learning_rate 1e-6            # a flag overrides the YAML
    trainers grpo --config grpo.yaml --accelerate_config zero3 --num_processes 8   # through accelerate launch
    trainers vllm-serve --model Qwen/Qwen2.5-0.5B --port 8000               # GRPO's vllm_mode="server"
    trainers sandbox-serve --port 8100                                     # code_execution's programs, run here
    trainers reward-serve --model outputs/reward --port 8200               # reward_funcs="http://127.0.0.1:8200"
    trainers plan --model-size 7B --method grpo --num-gpus 8 --gpu-memory 80
    trainers report outputs/grpo-tiny
    trainers env

A run's YAML holds config fields (every SFTConfig / GRPOConfig / RLOOConfig / DistillationConfig / DPOConfig /
RewardConfig / KTOConfig field) and the run keys below; a flag
``--field value`` overrides the same key of the YAML. See docs/cli.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import subprocess
import sys

import yaml

from trainers.config.trl_options import TRL_ONLY_OPTIONS
from trainers.errors import ConfigError, TrainersError
from trainers.cli.argparsing import add_config_arguments, config_overrides
from trainers.cli.templates import resolve_template, templates_dir  # noqa: F401  (cli.resolve_template)

# Keys of a run's YAML that are not config fields: what to train, on what, and how to launch it.
RUN_KEYS = {
    "model": "Model folder or Hub id. Absent: the embedded default (a tiny model built offline, digit reversal).",
    "dataset": "Training data file (.json/.jsonl/.parquet/.csv). Absent: the embedded default's generated rows.",
    "eval_dataset": "Optional evaluation data file.",
    "lora_r": "Train a LoRA adapter of this rank on all linear layers (0: full fine-tuning).",
    "accelerate_config": "Launch through `accelerate launch` with this shipped template (name) or config file (path).",
    "num_processes": "Processes to launch (through `accelerate launch`; with no accelerate_config: multi_gpu).",
    "main_process_port": "Port of the launched processes' rendezvous (default: accelerate's).",
}
GRPO_RUN_KEYS = {"reward_funcs": "Built-in reward names (accuracy, format, overlong, code_execution), "
                                 "module:function, a reward server's URL (trainers reward-serve), or reward models "
                                 "(folders or Hub ids). Default: accuracy."}
LAUNCH_KEYS = ("accelerate_config", "num_processes", "main_process_port")
LAUNCHED_ENV = "TRAINERS_CLI_LAUNCHED"  # set in the processes `accelerate launch` starts, so they train


METHODS = {"sft": "Supervised fine-tuning", "grpo": "GRPO", "rloo": "RLOO (REINFORCE leave-one-out)",
           "distill": "On-policy distillation (a student learns a teacher's distribution on its own completions)",
           "dpo": "DPO (preference pairs)",
           "reward": "Reward-model (preference pairs)", "kto": "KTO (completions labelled desirable or not)"}


def config_class(method: str):
    from trainers.distillation.config import DistillationConfig
    from trainers.dpo.config import DPOConfig
    from trainers.grpo.config import GRPOConfig
    from trainers.kto.config import KTOConfig
    from trainers.reward.config import RewardConfig
    from trainers.rloo.config import RLOOConfig
    from trainers.sft.config import SFTConfig

    return {"grpo": GRPOConfig, "rloo": RLOOConfig, "distill": DistillationConfig, "dpo": DPOConfig,
            "reward": RewardConfig, "kto": KTOConfig}.get(method, SFTConfig)


def run_keys(method: str) -> dict[str, str]:
    return {**RUN_KEYS, **(GRPO_RUN_KEYS if method in ("grpo", "rloo") else {})}


def load_run_yaml(path: str, method: str) -> dict:
    """A run's YAML -> a dict of config fields and run keys; unknown keys are an error naming the key."""
    if not os.path.isfile(path):
        raise ConfigError(f"--config {path!r}: no such file.")
    with open(path) as f:
        try:
            options = yaml.safe_load(f) or {}
        except yaml.YAMLError as error:
            raise ConfigError(f"--config {path!r} is not valid YAML: {error}") from error
    if not isinstance(options, dict):
        raise ConfigError(f"--config {path!r} must be a mapping of option: value, got {type(options).__name__}.")
    # TRL-only options are known too: the config accepts them at TRL's default and refuses other values
    known = {f.name for f in dataclasses.fields(config_class(method))} | set(run_keys(method)) | set(TRL_ONLY_OPTIONS)
    for key in options:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"{path}: unknown key {key!r} for `trainers {method}`.{hint} Keys are "
                              f"{config_class(method).__name__} fields (trainers {method} --help) or run keys "
                              f"{sorted(run_keys(method))}.")
    return options


def build_run_parser(method: str, subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        method, help=f"{METHODS[method]} training from a YAML file and flags.",
        description=f"Train with {config_class(method).__name__}: --config YAML, then --field value flags override "
                    "its keys. Run keys and every config field, with docstrings and defaults, are listed below.")
    parser.add_argument("--config", help="A YAML file of config fields and run keys (examples/*.yaml).")
    group = parser.add_argument_group("run keys (also valid in the YAML)")
    for key, help_text in run_keys(method).items():
        kwargs = {"nargs": "+"} if key == "reward_funcs" else {}
        group.add_argument(f"--{key}", dest=f"run_{key}", default=None, help=help_text, **kwargs)
    add_config_arguments(parser, config_class(method))
    return parser


def gather_options(cli: argparse.Namespace, method: str) -> dict:
    """YAML keys, then the flags given on the command line (flags win)."""
    options = load_run_yaml(cli.config, method) if cli.config else {}
    options.update(config_overrides(cli))
    options.update({k[len("run_"):]: v for k, v in vars(cli).items() if k.startswith("run_") and v is not None})
    return options


def launch_command(method: str, options: dict, argv: list[str]) -> list[str]:
    """``accelerate launch`` of this same command (without its launch flags) on the chosen template."""
    config = resolve_template(str(options.get("accelerate_config") or "multi_gpu"))
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config]
    if options.get("num_processes"):
        command += ["--num_processes", str(options["num_processes"])]
    if options.get("main_process_port"):
        command += ["--main_process_port", str(options["main_process_port"])]
    return command + [os.path.abspath(__file__), method, *strip_launch_flags(argv)]


def strip_launch_flags(argv: list[str]) -> list[str]:
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in {f"--{k}" for k in LAUNCH_KEYS}:
            skip = "=" not in arg
            continue
        out.append(arg)
    return out


def run_training(method: str, options: dict) -> None:
    """Build the trainer from the gathered options, train, and save the final model to output_dir/final."""
    from trainers.data.formats import load_dataset_file
    from trainers.cli.tiny import embedded_default, embedded_rows

    keys = run_keys(method)
    fields = {k: v for k, v in options.items() if k not in keys}
    model = options.get("model")
    if model is None:
        model, fields = embedded_default(method, fields)
    dataset = options.get("dataset")
    train = load_dataset_file(dataset, "--dataset") if dataset else embedded_rows(method)
    evaluation = load_dataset_file(options["eval_dataset"], "--eval_dataset") if options.get("eval_dataset") else None
    peft_config = None
    if int(options.get("lora_r") or 0):
        from peft import LoraConfig

        rank = int(options["lora_r"])
        peft_config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", task_type="CAUSAL_LM")
    args = config_class(method)(**fields)
    if method in ("grpo", "rloo"):
        from trainers import GRPOTrainer, RLOOTrainer

        rewards = options.get("reward_funcs") or ["accuracy"]
        rewards = [rewards] if isinstance(rewards, str) else rewards
        trainer = (GRPOTrainer if method == "grpo" else RLOOTrainer)(
            model=model, reward_funcs=rewards, args=args, train_dataset=train, eval_dataset=evaluation,
            peft_config=peft_config)
    elif method == "distill":  # the teacher: teacher_model_name_or_path or teacher_model_server_url
        from trainers import DistillationTrainer

        trainer = DistillationTrainer(model=model, args=args, train_dataset=train, eval_dataset=evaluation,
                                      peft_config=peft_config)
    elif method == "dpo":
        from trainers import DPOTrainer

        trainer = DPOTrainer(model=model, args=args, train_dataset=train, eval_dataset=evaluation,
                             peft_config=peft_config)
    elif method == "kto":
        from trainers import KTOTrainer

        trainer = KTOTrainer(model=model, args=args, train_dataset=train, eval_dataset=evaluation,
                             peft_config=peft_config)
    elif method == "reward":
        from trainers import RewardTrainer

        trainer = RewardTrainer(model=model, args=args, train_dataset=train, eval_dataset=evaluation,
                                peft_config=peft_config)
    else:
        from trainers import SFTTrainer

        trainer = SFTTrainer(model=model, args=args, train_dataset=train, eval_dataset=evaluation,
                             peft_config=peft_config)
    trainer.train()  # resumes from args.resume_from_checkpoint when it is set
    trainer.save_model(os.path.join(trainer.args.output_dir, "final"))


def cmd_train(method: str, cli: argparse.Namespace, argv: list[str]) -> int:
    options = gather_options(cli, method)
    wants_launch = any(options.get(k) for k in ("accelerate_config", "num_processes"))
    if wants_launch and not os.environ.get(LAUNCHED_ENV):
        command = launch_command(method, options, argv)
        print("[trainers] " + " ".join(command), flush=True)
        return subprocess.call(command, env={**os.environ, LAUNCHED_ENV: "1"})
    run_training(method, {k: v for k, v in options.items() if k not in LAUNCH_KEYS})
    return 0


def cmd_report(cli: argparse.Namespace) -> int:
    from trainers.cli.report import write_report

    written = write_report(cli.output_dir, cli.out)
    for name, path in written.items():
        print(f"{name}: {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["vllm-serve"]:  # it parses its own flags: those it does not know go to vLLM as they are
        from trainers.generation.vllm_server import main as vllm_serve

        return vllm_serve(argv[1:])
    parser = argparse.ArgumentParser(prog="trainers", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    subparsers = parser.add_subparsers(dest="command", required=True)
    for method in METHODS:
        build_run_parser(method, subparsers)
    subparsers.add_parser("vllm-serve", add_help=False,
                          help="A vLLM server for GRPO's vllm_mode='server' (trainers vllm-serve --help).")
    from trainers.cli import planner

    plan = subparsers.add_parser("plan", help="Estimate memory per GPU for every shipped template and pick one.",
                                 description=planner.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    planner.add_arguments(plan)
    report = subparsers.add_parser("report", help="Plots and an HTML page from a run's output_dir.")
    report.add_argument("output_dir", help="The run's output_dir (it holds metrics.jsonl).")
    report.add_argument("--out", default=None, help="Where to write the report (default: OUTPUT_DIR/report).")
    from trainers.cli import reward_serve, sandbox_serve

    sandbox = subparsers.add_parser("sandbox-serve", help="Runs code_execution rewards' programs for trainers "
                                    "elsewhere.", description=sandbox_serve.__doc__,
                                    formatter_class=argparse.RawDescriptionHelpFormatter)
    sandbox_serve.add_arguments(sandbox)
    rewards = subparsers.add_parser("reward-serve", help="Serves a reward model: reward_funcs='http://HOST:PORT'.",
                                    description=reward_serve.__doc__,
                                    formatter_class=argparse.RawDescriptionHelpFormatter)
    reward_serve.add_arguments(rewards)
    environment = subparsers.add_parser("env", help="Versions, devices and the distributed set-up.")
    environment.add_argument("--accelerate_config", default=None,
                             help="Also show what this shipped template (name) or config file (path) sets.")
    cli = parser.parse_args(argv)
    try:
        if cli.command in METHODS:
            return cmd_train(cli.command, cli, argv[1:])
        if cli.command == "plan":
            return planner.run(cli)
        if cli.command == "report":
            return cmd_report(cli)
        if cli.command == "sandbox-serve":
            return sandbox_serve.run(cli)
        if cli.command == "reward-serve":
            return reward_serve.run(cli)
        from trainers.cli.environment import describe

        print(describe(cli.accelerate_config))
        return 0
    except TrainersError as error:  # our clear errors: the message, not a traceback
        print(f"trainers {cli.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
