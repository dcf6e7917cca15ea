"""trainers report on a real tiny GRPO run (one CPU process): plots, a self-contained HTML page with the config,
health warnings and best/worst completions; and, where a Chromium is installed, that the page renders."""

import html
import json
import math
import os
import shutil
import subprocess

import pytest

from trainers import GRPOConfig, GRPOTrainer
from trainers.cli.report import visible_text, write_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
GRPO_PLOTS = ["clip_ratio", "completion_length", "entropy", "kl", "learning_rate", "loss", "reward",
              "tokens_per_second"]
PROMPTS = [{"prompt": p} for p in ["abc", "hello", "xyz", "12", "the", "cat", "sat", "on"]]


def read_text(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def distinct_characters(completions, **kwargs):
    """Varied rewards from a random model: the number of distinct characters."""
    return [float(len(set(c))) for c in completions]


@pytest.fixture(scope="module")
def grpo_run(tiny_model_dir, tmp_path_factory) -> str:
    """output_dir of a 4-step GRPO run with KL (beta), eval every 2 steps and logged completions."""
    output_dir = str(tmp_path_factory.mktemp("report") / "out")
    args = GRPOConfig(output_dir=output_dir, per_device_train_batch_size=8, num_generations=4, max_completion_length=8,
                      learning_rate=5e-3, beta=0.05, max_steps=4, logging_steps=1, save_strategy="no",
                      eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=8, report_to="none",
                      log_completions=True, disable_tqdm=True, seed=0)
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=distinct_characters, args=args, train_dataset=PROMPTS,
                          eval_dataset=PROMPTS[:2])
    trainer.train()
    return output_dir


@pytest.fixture(scope="module")
def report(grpo_run) -> dict[str, str]:
    return write_report(grpo_run)


def test_every_grpo_plot_is_a_png(grpo_run, report):
    assert sorted(report) == sorted(GRPO_PLOTS + ["html"])
    for name in GRPO_PLOTS:
        path = report[name]
        assert path == os.path.join(grpo_run, "report", f"{name}.png")
        with open(path, "rb") as f:
            data = f.read()
        assert len(data) > 1000 and data.startswith(PNG_MAGIC), name


def test_html_is_self_contained_with_config_and_summary(grpo_run, report):
    page = read_text(report["html"])
    assert page.count("data:image/png;base64,") == len(GRPO_PLOTS)
    for external in ('src="http', "src='http", 'href="http', "href='http", "url(http", "<link", "<script"):
        assert external not in page
    assert "<td>learning_rate</td><td>0.005</td>" in page
    assert "<td>num_generations</td><td>4</td>" in page
    assert "<td>trainer</td><td>GRPOTrainer</td>" in page
    assert "<td>steps</td><td>4 of 4</td>" in page
    assert "<td>effective batch size</td><td>8</td>" in page
    assert "<h2>Health</h2>" in page


def test_html_shows_the_best_and_worst_completions(grpo_run, report):
    page = read_text(report["html"])
    with open(os.path.join(grpo_run, "completions.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == 4 * 8  # every step logged its 8 completions
    rows = [r for r in rows if math.isfinite(r["reward"])]
    best, worst = max(rows, key=lambda r: r["reward"]), min(rows, key=lambda r: r["reward"])
    assert best["reward"] > worst["reward"]
    for row in (best, worst):
        assert f"<pre>{html.escape(visible_text(row['completion']))}</pre>" in page
        assert f"<td>{row['reward']:.4g}</td>" in page


def test_health_warnings_in_the_page_are_the_monitors(grpo_run, report):
    from trainers.grpo.trainer import GRPOTrainer
    from trainers.loop.health import HealthMonitor
    from trainers.cli.report import read_jsonl

    page = read_text(report["html"])
    warnings = HealthMonitor(GRPOTrainer.HEALTH_RULES).replay(read_jsonl(os.path.join(grpo_run, "metrics.jsonl")))
    for warning in warnings:
        assert html.escape(warning) in page
    assert ("No health warnings." in page) == (not warnings)


def chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if shutil.which(name):
            return shutil.which(name)
    return None


def test_page_renders_in_headless_chromium(report, tmp_path):
    browser = chromium()
    if browser is None:
        pytest.skip("no chromium, chromium-browser or google-chrome on PATH to render the page")
    command = [browser, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path / 'profile'}",
               "--dump-dom", f"file://{os.path.abspath(report['html'])}"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "<h2>Metrics</h2>" in result.stdout and result.stdout.count("<img") == len(GRPO_PLOTS)
