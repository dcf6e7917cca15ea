"""The package's public names (trainers/__init__.py) are imported on first use: ``from trainers import X`` and
``trainers.X`` give the class its module defines, and a process that imports only ``trainers.parallel.distributed`` (the
clean-exit check, ``trainers vllm-serve``'s launcher) does not load transformers, peft or a trainer."""

import importlib
import subprocess
import sys

import pytest

import trainers
from tests.conftest import REPO


def test_every_public_name_is_its_modules_own():
    namespace: dict = {}
    exec("from trainers import *", namespace)  # noqa: S102  (star-import through __all__ and __getattr__)
    names = set(namespace) - {"__builtins__"}
    assert names == set(trainers.__all__) and {"GRPOTrainer", "SFTConfig", "TrainingConfig"} <= names
    for name in trainers.__all__:
        value = getattr(trainers, name)
        assert value.__name__ == name and getattr(importlib.import_module(value.__module__), name) is value
    assert set(trainers.__all__) <= set(dir(trainers))


def test_a_missing_name_is_an_attribute_error_that_names_it():
    with pytest.raises(AttributeError, match="no attribute 'GRPOTrainr'"):
        trainers.GRPOTrainr  # noqa: B018
    with pytest.raises(ImportError, match="GRPOTrainr"):
        exec("from trainers import GRPOTrainr", {})  # noqa: S102


def test_the_distributed_core_imports_without_transformers_or_a_trainer():
    # `import trainers` imports trainers.parallel.distributed (the notebook_launcher fork hook), nothing heavier
    code = ("import sys, trainers\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('transformers', 'peft', 'datasets')"
            " or m in ('trainers.grpo', 'trainers.sft', 'trainers.config.training')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
