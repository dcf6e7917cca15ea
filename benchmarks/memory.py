"""Per-rank memory under each shipped template, 2 processes: peak and steady-state RSS, and model states by kind.

    python benchmarks/memory.py                                   # ~300M-parameter model, SFT, all CPU templates
    python benchmarks/memory.py --method grpo --templates multi_gpu zero3
    python benchmarks/memory.py --width 512 --layers 4            # a quick run

It builds a Qwen2-shaped model offline (width 2048, 8 layers: ~303M parameters by default), then for each
template runs ``benchmarks/memory_job.py`` through ``accelerate launch --num_processes 2`` and prints, per
rank: RSS after loading, after prepare, peak during training, steady state after the last step, on a GPU the
peak of torch's allocator, and the model-state bytes the rank holds (parameters, fp32 master weights,
gradients, optimizer states). Results
and the analysis are in docs/distributed.md.
"""

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from trainers.generation.local_server import free_port  # noqa: E402


def build_model(path: str, width: int, layers: int) -> str:
    from trainers.cli.tiny import save_tiny_model

    if not os.path.exists(os.path.join(path, "config.json")):
        heads = max(1, width // 128)
        save_tiny_model(path, hidden_size=width, num_layers=layers, num_heads=heads, num_kv_heads=max(1, heads // 4),
                        intermediate_size=int(width * 2.18) // 16 * 16, max_position_embeddings=4096)
    return path


def run(template: str, model: str, method: str, out: str, num_processes: int, extra: list[str]) -> list[dict]:
    config = os.path.join(REPO, "accelerate_configs", f"{template}.yaml")
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config,
               "--num_processes", str(num_processes), "--main_process_port", str(free_port()),
               os.path.join(REPO, "benchmarks", "memory_job.py"), "--model", model, "--method", method, "--out", out,
               *extra]
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if result.returncode != 0:
        print(result.stdout[-3000:], result.stderr[-6000:], file=sys.stderr)
        raise SystemExit(f"{template} failed")
    reports = []
    for path in sorted(glob.glob(os.path.join(out, "memory-*.json"))):
        with open(path) as f:
            reports.append(json.load(f))
    return reports


def stage(report: dict, name: str, key: str = "rss_gb") -> float:
    return next((s[key] for s in report["stages"] if s["stage"] == name), float("nan"))


def gpu(report: dict) -> str:
    """The rank's peak of torch's CUDA allocator over the run (what the planner's GPU figures are checked
    against; its RSS columns are then host memory); "-" for a CPU run."""
    return f"{report['peak_gpu_gb']:.2f}" if "peak_gpu_gb" in report else "-"


def table(rows: list[tuple[str, dict]]) -> str:
    head = ("| template | rank | after load | after prepare | peak | steady | peak GPU | params | master | grads | "
            "optimizer | model states | model states × N |")
    lines = [head, "|" + "---|" * 13]
    for template, r in rows:
        s = r["model_states_gb"]
        total = sum(v for k, v in s.items() if k != "gathered_parameters")
        lines.append(
            f"| {template} | {r['rank']} | {stage(r, 'after_load'):.2f} | {stage(r, 'after_prepare'):.2f} | "
            f"{r['peak_rss_gb']:.2f} | {r['steady_rss_gb']:.2f} | {gpu(r)} | {s.get('parameters', 0):.2f} | "
            f"{s.get('master_weights', 0):.2f} | {s.get('gradients', 0):.2f} | {s.get('optimizer_states', 0):.2f} | "
            f"{total:.2f} | {total * r['num_processes']:.2f} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--templates", nargs="+", default=["multi_gpu", "zero1", "zero2", "zero3", "zero3_offload"])
    parser.add_argument("--method", choices=["sft", "grpo"], default="sft")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--num_processes", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--bf16", choices=["template", "true", "false"], default="false",
                        help="Mixed precision: 'false' (fp32, default), 'true', or what each template says.")
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "trainers-memory"))
    parser.add_argument("--json", help="Also write all reports to this file.")
    cli = parser.parse_args()

    model = build_model(os.path.join(cli.workdir, f"model-{cli.width}x{cli.layers}"), cli.width, cli.layers)
    rows = []
    for template in cli.templates:
        out = os.path.join(cli.workdir, f"{cli.method}-{template}")
        for old in glob.glob(os.path.join(out, "memory-*.json")):
            os.remove(old)
        reports = run(template, model, cli.method, out, cli.num_processes,
                      ["--steps", str(cli.steps), "--bf16", cli.bf16])
        rows += [(template, r) for r in reports]
        print(table([(template, r) for r in reports]).splitlines()[-1 - len(reports) + 1], flush=True)
    params = rows[0][1]["num_parameters"]
    print(f"\n{cli.method.upper()}, {params / 1e6:.0f}M parameters, {cli.num_processes} processes, "
          f"mixed precision {rows[0][1]['mixed_precision']} (GB per rank; RSS = resident memory)\n")
    print(table(rows))
    if cli.json:
        with open(cli.json, "w") as f:
            json.dump([{"template": t, **r} for t, r in rows], f, indent=1)


if __name__ == "__main__":
    main()
