"""The `trainers` command: shipped YAMLs parse and the small ones train, flags override YAML, launches go
through accelerate, errors name the key, --help documents every field."""

import dataclasses
import glob
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO, free_port
from trainers.distillation.config import DistillationConfig
from trainers.dpo.config import DPOConfig
from trainers.errors import ConfigError
from trainers.grpo.config import GRPOConfig
from trainers.kto.config import KTOConfig
from trainers.reward.config import RewardConfig
from trainers.rloo.config import RLOOConfig
from trainers.sft.config import SFTConfig
from trainers.cli import main as cli

SHIPPED_YAMLS = sorted(glob.glob(os.path.join(REPO, "examples", "*.yaml")))


def method_of(path: str) -> str:
    name = os.path.basename(path)
    methods = {"grpo": "grpo", "rloo": "rloo", "distillation": "distill", "dpo": "dpo", "reward": "reward",
               "kto": "kto"}
    return next((method for prefix, method in methods.items() if name.startswith(prefix)), "sft")


def test_there_is_a_yaml_for_each_example():
    names = {os.path.basename(p) for p in SHIPPED_YAMLS}
    assert {"sft.yaml", "grpo.yaml", "rloo.yaml", "distillation.yaml", "dpo.yaml", "reward.yaml",
            "kto.yaml"} <= names and len(names) >= 8


@pytest.mark.parametrize("path", SHIPPED_YAMLS, ids=os.path.basename)
def test_every_shipped_yaml_parses_into_its_config(path):
    method = method_of(path)
    options = cli.load_run_yaml(path, method)
    fields = {k: v for k, v in options.items() if k not in cli.run_keys(method)}
    config = cli.config_class(method)(**fields)
    for key, value in fields.items():
        assert getattr(config, key) == value
    if "accelerate_config" in options:
        assert os.path.isfile(cli.resolve_template(options["accelerate_config"]))


SMALL = [p for p in SHIPPED_YAMLS if "model" not in cli.load_run_yaml(p, method_of(p))]


@pytest.mark.parametrize("path", SMALL, ids=os.path.basename)
def test_small_shipped_yamls_train_for_a_step(path, tmp_path):
    method = method_of(path)
    assert cli.main([method, "--config", path, "--max_steps", "1", "--logging_steps", "1", "--output_dir",
                     str(tmp_path), "--disable_tqdm", "true"]) == 0
    with open(tmp_path / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    assert records[-1]["step"] == 1 and "train_runtime" in records[-1]  # train()'s closing summary
    assert records[-2]["step"] == 1 and records[-2]["loss"] == records[-2]["loss"]  # a finite loss was logged
    assert os.path.isfile(tmp_path / "final" / "model.safetensors")


def test_flags_override_yaml_and_reach_the_config(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("learning_rate: 0.5\nmax_steps: 3\nper_device_train_batch_size: 4\nmax_length: 32\n"
                      "save_strategy: 'no'\ndisable_tqdm: true\n")
    out = tmp_path / "out"
    assert cli.main(["sft", "--config", str(config), "--learning_rate", "0.001", "--max_steps", "1",
                     "--output_dir", str(out)]) == 0
    info = json.loads((out / "training_args.json").read_text())
    assert info["config"]["learning_rate"] == 0.001  # the flag, not the YAML's 0.5
    assert info["config"]["per_device_train_batch_size"] == 4  # the YAML, not the embedded default's 32
    assert info["max_steps"] == 1 and info["trainer"] == "SFTTrainer"


def test_unknown_yaml_key_is_an_error_naming_it_and_the_close_match(tmp_path, capsys):
    config = tmp_path / "bad.yaml"
    config.write_text("learning_rat: 0.1\n")
    with pytest.raises(ConfigError, match=r"unknown key 'learning_rat'.*Did you mean 'learning_rate'"):
        cli.load_run_yaml(str(config), "sft")
    assert cli.main(["sft", "--config", str(config)]) == 2
    assert "learning_rat" in capsys.readouterr().err


def test_a_grpo_key_in_an_sft_yaml_is_an_error(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("num_generations: 8\n")
    with pytest.raises(ConfigError, match="num_generations"):
        cli.load_run_yaml(str(config), "sft")


def test_missing_yaml_and_unknown_template_are_clear_errors(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        cli.load_run_yaml(str(tmp_path / "nope.yaml"), "grpo")
    with pytest.raises(ConfigError, match=r"zero9.*shipped: \[.*zero3"):
        cli.resolve_template("zero9")
    assert cli.resolve_template("zero3").endswith(os.path.join("trainers", "templates", "zero3.yaml"))
    assert cli.resolve_template(os.path.join(REPO, "accelerate_configs", "zero3.yaml")) == os.path.join(
        REPO, "accelerate_configs", "zero3.yaml")  # a file is itself, the checkout's symlinked path included
    assert cli.resolve_template("zero3.yaml") == cli.resolve_template("zero3")


@pytest.mark.parametrize("method,config_class", [("sft", SFTConfig), ("grpo", GRPOConfig), ("rloo", RLOOConfig),
                                                 ("distill", DistillationConfig), ("dpo", DPOConfig),
                                                 ("reward", RewardConfig), ("kto", KTOConfig)])
def test_help_lists_every_field_with_its_docstring_and_default(method, config_class, capsys):
    with pytest.raises(SystemExit):
        cli.main([method, "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for f in dataclasses.fields(config_class):
        assert f"--{f.name}" in text, f.name
        first_words = " ".join(f.metadata["help"].split()[:3])
        assert first_words.replace("%%", "%") in text, f.name
    assert text.count("(default:") >= len(dataclasses.fields(config_class))
    for key in cli.run_keys(method):
        assert f"--{key}" in text


def test_launch_flags_are_stripped_for_the_launched_processes():
    argv = ["--config", "a.yaml", "--accelerate_config", "zero3", "--num_processes=2", "--lr", "1",
            "--main_process_port", "1234"]
    assert cli.strip_launch_flags(argv) == ["--config", "a.yaml", "--lr", "1"]


@pytest.mark.distributed
def test_grpo_through_accelerate_launch_on_two_processes(tmp_path):
    out = tmp_path / "out"
    command = [sys.executable, "-m", "trainers.cli.main", "grpo", "--config", os.path.join(REPO, "examples", "grpo.yaml"),
               "--accelerate_config", "multi_gpu", "--num_processes", "2", "--main_process_port", str(free_port()),
               "--max_steps", "2", "--logging_steps", "1", "--output_dir", str(out), "--disable_tqdm", "true"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=REPO, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert "accelerate.commands.launch" in result.stdout
    info = json.loads((out / "training_args.json").read_text())
    assert info["num_processes"] == 2 and info["effective_batch_size"] == 32
    assert "effective batch size 32 = 16 per device x 2 processes" in result.stderr + result.stdout


def test_env_shows_versions_devices_and_a_template():
    script = os.path.join(os.path.dirname(sys.executable), "trainers")
    command = [script] if os.path.isfile(script) else [sys.executable, "-m", "trainers.cli.main"]
    result = subprocess.run(command + ["env", "--accelerate_config", "zero3_offload"], capture_output=True,
                            text=True, timeout=120, cwd=REPO, check=False)
    assert result.returncode == 0, result.stderr
    import torch

    assert torch.__version__ in result.stdout
    assert "zero_stage" in result.stdout and "offload" in result.stdout and "cpu cores" in result.stdout


def test_a_trl_only_option_in_a_yaml_is_accepted_at_trls_default_only(tmp_path):
    from trainers.config.trl_options import TRL_ONLY_OPTIONS

    config = tmp_path / "run.yaml"
    config.write_text("auto_find_batch_size: false\n")
    options = cli.load_run_yaml(str(config), "sft")
    assert SFTConfig(output_dir="x", **options).to_dict()["output_dir"] == "x"
    assert TRL_ONLY_OPTIONS["auto_find_batch_size"] is False
    with pytest.raises(ConfigError, match="auto_find_batch_size"):
        SFTConfig(output_dir="x", auto_find_batch_size=True)
