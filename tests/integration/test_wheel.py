"""A wheel of the project is a working install on its own: built offline, installed (without dependencies) into a
fresh virtual environment, and run from a folder outside the checkout, it imports from that environment, its
`trainers plan` finds the shipped templates (package data), and `trainers grpo` launches 2 processes under the
shipped zero3 template and trains the embedded default for a step.

The new environment gets its dependencies (torch, transformers, ...) without a network from a ``.pth`` file that
adds this interpreter's site-packages to its path. A path added that way is not a site directory: the ``.pth``
files inside it, among them the editable install of this checkout, are not processed, so the ``trainers`` that
imports is the wheel's (asserted below).
"""

import json
import math
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.conftest import REPO, free_port

pytestmark = pytest.mark.slow

TEMPLATES = ("single_gpu", "multi_gpu", "zero1", "zero2", "zero3", "zero3_offload", "fsdp2")
SOURCES = ("pyproject.toml", "README.md", "trainers")  # what a wheel is built from


def run(command: list, cwd, timeout: int = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    result = subprocess.run([str(c) for c in command], capture_output=True, text=True, timeout=timeout, cwd=str(cwd),
                            env=env or clean_env(), check=False)
    assert result.returncode == 0, (f"{' '.join(map(str, command))} -> {result.returncode}\n"
                                    f"{result.stdout[-4000:]}\n{result.stderr[-8000:]}")
    return result


def clean_env(**extra: str) -> dict:
    """This process's environment without what would point the new environment back at the checkout."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    return {**env, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INDEX": "1", "PYTHONNOUSERSITE": "1",
            "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **extra}


def dependency_paths() -> list[str]:
    """This interpreter's site-packages folders: where the new environment finds torch and the rest."""
    paths = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *site.getsitepackages()]
    return list(dict.fromkeys(p for p in paths if os.path.isdir(p)))


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict:
    """Build the wheel from a copy of the sources (nothing written into the checkout), install it into a fresh
    venv, then give the venv this interpreter's dependencies. Returns the venv's paths and an outside folder."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"
    source.mkdir()
    for name in SOURCES:
        path = Path(REPO) / name
        if path.is_dir():
            shutil.copytree(path, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
        else:
            shutil.copy2(path, source / name)
    dist = root / "dist"
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", dist,
         source], cwd=root)
    (wheel,) = dist.glob("trainers-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    assert {f"trainers/templates/{name}.yaml" for name in TEMPLATES} <= names, sorted(names)
    assert "trainers/cli/templates.py" in names and "trainers/cli/planner/__init__.py" in names
    # the one module `trainers vllm-serve` puts on the server's PYTHONPATH travels as package data
    assert "trainers/generation/vllm_worker/trainers_vllm_worker.py" in names, sorted(names)

    venv = root / "venv"
    run([sys.executable, "-m", "venv", venv], cwd=root)
    python = venv / "bin" / "python"
    # install before the .pth exists: pip then sees no other trainers (the checkout's editable install)
    run([python, "-m", "pip", "install", "--no-deps", "--no-index", "-q", wheel], cwd=root)
    purelib = run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=root)
    purelib = Path(purelib.stdout.strip())
    (purelib / "zz_dependencies_from_the_test_interpreter.pth").write_text("\n".join(dependency_paths()) + "\n")
    outside = root / "elsewhere"  # the working folder of every command below: not the checkout
    outside.mkdir()
    return {"venv": venv, "python": python, "trainers": venv / "bin" / "trainers", "purelib": purelib,
            "outside": outside}


def test_the_wheel_imports_from_the_new_environment_not_the_checkout(installed):
    code = ("import sys, trainers, torch, trainers.cli.templates as t; "
            "print(trainers.__file__); print(torch.__file__); print(t.templates_dir()); "
            "print(any('__editable__' in name for name in sys.modules))")
    out = run([installed["python"], "-c", code], cwd=installed["outside"]).stdout.split("\n")
    package, torch_file, templates, editable = out[:4]
    purelib = str(installed["purelib"].resolve())
    assert Path(package).resolve().is_relative_to(purelib), package
    assert not Path(package).resolve().is_relative_to(Path(REPO).resolve()), package
    assert editable == "False"  # the checkout's editable finder was not activated through the .pth
    assert any(Path(torch_file).resolve().is_relative_to(Path(p).resolve()) for p in dependency_paths()), torch_file
    assert Path(templates).resolve() == Path(purelib) / "trainers" / "templates"


def test_plan_lists_the_shipped_templates(installed):
    result = run([installed["trainers"], "plan", "--model-size", "7B", "--method", "grpo", "--num-gpus", "8",
                  "--gpu-memory", "80"], cwd=installed["outside"], timeout=120)
    text = result.stdout
    assert "Nothing fits" not in text
    for name in TEMPLATES:
        assert f"\n{name} " in text, name
    assert "Recommended: zero3" in text
    assert "accelerate launch --config_file accelerate_configs/zero3.yaml --num_processes 8" in text
    env = run([installed["trainers"], "env", "--accelerate_config", "zero3"], cwd=installed["outside"], timeout=120)
    assert "zero_stage" in env.stdout and str(installed["purelib"].resolve() / "trainers" / "templates") in env.stdout


def test_grpo_launches_two_processes_under_the_shipped_zero3(installed):
    out = installed["outside"] / "run"
    command = [installed["trainers"], "grpo", "--accelerate_config", "zero3", "--num_processes", "2",
               "--main_process_port", str(free_port()), "--max_steps", "1", "--logging_steps", "1", "--output_dir",
               out, "--disable_tqdm", "true"]
    result = run(command, cwd=installed["outside"], timeout=600, env=clean_env(OMP_NUM_THREADS="1",
                                                                               PYTHONUNBUFFERED="1"))
    launched = result.stdout + result.stderr
    assert "accelerate.commands.launch" in launched
    assert str(installed["purelib"].resolve() / "trainers" / "templates" / "zero3.yaml") in launched
    with open(out / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f if line.strip()]
    step_one = [r for r in records if r.get("step") == 1 and "loss" in r]
    assert step_one and math.isfinite(step_one[-1]["loss"]), records
    info = json.loads((out / "training_args.json").read_text())
    assert info["num_processes"] == 2
