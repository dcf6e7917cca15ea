"""trainers.cli.report on hand-written run folders: which plots an SFT run gets, tokens/s derived from num_tokens,
the errors for a missing metrics.jsonl or matplotlib, and HTML escaping."""

import json
import os
import sys

import pytest

from trainers.errors import TrainersError
from trainers.cli.report import ReportError, build_plots, tokens_per_second, visible_text, write_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def read_text(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def write_jsonl(path, records):
    with open(path, "w") as f:
        f.writelines(json.dumps(record) + "\n" for record in records)


def sft_run(folder) -> str:
    """An SFT-style output_dir: loss, accuracy, lr, grad_norm, num_tokens, step_time (no tokens_per_second),
    eval records, and no training_args.json or completions.jsonl."""
    records = []
    for step in range(1, 6):
        records.append({"step": step, "epoch": step / 5, "loss": 2.0 / step, "mean_token_accuracy": 0.1 * step,
                        "learning_rate": 1e-3 * (1 - step / 5), "grad_norm": 1.0, "nonfinite_steps": 0,
                        "step_time": 0.5, "num_tokens": 1000 * step})
        if step % 2 == 0:
            records.append({"step": step, "epoch": step / 5, "eval_loss": 2.2 / step})
    os.makedirs(folder, exist_ok=True)
    write_jsonl(os.path.join(folder, "metrics.jsonl"), records)
    return str(folder)


def test_sft_run_gets_only_loss_lr_and_tokens_plots(tmp_path):
    run = sft_run(tmp_path / "run")
    written = write_report(run)
    assert sorted(written) == ["html", "learning_rate", "loss", "tokens_per_second"]
    for name, path in written.items():
        assert os.path.dirname(path) == os.path.join(run, "report")
        if name != "html":
            with open(path, "rb") as f:
                assert f.read(8) == PNG_MAGIC
    page = read_text(written["html"])
    assert page.count("data:image/png;base64,") == 3
    assert "training_args.json is missing" in page and "Completions" not in page
    assert "No health warnings." in page


def test_eval_loss_is_overlaid_on_the_loss_plot(tmp_path):
    run = sft_run(tmp_path / "run")
    from trainers.cli.report import read_run

    loss = next(p for p in build_plots(read_run(run)[0]) if p.name == "loss")
    assert [label for label, _ in loss.lines] == ["loss", "eval_loss"]
    assert [s for s, _ in loss.lines[1][1]] == [2, 4]


def test_tokens_per_second_is_derived_from_num_tokens_and_step_time():
    history = [{"step": 2, "num_tokens": 400, "step_time": 0.5},  # 400 tokens over 2 steps of 0.5 s
               {"step": 2, "eval_loss": 1.0},
               {"step": 4, "num_tokens": 1200, "step_time": 1.0}]  # 800 tokens over 2 steps of 1 s
    assert tokens_per_second(history) == [(2, 400.0), (4, 400.0)]
    assert tokens_per_second([{"step": 1, "tokens_per_second": 7.0, "num_tokens": 1, "step_time": 1}]) == [(1, 7.0)]


def test_report_dir_option(tmp_path):
    written = write_report(sft_run(tmp_path / "run"), str(tmp_path / "elsewhere"))
    assert all(os.path.dirname(p) == str(tmp_path / "elsewhere") for p in written.values())


def test_missing_metrics_file_is_a_clear_error(tmp_path):
    with pytest.raises(ReportError, match="metrics.jsonl not found") as caught:
        write_report(str(tmp_path))
    assert isinstance(caught.value, TrainersError)  # the CLI prints these without a traceback
    assert str(tmp_path) in str(caught.value)
    assert not os.path.exists(tmp_path / "report")


def test_a_torn_last_line_is_dropped_but_a_broken_middle_line_is_an_error(tmp_path):
    run = sft_run(tmp_path / "run")
    with open(os.path.join(run, "metrics.jsonl"), "a") as f:
        f.write('{"step": 6, "lo')  # the run was killed mid-write
    assert "loss" in write_report(run)
    with open(os.path.join(run, "metrics.jsonl"), "a") as f:
        f.write('\n{"step": 7, "loss": 1.0}\n')  # the torn line is no longer the last one
    with pytest.raises(ReportError, match="line 8 is not valid JSON"):
        write_report(run)


def test_missing_matplotlib_says_what_to_install(tmp_path, monkeypatch):
    run = sft_run(tmp_path / "run")
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # makes the import fail
    with pytest.raises(ReportError, match=r'pip install "trainers\[plots\]"'):
        write_report(run)


def test_completions_and_config_are_html_escaped(tmp_path):
    run = sft_run(tmp_path / "run")
    with open(os.path.join(run, "training_args.json"), "w") as f:
        json.dump({"trainer": "GRPOTrainer", "model": "<tiny>", "num_processes": 1, "effective_batch_size": 8,
                   "max_steps": 5, "config": {"learning_rate": 0.001, "run_name": "<b>bold</b>"}}, f)
    rows = [{"step": 1, "prompt": [{"role": "user", "content": "<q>"}], "completion": f"<script>{i}</script>",
             "reward": float(i), "advantage": 0.0} for i in range(12)]
    rows.append({"step": 1, "prompt": "p", "completion": "no reward", "reward": float("nan"), "advantage": None})
    write_jsonl(os.path.join(run, "completions.jsonl"), rows)
    page = read_text(write_report(run)["html"])
    assert "<script>" not in page and "&lt;script&gt;11&lt;/script&gt;" in page  # best
    assert "&lt;script&gt;0&lt;/script&gt;" in page  # worst
    assert "&lt;script&gt;6&lt;/script&gt;" not in page  # neither among the 5 best nor the 5 worst
    assert "no reward" not in page
    assert "user: &lt;q&gt;" in page and "&lt;b&gt;bold&lt;/b&gt;" in page and "&lt;tiny&gt;" in page
    assert "<td>steps</td><td>5 of 5</td>" in page and "<td>effective batch size</td><td>8</td>" in page


def test_control_characters_are_shown_as_escapes():
    assert visible_text("a\x13b\x7f\tc\nd\u00e9") == "a\\x13b\\x7f\tc\nd\u00e9"
