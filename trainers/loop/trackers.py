"""Experiment trackers (``report_to``) through Accelerate's trackers: tensorboard, trackio, wandb, mlflow.

metrics.jsonl is always written (trainers/logs.py); trackers are an addition. Each tracker's package is an
optional extra (``pip install "trainers[tensorboard]"``); asking for one whose package is missing is an error
before training starts, not a silent no-op.
"""

from __future__ import annotations

import importlib.util
import json
import math

from trainers.errors import ConfigError

# tracker name -> (the module Accelerate imports for it, the extra that installs it)
TRACKERS = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "trackio": ("trackio", "trackio"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
}


def resolve_report_to(report_to: str | list[str]) -> list[str]:
    """``report_to`` -> the tracker names to use ([] for 'none'). 'all' means every installed one."""
    names = [report_to] if isinstance(report_to, str) else list(report_to)
    if names in (["none"], []):
        return []
    if names == ["all"]:
        return [n for n, (module, _) in TRACKERS.items() if importlib.util.find_spec(module) is not None]
    for name in names:
        if name not in TRACKERS:
            raise ConfigError(f"report_to={report_to!r}: unknown tracker {name!r}; valid: 'none', 'all', "
                              f"{sorted(TRACKERS)}. metrics.jsonl in output_dir is always written.")
        module, extra = TRACKERS[name]
        if importlib.util.find_spec(module) is None:
            raise ConfigError(f"report_to={report_to!r}: the {name!r} tracker needs the {module!r} package; "
                              f'pip install "trainers[{extra}]" (or report_to="none").')
    return names


def flat_config(config: dict) -> dict:
    """Config values trackers accept as hyperparameters: scalars kept, anything else as its JSON text."""
    out = {}
    for key, value in config.items():
        if value is None or isinstance(value, (bool, int, float, str)):
            out[key] = "None" if value is None else value
        else:
            out[key] = json.dumps(value, default=str)
    return out


def numeric_metrics(record: dict) -> dict:
    """The finite numbers of a metrics record (trackers reject strings and some reject NaN)."""
    return {k: v for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
            and math.isfinite(v) and k != "step"}
