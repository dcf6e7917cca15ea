"""Run output: metrics records (history, metrics.jsonl, console), the progress bar, and the run's logger."""

from __future__ import annotations

import json
import logging
import math
import os
import time

logger = logging.getLogger("trainers")
if not logger.handlers:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("[trainers] %(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False

LOG_LEVELS = ("passive", "debug", "info", "warning", "error", "critical")  # transformers' log_level choices


def set_log_level(level: str) -> None:
    """transformers' ``log_level`` (main process) / ``log_level_replica`` (the others): "passive" leaves the levels
    as they are; any other level applies to this project's logger and to transformers' (whose Trainer does that)."""
    if level == "passive":
        return
    from transformers.utils import logging as hf_logging

    value = getattr(logging, level.upper())
    logger.setLevel(value)
    hf_logging.set_verbosity(value)


METRICS_FILE = "metrics.jsonl"
RUN_INFO_FILE = "training_args.json"
# The console line shows these (when present); metrics.jsonl and trackers get every metric.
CONSOLE_KEYS = ("step", "epoch", "loss", "reward", "reward_std", "kl", "entropy", "completions/mean_length",
                "grad_norm", "learning_rate", "tokens_per_second", "nonfinite_steps",
                "train_runtime", "train_samples_per_second", "train_loss")  # the last three: train()'s summary


def _round(value):
    if isinstance(value, float) and math.isfinite(value):
        return float(f"{value:.6g}")
    return value


class RunLog:
    """Writes each metrics record to the history, ``metrics.jsonl`` and the console (main process only),
    and drives the progress bar."""

    def __init__(self, accelerator, output_dir: str, total_steps: int, disable_tqdm: bool = False):
        self.is_main = accelerator.is_main_process
        self.path = os.path.join(output_dir, METRICS_FILE)
        self.total_steps = total_steps
        self.bar = None
        self.disable_tqdm = disable_tqdm or not self.is_main
        self.start_time = time.time()

    def start(self, history: list[dict], initial_step: int) -> None:
        """Rewrite metrics.jsonl from ``history`` (so a resumed run continues the same file) and open the bar."""
        self.start_time = time.time()
        if self.is_main:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            with open(self.path, "w") as f:
                for record in history:
                    f.write(json.dumps(record) + "\n")
        if not self.disable_tqdm:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=self.total_steps, initial=initial_step, desc="train", dynamic_ncols=True)

    def write_run_info(self, info: dict) -> None:
        """``output_dir/training_args.json``: the trainer, model and every config field of this run."""
        if self.is_main:
            with open(os.path.join(os.path.dirname(self.path), RUN_INFO_FILE), "w") as f:
                json.dump(info, f, indent=1, default=str)

    def advance(self, postfix: dict | None = None) -> None:
        if self.bar is not None:
            self.bar.update(1)
            if postfix:
                self.bar.set_postfix({k: f"{v:.4g}" for k, v in postfix.items() if isinstance(v, (int, float))})

    def record(self, history: list[dict], record: dict) -> None:
        record = {k: _round(v) for k, v in record.items()}
        history.append(record)
        if not self.is_main:
            return
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)  # trainer.log() before train()
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        line = " ".join(f"{k}={v}" for k, v in record.items() if k in CONSOLE_KEYS or k.startswith("eval_"))
        if self.bar is not None:
            self.bar.write(line)
        else:
            logger.info(line)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
