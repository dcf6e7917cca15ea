"""``trainers report``: plots and one self-contained HTML page from a run's output_dir.

Reads ``metrics.jsonl`` (required), ``training_args.json`` (optional: trainer, model, batch size, config) and
``completions.jsonl`` (optional: GRPO with ``log_completions=True``). Writes one PNG per metric group the run
logged (loss, reward, completion length, KL, entropy, clip ratio, learning rate, tokens/s) and ``report.html``,
which embeds the PNGs as data URIs, so the page can be mailed or attached to an issue as a single file.
Needs matplotlib: ``pip install "trainers[plots]"``.
"""

from __future__ import annotations

import base64
import html
import json
import math
import os
from dataclasses import dataclass, field

from trainers.errors import TrainersError
from trainers.sampling import health as grpo_health
from trainers.loop.health import RULES as HEALTH_RULES
from trainers.loop.health import HealthMonitor, series
from trainers.logs import METRICS_FILE, RUN_INFO_FILE  # RUN_INFO_FILE: written at the start of train()

COMPLETIONS_FILE = "completions.jsonl"  # written by GRPOTrainer with log_completions=True
HTML_FILE = "report.html"
COMPLETIONS_SHOWN = 5  # best and worst completions by reward, each


class ReportError(TrainersError):
    """A run's output_dir lacks what the report needs, or matplotlib is missing."""


# ---------------------------------------------------------------------------------------------------- reading

def read_jsonl(path: str) -> list[dict]:
    """The records of a JSON-lines file. A malformed last line is dropped (a run killed while writing it);
    a malformed line elsewhere is an error naming the file and line."""
    with open(path, encoding="utf-8") as f:
        lines = [line for line in f.read().splitlines() if line.strip()]
    records = []
    for number, line in enumerate(lines, start=1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as error:
            if number == len(lines):
                break
            raise ReportError(f"{path} line {number} is not valid JSON ({error}).") from None
    return records


def read_run(output_dir: str) -> tuple[list[dict], dict | None, list[dict] | None]:
    """(metrics history, run info or None, completion rows or None) of a run's output_dir."""
    metrics_path = os.path.join(output_dir, METRICS_FILE)
    if not os.path.isfile(metrics_path):
        raise ReportError(f"{metrics_path} not found: a report needs the metrics.jsonl that training writes into its "
                          f"output_dir. Give the run's output_dir (the folder holding metrics.jsonl).")
    history = read_jsonl(metrics_path)
    info_path = os.path.join(output_dir, RUN_INFO_FILE)
    info = None
    if os.path.isfile(info_path):
        with open(info_path, encoding="utf-8") as f:
            info = json.load(f)
    completions_path = os.path.join(output_dir, COMPLETIONS_FILE)
    completions = read_jsonl(completions_path) if os.path.isfile(completions_path) else None
    return history, info, completions


# ---------------------------------------------------------------------------------------------------- plots

@dataclass
class Plot:
    """One PNG: lines against step, an optional shaded band and an optional second y axis."""

    name: str
    title: str
    ylabel: str
    lines: list[tuple[str, list[tuple[float, float]]]] = field(default_factory=list)  # (label, [(step, value)])
    band: tuple[str, list[tuple[float, float, float]]] | None = None  # (label, [(step, low, high)])
    right: tuple[str, list[tuple[float, float]]] | None = None  # (label, points) on a second axis

    def add(self, label: str, points: list) -> None:
        """Add a line when it has points (so absent metrics simply leave nothing)."""
        points = [(s, v) for s, v in points if s is not None]
        if points:
            self.lines.append((label, points))


def tokens_per_second(history: list[dict]) -> list[tuple[float, float]]:
    """The logged ``tokens_per_second``; for older runs without it, derived from the cumulative ``num_tokens`` and
    the per-step ``step_time`` (averaged over the logging window): new tokens / (steps in window x step time)."""
    direct = series(history, "tokens_per_second")
    if direct:
        return direct
    points, previous_step, previous_tokens = [], 0, 0
    for record in history:
        step, tokens, seconds = record.get("step"), record.get("num_tokens"), record.get("step_time")
        if not all(isinstance(x, (int, float)) for x in (step, tokens, seconds)):
            continue
        steps = step - previous_step
        if steps > 0 and seconds > 0:
            points.append((step, (tokens - previous_tokens) / (steps * seconds)))
        previous_step, previous_tokens = step, tokens
    return points


def with_eval(plot: Plot, history: list[dict], metric: str) -> Plot:
    """Overlay ``eval_<metric>`` (evaluation records) on the plot of ``metric``."""
    plot.add(f"eval_{metric}", series(history, f"eval_{metric}"))
    return plot


def build_plots(history: list[dict]) -> list[Plot]:
    """Every plot the history has data for, in the order the report shows them."""
    plots = []

    loss = Plot("loss", "Loss", "loss")
    loss.add("loss", series(history, "loss"))
    plots.append(with_eval(loss, history, "loss"))

    reward = Plot("reward", "Reward (band: mean ± std over the generation round)", "reward")
    mean = dict(series(history, "reward"))
    std = dict(series(history, "reward_std"))
    reward.add("reward", list(mean.items()))
    if std:
        reward.band = ("± reward_std", [(s, mean[s] - std[s], mean[s] + std[s]) for s in mean if s in std])
    functions = sorted({k for r in history for k in r if k.startswith("rewards/") and k.endswith("/mean")})
    if len(functions) > 1:  # one function's mean is the reward itself
        for name in functions:
            reward.add(name, series(history, name))
    plots.append(with_eval(reward, history, "reward"))

    plots += preference_plots(history)

    length = Plot("completion_length", "Completion length (band: min to max)", "tokens")
    length.add("mean length", series(history, "completions/mean_length"))
    low, high = dict(series(history, "completions/min_length")), dict(series(history, "completions/max_length"))
    if low and high:
        length.band = ("min to max", [(s, low[s], high[s]) for s in low if s in high])
    clipped = series(history, "completions/clipped_ratio")
    if clipped:
        length.right = ("truncated fraction", clipped)
    plots.append(length)

    kl = Plot("kl", "KL to the reference (k3)", "nats / token")
    kl.add("kl", series(history, "kl"))
    plots.append(kl)

    entropy = Plot("entropy", "Policy entropy", "nats / token")
    entropy.add("entropy", series(history, "entropy"))
    plots.append(entropy)

    clip = Plot("clip_ratio", "Clipped token fraction", "fraction of tokens")
    for name in ("clip_ratio/region_mean", "clip_ratio/low_mean", "clip_ratio/high_mean", "cispo_clip_ratio"):
        clip.add(name.split("/")[-1], series(history, name))
    plots.append(clip)

    learning_rate = Plot("learning_rate", "Learning rate", "learning rate")
    learning_rate.add("learning_rate", series(history, "learning_rate"))
    plots.append(learning_rate)

    throughput = Plot("tokens_per_second", "Throughput", "tokens / s")
    throughput.add("tokens/s", tokens_per_second(history))
    plots.append(throughput)

    return [p for p in plots if p.lines]


def preference_plots(history: list[dict]) -> list[Plot]:
    """DPO's and KTO's implicit rewards (beta x log-ratio to the reference) and sequence log-probs; the pairs
    ranked right (theirs and a reward model's); a reward model's scores."""
    rewards = Plot("implicit_rewards", "Implicit rewards (beta x log-ratio to the reference)", "reward")
    logps = Plot("logps", "Sequence log-probabilities", "nats")
    for side in ("chosen", "rejected", "margins"):
        for prefix in ("", "eval_"):
            rewards.add(f"{prefix}{side}", series(history, f"{prefix}rewards/{side}"))
            logps.add(f"{prefix}{side}", series(history, f"{prefix}logps/{side}"))
    ranked = Plot("pair_accuracy", "Pairs ranked right (chosen above rejected)", "fraction of pairs")
    for name in ("rewards/accuracies", "accuracy"):  # DPO's implicit reward; a reward model's score
        ranked.add(name, series(history, name))
        ranked.add(f"eval_{name}", series(history, f"eval_{name}"))
    scores = Plot("scores", "Reward model scores (band: min to max)", "score")
    mean = dict(series(history, "mean_reward"))
    scores.add("mean score", list(mean.items()))
    scores.add("margin (chosen - rejected)", series(history, "margin"))
    low, high = dict(series(history, "min_reward")), dict(series(history, "max_reward"))
    if low and high:
        scores.band = ("min to max", [(s, low[s], high[s]) for s in low if s in high])
    return [rewards, ranked, logps, scores]


def _figure_class():
    """matplotlib's Figure and its Agg canvas (no pyplot: no global state, no GUI backend, no display needed)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ReportError('trainers report needs matplotlib: pip install "trainers[plots]"') from None
    return Figure, FigureCanvasAgg


def save_plot(plot: Plot, path: str) -> None:
    """Draw ``plot`` into a PNG at ``path``."""
    Figure, FigureCanvasAgg = _figure_class()
    figure = Figure(figsize=(7, 3.6), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    if plot.band is not None and plot.band[1]:
        label, rows = plot.band
        steps, low, high = zip(*sorted(rows))
        axes.fill_between(steps, low, high, alpha=0.2, label=label)
    for label, points in plot.lines:
        steps, values = zip(*points)
        axes.plot(steps, values, marker="o" if len(points) < 30 else None, markersize=3, label=label)
    handles, labels = axes.get_legend_handles_labels()
    if plot.right is not None:
        label, points = plot.right
        twin = axes.twinx()
        steps, values = zip(*points)
        twin.plot(steps, values, color="tab:red", linestyle="--", label=label)
        twin.set_ylabel(label)
        more_handles, more_labels = twin.get_legend_handles_labels()
        handles, labels = handles + more_handles, labels + more_labels
    if plot.name == "learning_rate":
        axes.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    axes.set_title(plot.title)
    axes.set_xlabel("step")
    axes.set_ylabel(plot.ylabel)
    axes.grid(alpha=0.3)
    if len(labels) > 1:
        axes.legend(handles, labels, fontsize="small")
    figure.tight_layout()
    figure.savefig(path, format="png")


# ---------------------------------------------------------------------------------------------------- HTML

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 980px; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; }
td, th { border: 1px solid #ccc; padding: 3px 8px; text-align: left; vertical-align: top; font-size: 0.9em; }
th { background: #f3f3f3; }
img { max-width: 100%; display: block; margin: 0.5em 0 1em; }
.warning { background: #fff4e5; border-left: 4px solid #f0a030; padding: 0.5em 0.8em; margin: 0.5em 0; }
pre { white-space: pre-wrap; word-break: break-word; margin: 0; font-size: 0.85em; }
"""


def _text(value) -> str:
    """A value as escaped HTML text (JSON for containers, so lists and dicts read as they were configured)."""
    if isinstance(value, (dict, list, tuple)):
        value = json.dumps(value, default=str)
    return html.escape(str(value))


def _number(value) -> str:
    """A number in 4 significant digits; anything else (None, text) as escaped text."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{value:.4g}"
    return _text(value)


def _table(rows: list[tuple], header: tuple | None = None) -> str:
    head = "<tr>" + "".join(f"<th>{_text(h)}</th>" for h in header) + "</tr>" if header else ""
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows)
    return f"<table>{head}{body}</table>"


def summary_rows(history: list[dict], info: dict | None) -> list[tuple[str, str]]:
    """What ran and how far: trainer, model, steps, effective batch size, last metrics."""
    info = info or {}
    steps = [r["step"] for r in history if isinstance(r.get("step"), int)]
    last_step = max(steps) if steps else 0
    planned = info.get("max_steps")
    rows = [("trainer", info.get("trainer", "unknown (no training_args.json)")),
            ("model", info.get("model", "unknown")),
            ("steps", f"{last_step} of {planned}" if planned else last_step),
            ("effective batch size", info.get("effective_batch_size", "unknown")),
            ("processes", info.get("num_processes", "unknown"))]
    for name in ("loss", "reward", "rewards/accuracies", "accuracy", "eval_loss", "eval_reward",
                 "eval_rewards/accuracies", "eval_accuracy"):
        points = series(history, name)
        if points:
            rows.append((f"last {name}", f"{points[-1][1]:.4g} (step {points[-1][0]})"))
    return [(_text(k), _text(v)) for k, v in rows]


def visible_text(text: str) -> str:
    """Control characters (a young policy samples plenty) as ``\\xNN``: invisible or invalid in HTML otherwise."""
    return "".join(f"\\x{ord(ch):02x}" if (ord(ch) < 32 and ch not in "\n\t") or 127 <= ord(ch) < 160 else ch
                   for ch in text)


def _prompt_text(prompt) -> str:
    """A prompt as text: a string as is, a conversation as 'role: content' lines."""
    if isinstance(prompt, list):
        return "\n".join(f"{m.get('role', '?')}: {m.get('content', '')}" if isinstance(m, dict) else str(m)
                         for m in prompt)
    return str(prompt)


def completion_sections(completions: list[dict]) -> str:
    """Tables of the best and worst completions by reward (rows without a finite reward are left out)."""
    scored = [c for c in completions if isinstance(c.get("reward"), (int, float)) and math.isfinite(c["reward"])]
    if not scored:
        return "<p>completions.jsonl holds no completion with a finite reward.</p>"
    # Stable sorts: among equal rewards, the earliest logged completion comes first in both tables.
    best = sorted(scored, key=lambda c: c["reward"], reverse=True)[:COMPLETIONS_SHOWN]
    worst = sorted(scored, key=lambda c: c["reward"])[:COMPLETIONS_SHOWN]

    def table(rows: list[dict]) -> str:
        return _table([(_text(r.get("step")), _number(r["reward"]), _number(r.get("advantage")),
                        f"<pre>{_text(visible_text(_prompt_text(r.get('prompt'))))}</pre>",
                        f"<pre>{_text(visible_text(str(r.get('completion'))))}</pre>")
                       for r in rows], ("step", "reward", "advantage", "prompt", "completion"))

    return (f"<p>{len(scored)} completions logged; the {len(best)} best and {len(worst)} worst by reward.</p>"
            f"<h3>Best</h3>{table(best)}<h3>Worst</h3>{table(worst)}")


def render_html(output_dir: str, history: list[dict], info: dict | None, completions: list[dict] | None,
                images: dict[str, bytes], plots: list[Plot], warnings: list[str]) -> str:
    """The report page: summary, health warnings, plots (embedded), config, completions."""
    title = f"Training report: {os.path.basename(os.path.normpath(output_dir))}"
    parts = [f'<!DOCTYPE html><html><head><meta charset="utf-8"><title>{_text(title)}</title>',
             f"<style>{STYLE}</style></head><body>", f"<h1>{_text(title)}</h1>",
             f"<p>From <code>{_text(os.path.abspath(output_dir))}</code>: {len(history)} metrics records.</p>",
             "<h2>Run</h2>", _table(summary_rows(history, info))]

    parts.append("<h2>Health</h2>")
    if warnings:
        parts += [f'<div class="warning">{_text(w)}</div>' for w in warnings]
    else:
        parts.append("<p>No health warnings.</p>")

    parts.append("<h2>Metrics</h2>")
    if not plots:
        parts.append("<p>No metrics to plot.</p>")
    for plot in plots:
        data = base64.b64encode(images[plot.name]).decode("ascii")
        parts.append(f'<img alt="{_text(plot.title)}" src="data:image/png;base64,{data}">')

    parts.append("<h2>Config</h2>")
    config = (info or {}).get("config")
    if isinstance(config, dict):
        parts.append(_table([(_text(k), _text(v)) for k, v in sorted(config.items())], ("option", "value")))
    else:
        parts.append(f"<p>No config: {RUN_INFO_FILE} is missing from the output_dir.</p>")

    if completions is not None:
        parts += ["<h2>Completions</h2>", completion_sections(completions)]
    parts.append("</body></html>")
    return "\n".join(parts)


# ---------------------------------------------------------------------------------------------------- entry point

def write_report(output_dir: str, report_dir: str | None = None) -> dict[str, str]:
    """Write one PNG per metric group the run logged and a self-contained ``report.html`` into ``report_dir``
    (default ``output_dir/report``). Returns name -> path of every file written (plot names, and "html")."""
    _figure_class()  # a clear error before anything is read or written when matplotlib is missing
    history, info, completions = read_run(output_dir)
    plots = build_plots(history)
    report_dir = report_dir or os.path.join(output_dir, "report")
    os.makedirs(report_dir, exist_ok=True)
    written, images = {}, {}
    for plot in plots:
        path = os.path.join(report_dir, f"{plot.name}.png")
        save_plot(plot, path)
        with open(path, "rb") as f:
            images[plot.name] = f.read()
        written[plot.name] = path
    warnings = HealthMonitor(grpo_health.RULES + HEALTH_RULES).replay(history)  # every trainer's rules
    path = os.path.join(report_dir, HTML_FILE)
    with open(path, "w", encoding="utf-8") as f:
        f.write(render_html(output_dir, history, info, completions, images, plots, warnings))
    written["html"] = path
    return written
