"""Shared fixtures and helpers: the tiers (tests/tiers.py, ``--fast``), tiny models built offline (never the Hub), a
launcher for 2-process CPU jobs, a runner for single-process jobs and their reports, child processes, and the
digit-fraction rewards the GRPO tests learn."""

import contextlib
import importlib.util
import json
import logging
import os
import signal
import subprocess
import sys
from dataclasses import dataclass

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("PYTEST_XDIST_WORKER"):  # scripts/test.sh's two workers on two cores: one torch thread each (set
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported; their child processes inherit it)

from transformers import TrainerCallback  # noqa: E402  after the offline switches, which it reads on import

from trainers.generation.local_server import free_port  # noqa: E402  (tests import it from here too)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(REPO, "accelerate_configs")  # a symlink to trainers/templates/ (the package data)


def config_factory(config_class, **defaults):
    """``config(tmp_path, name="out", **overrides)`` for a test file: a ``config_class`` writing under
    ``tmp_path / name``, logging every step, saving nothing, quiet, seeded, then the file's ``defaults``, then the
    call's ``overrides``."""
    def config(tmp_path, name: str = "out", **overrides):
        base = dict(output_dir=str(tmp_path / name), logging_steps=1, save_strategy="no", disable_tqdm=True,
                    report_to="none", seed=0)
        return config_class(**{**base, **defaults, **overrides})

    return config


def pytest_addoption(parser):
    from tests import tiers

    tiers.add_option(parser)


def pytest_configure(config):
    from tests import tiers

    tiers.register(config)
    tiers.load_hypothesis_profile(config)


def pytest_collection_modifyitems(config, items):
    from tests import tiers

    tiers.mark_and_select(config, items)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A saved tiny Qwen2 (width 64, 2 layers) with a byte-level tokenizer and a ChatML template."""
    from trainers.cli.tiny import save_tiny_model

    return save_tiny_model(str(tmp_path_factory.mktemp("tiny") / "model"), hidden_size=64, num_layers=2)


@pytest.fixture(scope="session")
def tokenizer():
    from trainers.cli.tiny import build_tokenizer

    return build_tokenizer()


def load_example(name: str):
    """examples/<name>.py as a module (its main(argv) runs it as its command line does)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "examples", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass
class WarmStart:
    folder: str  # the model and its tokenizer, for a demo's --warm_start
    validation_accuracy: float  # greedy, where the warm-up stopped


@pytest.fixture(scope="session")
def arithmetic_warm_start(tmp_path_factory) -> WarmStart:
    """The GRPO demo's SFT warm start (examples/grpo_arithmetic.py at its defaults: seed 0, target 45%), built once
    per test run for the demos that start from it (the GRPO demo and the distillation demo, with --warm_start);
    test_examples.py checks the warm-up itself."""
    demo = load_example("grpo_arithmetic")
    root = tmp_path_factory.mktemp("arithmetic")
    _, validation, train = demo.make_splits()
    from trainers.cli.tiny import save_tiny_model

    base = save_tiny_model(str(root / "base-model"), **demo.MODEL_SHAPE)
    model, tokenizer = demo.warm_up(base, train, validation, str(root / "sft"), target=0.45, seed=0)
    folder = demo.save_warm_start(model, tokenizer, str(root / "warm-start"))
    return WarmStart(folder, demo.greedy_accuracy(model, tokenizer, validation))


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """The Python whose environment has vLLM, for the tests that start a real engine or server (tests/tiers.py
    puts them in the vllm tier by this fixture): $TRAINERS_VLLM_PYTHON (a second environment), else this one when
    it has vLLM; neither: the test is skipped, with the reason (scripts/setup.sh installs vLLM, so CI runs them)."""
    if os.environ.get("TRAINERS_VLLM_PYTHON"):
        return os.environ["TRAINERS_VLLM_PYTHON"]
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed here (scripts/setup.sh installs it; or set TRAINERS_VLLM_PYTHON to a "
                    "Python that has it)")
    return sys.executable


# The tool demo's SFT warm start (examples/grpo_tools.py, seed 0), saved: its warm-up takes ~950 steps (4-10 minutes
# here) and the step at which the model learns to copy the numbers moves with the host's rounding (it never came
# within 1,500 steps on one AVX2 host), so the demo's test starts its RL from this one (docs/testing.md).
TOOL_WARM_START = os.path.join(REPO, "tests", "data", "tool-warm-start")


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


def run_script(script: str, *args, timeout: int = 600, env: dict | None = None,
               check: bool = True) -> subprocess.CompletedProcess:
    """``python <script> <args>`` in its own process from the repository (a job that starts vLLM, or needs a fresh
    interpreter); with ``check``, a non-zero exit is an AssertionError showing the ends of its output."""
    result = subprocess.run([sys.executable, script, *map(str, args)], capture_output=True, text=True,
                            timeout=timeout, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    if check and result.returncode != 0:
        raise AssertionError(f"{os.path.basename(script)} failed ({result.returncode}):\n{result.stdout[-3000:]}\n"
                             f"{result.stderr[-6000:]}")
    return result


def run_job(script: str, *args, report: str, timeout: int = 600) -> dict:
    """``run_script`` a job that writes a JSON report, and read the report (a path)."""
    run_script(script, *args, timeout=timeout)
    with open(report) as f:
        return json.load(f)


def reports_of_one_job(script: str, modes: list[str], tmp_path_factory, arguments=lambda: [],
                       report_name: str = "report.json", timeout: int = 1200):
    """``report(mode)``: the report of one of ``modes``, which the vLLM job ``script`` runs once, one after the other
    in one process (``script MODES *arguments() OUT``; each writes OUT/MODE/``report_name``), when a test first
    needs one of them. ``arguments`` is called then (a port it picks is free at that moment)."""
    out = []

    def report(mode: str) -> dict:
        if not out:
            out.append(tmp_path_factory.mktemp("together"))
            run_script(script, ",".join(modes), *arguments(), out[0], timeout=timeout)
        with open(out[0] / mode / report_name) as f:
            return json.load(f)

    return report


def against(server):
    """The arguments a vLLM server job takes before OUT: the server's URL and model, and a free group port."""
    return lambda: [server.url, server.model_dir, free_port()]


def child_processes(pid: int | None = None) -> list[str]:
    """The command lines of a process's children (this one's by default): e.g. an engine core vLLM started."""
    pid = pid or os.getpid()
    children = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            for child in f.read().split():
                with open(f"/proc/{child}/cmdline", "rb") as cmdline:
                    children.append(cmdline.read().replace(b"\0", b" ").decode(errors="replace").strip())
    return children


def noisy_model(model_dir: str, seed: int = 0, scale: float = 0.3):
    """The model in ``model_dir`` (float32, eval mode) with every weight moved by seeded noise of ``scale``: a teacher
    or reference whose outputs differ from the model's."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * scale)
    return model.eval()


def digits(completions, **kwargs) -> list[float]:
    """A reward: the fraction of digit characters, learnable from scratch in a few dozen steps."""
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def digits_varied(completions, **kwargs) -> list[float]:
    """``digits`` plus a small content-dependent term, so a group's rewards always differ."""
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) + (sum(map(ord, c)) % 7) / 100 for c in completions]


def rank_reports(folder, prefix: str = "report", num_processes: int = 2) -> list[dict]:
    """The JSON reports a launched job wrote, one per rank (``<prefix>-<rank>.json``), in rank order."""
    reports = []
    for rank in range(num_processes):
        with open(os.path.join(folder, f"{prefix}-{rank}.json")) as f:
            reports.append(json.load(f))
    return reports


@contextlib.contextmanager
def warnings_of(name: str, caplog):
    """caplog's warnings from logger ``name`` (which a trainer built earlier in this process stops propagating),
    each once (a record can reach caplog by two handlers): yields a function that lists them."""
    logger = logging.getLogger(name)
    propagate, logger.propagate = logger.propagate, True
    try:
        with caplog.at_level(logging.WARNING, logger=name):
            yield lambda: list({id(r): r for r in caplog.records}.values())
    finally:
        logger.propagate = propagate


def step_records(trainer) -> list[dict]:
    """``trainer.state.log_history`` without train()'s closing summary record (train_runtime, train_loss, ...):
    the records of steps and evaluations."""
    return [record for record in trainer.state.log_history if "train_runtime" not in record]


class MicroBatches(TrainerCallback):
    """Micro-batches per optimizer step (``per_step``): on_substep_end fires after each but the last."""

    def __init__(self):
        self.per_step, self.current = [], 1

    def on_substep_end(self, args, state, control, **kwargs):
        self.current += 1

    def on_step_end(self, args, state, control, **kwargs):
        self.per_step.append(self.current)
        self.current = 1


class Rounds(TrainerCallback):
    """Each generation round as the trainer announced it (on_rollout_end): ``rollouts`` (its Rollout: the rows,
    masks, advantages and log-probs this process trains on), ``metrics`` and ``samples``, in order."""

    def __init__(self):
        self.rollouts, self.metrics, self.samples = [], [], []

    def on_rollout_end(self, args, state, control, rollout=None, metrics=None, samples=None, **kwargs):
        self.rollouts.append(rollout)
        self.metrics.append(metrics)
        self.samples.append(samples)
