"""Shared fixtures: tiny models built offline (never the Hub), and a launcher for 2-process CPU jobs."""

import json
import os
import signal
import socket
import subprocess
import sys

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(REPO, "accelerate_configs")  # a symlink to trainers/templates/ (the package data)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A saved tiny Qwen2 (width 64, 2 layers) with a byte-level tokenizer and a ChatML template."""
    from trainers.tools.tiny import save_tiny_model

    return save_tiny_model(str(tmp_path_factory.mktemp("tiny") / "model"), hidden_size=64, num_layers=2)


@pytest.fixture(scope="session")
def tokenizer():
    from trainers.tools.tiny import build_tokenizer

    return build_tokenizer()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(template: str, script: str, *args: str, num_processes: int = 2, timeout: int = 600,
           extra_env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """``accelerate launch --config_file accelerate_configs/<template>.yaml --num_processes N script args``."""
    config = template if os.path.isfile(template) else os.path.join(CONFIGS, f"{template}.yaml")
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config,
               "--num_processes", str(num_processes), "--main_process_port", str(free_port()), script, *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(extra_env or {})}
    # a session of its own: on a timeout the launcher's workers are killed with it, not left running
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO,
                               start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        raise AssertionError(f"launch timed out after {timeout} s:\n{stdout[-4000:]}\n{stderr[-8000:]}") from None
    result = subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
    if check and result.returncode != 0:
        raise AssertionError(f"launch failed ({result.returncode}):\n{result.stdout[-4000:]}\n{result.stderr[-8000:]}")
    return result


def rank_reports(folder, prefix: str = "report", num_processes: int = 2) -> list[dict]:
    """The JSON reports a launched job wrote, one per rank (``<prefix>-<rank>.json``), in rank order."""
    reports = []
    for rank in range(num_processes):
        with open(os.path.join(folder, f"{prefix}-{rank}.json")) as f:
            reports.append(json.load(f))
    return reports


def step_records(trainer) -> list[dict]:
    """``trainer.state.log_history`` without train()'s closing summary record (train_runtime, train_loss, ...):
    the records of steps and evaluations."""
    return [record for record in trainer.state.log_history if "train_runtime" not in record]
