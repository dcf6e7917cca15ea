"""This project against TRL 1.16 on identical models, data and configs, side by side in one invocation.

    pip install -e ".[bench]"                    # TRL 1.16 (a benchmark-only dependency) and psutil
    python benchmarks/compare_trl.py             # the full table (about an hour on 2 CPU cores)
    python benchmarks/compare_trl.py --quick     # one repeat of the tiny-model rows
    python benchmarks/compare_trl.py --only grpo-tiny-64 sft-tiny-unpacked --repeats 3
    python benchmarks/compare_trl.py --gpu --repeats 1   # on a GPU: a Qwen2.5-0.5B-shaped model, bf16
    python benchmarks/compare_trl.py --only grpo-small-64 --lora 16   # both with the same LoRA adapters

Each run is its own process (so peak memory is the process's own peak RSS, VmHWM); runs of the two
frameworks alternate (TRL, ours, ours, TRL, ...) so drift on the machine hits both alike. Reported per row:
GRPO seconds per optimizer step, SFT trained (non-padding) tokens per second, peak RSS, and the ratio
ours/TRL (time) or ours/TRL (throughput) with min/median/max over repeats. Both frameworks use the same
offline-built Qwen2 models (tiny: width 256, 4 layers; small: width 768, 12 layers, ~85M parameters) with an
8k-token BPE, gradient checkpointing off, fp32, one process. GRPO completions are forced to their full length
(min_new_tokens) so both generate exactly the same number of tokens. ``--gpu`` runs its own rows on a model of
Qwen2.5-0.5B's shape in bf16 and reports peak GPU memory, SFT model FLOPs utilization and GRPO completion
tokens per second (docs/benchmarks.md, "GPU").
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNNER = os.path.join(REPO, "benchmarks", "run_one.py")

TINY = dict(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=1024)
MODELS = {
    "tiny": TINY,
    "small": dict(hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=4, intermediate_size=2048),
    # the tiny model with Qwen2.5's vocabulary of 151,936 (ids past the 8k tokenizer decode to nothing in both)
    "tiny152k": {**TINY, "vocab_size": 151936},
    # Qwen2.5-0.5B's shape (494M parameters, its 151,936-entry vocabulary), random weights: the GPU rows, and the
    # qwen05cpu rows with smaller batches.
    "qwen05": dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864,
                   vocab_size=151936, rope_theta=1e6),
}

RL_METHODS = ("grpo", "rloo", "distill")  # rows measured in s/step (a step samples)
REWARDED = ("grpo", "rloo")  # ... of which these have a reward function (distillation: a teacher)
# name -> (model, method, options, steps, warmup). The small model warms up over its first ~3 optimizer steps in
# both frameworks (a plain HF forward/backward loop shows it too: 2.8 s, 1.8 s, then 1.2 s forwards), so its
# GRPO rows skip two.
ROWS = {
    "grpo-tiny-64": ("tiny", "grpo", {"completion_length": 64}, 8, 2),
    "grpo-tiny-256": ("tiny", "grpo", {"completion_length": 256}, 5, 1),
    "rloo-tiny-64": ("tiny", "rloo", {"completion_length": 64}, 8, 2),
    "distill-tiny-64": ("tiny", "distill", {"completion_length": 64}, 8, 2),
    "grpo-small-64": ("small", "grpo", {"completion_length": 64}, 6, 2),
    "grpo-small-256": ("small", "grpo", {"completion_length": 256}, 5, 2),
    "sft-tiny-unpacked": ("tiny", "sft", {"packing": False}, 12, 2),
    "sft-tiny-packed": ("tiny", "sft", {"packing": True}, 12, 2),
    "sft-small-unpacked": ("small", "sft", {"packing": False}, 6, 1),
    "sft-small-packed": ("small", "sft", {"packing": True}, 6, 1),
    "dpo-tiny": ("tiny", "dpo", {"max_length": 256}, 10, 2),
    "reward-tiny": ("tiny", "reward", {"max_length": 256}, 10, 2),
    "kto-tiny": ("tiny", "kto", {"max_length": 256}, 10, 2),
    # at a real vocabulary the output head dominates time and memory (issue 44): a few steps suffice
    # (not in --quick: TRL takes 20-100 s a step here)
    "grpo-vocab152k-64": ("tiny152k", "grpo", {"completion_length": 64}, 4, 1),
    "distill-vocab152k-64": ("tiny152k", "distill", {"completion_length": 64}, 4, 1),
    "sft-vocab152k-unpacked": ("tiny152k", "sft", {"packing": False}, 3, 1),
    "sft-vocab152k-packed": ("tiny152k", "sft", {"packing": True}, 3, 1),
    "dpo-vocab152k": ("tiny152k", "dpo", {"max_length": 256}, 3, 1),
    "reward-vocab152k": ("tiny152k", "reward", {"max_length": 256}, 3, 1),
    "kto-vocab152k": ("tiny152k", "kto", {"max_length": 256}, 3, 1),
    # Qwen2.5-0.5B's shape on CPU, fp32: smaller batches so a step takes seconds, not minutes
    "grpo-qwen05cpu-32": ("qwen05", "grpo", {"completion_length": 32, "batch": 8}, 3, 1),
    "sft-qwen05cpu-unpacked": ("qwen05", "sft", {"packing": False, "batch": 4, "max_length": 256}, 3, 1),
}
# On a GPU (--gpu), in bf16: bigger batches and sequences, as a GPU run would use them.
GPU_ROWS = {
    "grpo-qwen05-256": ("qwen05", "grpo", {"completion_length": 256}, 6, 2),
    "grpo-qwen05-256-b64": ("qwen05", "grpo", {"completion_length": 256, "batch": 64}, 5, 2),
    "sft-qwen05-unpacked": ("qwen05", "sft", {"packing": False, "max_length": 1024}, 12, 3),
    "sft-qwen05-packed": ("qwen05", "sft", {"packing": True, "max_length": 1024}, 12, 3),
}
# Dense bf16 peak of the GPUs MFU is reported for (TFLOP/s, the vendor's figure without sparsity).
PEAK_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0, "L40S": 362.1}
SCALING = {
    "grpo-tiny-64-g16": ("tiny", "grpo", {"completion_length": 64, "num_generations": 16, "batch": 32}, 6, 1),
    "grpo-tiny-128": ("tiny", "grpo", {"completion_length": 128}, 6, 1),
    "sft-tiny-unpacked-512": ("tiny", "sft", {"packing": False, "max_length": 512}, 8, 2),
    "sft-tiny-unpacked-1024": ("tiny", "sft", {"packing": False, "max_length": 1024}, 6, 1),
}


def build_models(workdir: str, names=("tiny", "small")) -> dict[str, str]:
    sys.path.insert(0, REPO)
    from trainers.cli.tiny import build_bpe_tokenizer, save_tiny_model

    paths = {}
    for name in names:
        path = os.path.join(workdir, f"model-{name}")
        if not os.path.exists(os.path.join(path, "config.json")):
            save_tiny_model(path, tokenizer=build_bpe_tokenizer(), max_position_embeddings=4096, **MODELS[name])
        paths[name] = path
    return paths


def matmul_parameters(model_dir: str) -> int:
    """Weights used in matrix products per token: all of them, the embedding table counted once (tied to the
    output head, it is the head's weight; the lookup itself costs no FLOPs)."""
    from safetensors import safe_open

    total = 0
    with safe_open(os.path.join(model_dir, "model.safetensors"), "pt") as f:
        for key in f.keys():
            total += math.prod(f.get_slice(key).get_shape())
    return total


def peak_tflops(device: str, override: float | None) -> float | None:
    if override:
        return override
    return next((v for k, v in PEAK_TFLOPS.items() if k in device), None)


def run(framework: str, model: str, method: str, options: dict, steps: int, workdir: str) -> dict:
    out = tempfile.mkdtemp(dir=workdir)
    command = [sys.executable, RUNNER, framework, method, "--model", model, "--out", out, "--steps", str(steps)]
    for key, value in options.items():
        if key in ("packing", "bf16"):
            command += [f"--{key}"] if value else []
        else:
            command += [f"--{key}", str(value)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "WANDB_DISABLED": "true"}
    started = time.time()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    stdout, stderr = process.communicate()
    if process.returncode != 0:
        raise RuntimeError(f"{framework} {method} {options} failed:\n{stdout[-2000:]}\n{stderr[-4000:]}")
    line = next(l for l in stdout.splitlines() if l.startswith("RESULT "))
    result = json.loads(line[len("RESULT "):])
    result["wall"] = time.time() - started
    return result


def alternating(model: str, method: str, options: dict, steps: int, workdir: str, repeats: int) -> dict:
    """``repeats`` runs of each framework, alternating (TRL, ours, ours, TRL, ...) so drift on the machine hits
    both alike: {"ours": [run results], "trl": [...]}."""
    results = {"ours": [], "trl": []}
    for repeat in range(repeats):
        for framework in (("trl", "ours") if repeat % 2 == 0 else ("ours", "trl")):
            results[framework].append(run(framework, model, method, options, steps, workdir))
    return results


def summarize(name: str, method: str, results: dict, warmup: int, steps: int) -> dict:
    row = {"name": name}
    per_framework = {}
    for framework, runs in results.items():
        step_times = [statistics.median(r["step_times"][warmup:]) for r in runs]
        tokens_per_step = [r["num_tokens"] / steps for r in runs]
        per_framework[framework] = {
            "s_per_step": step_times,
            "tokens_per_s": [t / s for t, s in zip(tokens_per_step, step_times)],
            "peak_mb": [r["peak_mb"] for r in runs], "loss": [r["loss"] for r in runs],
            "peak_gpu_mb": [r.get("peak_gpu_mb") for r in runs], "device": runs[0].get("device", "cpu")}
    row.update(per_framework)
    ours, trl = per_framework["ours"], per_framework["trl"]
    if method in RL_METHODS:
        row["ratio"] = [o / t for o, t in zip(ours["s_per_step"], trl["s_per_step"])]  # time: lower is better
    else:
        row["ratio"] = [o / t for o, t in zip(ours["tokens_per_s"], trl["tokens_per_s"])]  # throughput
    row["memory_ratio"] = [o / t for o, t in zip(ours["peak_mb"], trl["peak_mb"])]
    if None not in ours["peak_gpu_mb"] + trl["peak_gpu_mb"]:
        row["gpu_memory_ratio"] = [o / t for o, t in zip(ours["peak_gpu_mb"], trl["peak_gpu_mb"])]
    return row


def fmt(values: list[float], digits: int = 2) -> str:
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{min(values):.{digits}f} / {statistics.median(values):.{digits}f} / {max(values):.{digits}f}"


def print_table(rows: list[dict], methods: dict, extras: dict | None = None) -> None:
    """One markdown row per benchmark row. With ``extras`` (GPU rows: row -> MFU or completion tokens/s text),
    also the device and that column, and peak GPU memory (PyTorch's allocated peak) instead of host RSS."""
    gpu = extras is not None
    memory, label = ("peak_gpu_mb", "peak GPU MB") if gpu else ("peak_mb", "peak MB")
    header = (["row"] + ["device"] * gpu + ["TRL", "ours", "ours/TRL (min / median / max)"] + ["TRL / ours"] * gpu
              + [f"TRL {label}", f"ours {label}", "memory ours/TRL", "loss TRL / ours"])
    print("\n| " + " | ".join(header) + " |")
    print("|---" * len(header) + "|")
    for row in rows:
        key = "s_per_step" if methods[row["name"]] in RL_METHODS else "tokens_per_s"
        unit, digits = ("s/step", 3) if key == "s_per_step" else ("tok/s", 0)
        trl, ours = row["trl"], row["ours"]
        cells = ([row["name"]] + [ours["device"]] * gpu
                 + [f"{statistics.median(trl[key]):.{digits}f} {unit}", f"{statistics.median(ours[key]):.{digits}f} {unit}",
                    fmt(row["ratio"])] + ([extras[row["name"]]] if gpu else [])
                 + [f"{statistics.median(trl[memory]):.0f}", f"{statistics.median(ours[memory]):.0f}",
                    fmt(row["gpu_memory_ratio" if gpu else "memory_ratio"]),
                    f"{statistics.median(trl['loss']):.3f} / {statistics.median(ours['loss']):.3f}"])
        print("| " + " | ".join(cells) + " |")


def gpu_extra(row: dict, method: str, options: dict, parameters: int, peak: float | None) -> str:
    """GRPO: completions x length per second of step. SFT: MFU = 6 x matmul parameters x trained tokens/s over
    the GPU's dense bf16 peak (attention FLOPs left out, so a lower bound)."""
    if method in RL_METHODS:
        generated = options.get("batch", 16) * options["completion_length"]  # forced to full length
        return " / ".join(f"{generated / statistics.median(row[f]['s_per_step']):.0f}" for f in ("trl", "ours")) + \
            " completion tok/s"
    if peak is None:
        return "MFU: GPU peak unknown (pass --peak-tflops)"
    return " / ".join(f"{100 * 6 * parameters * statistics.median(row[f]['tokens_per_s']) / (peak * 1e12):.1f}%"
                      for f in ("trl", "ours")) + " MFU"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", help=f"Rows to run: {sorted(ROWS) + sorted(SCALING) + sorted(GPU_ROWS)}")
    parser.add_argument("--scaling", action="store_true", help="Also run the scaling rows.")
    parser.add_argument("--gpu", action="store_true",
                        help=f"The GPU rows ({', '.join(GPU_ROWS)}), in bf16, with GPU memory, MFU and completion tokens/s.")
    parser.add_argument("--peak-tflops", type=float, help="The GPU's dense bf16 peak, for MFU (default: known GPUs).")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="Tiny-model rows, one repeat.")
    parser.add_argument("--bf16", action="store_true", help="Every row in bf16 mixed precision (both frameworks).")
    parser.add_argument("--extra", type=json.loads, default=None,
                        help='Config fields (JSON) for both frameworks in every row, e.g. \'{"entropy_coef": 0.01}\'.')
    parser.add_argument("--lora", type=int, default=0,
                        help="LoRA adapters of this rank on every linear layer, for both frameworks (0: full training).")
    parser.add_argument("--reward", choices=["len", "rare"], default="len",
                        help="GRPO reward for both: 'len' (completion length, the default) or 'rare' (1 for a "
                             "completion containing a rare syllable: ~40%% of groups have zero std).")
    parser.add_argument("--ours-extra", type=json.loads, default=None,
                        help="Config fields (JSON) for this project only, e.g. '{\"skip_zero_gradient_rows\": false}'.")
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "trainers-bench"))
    parser.add_argument("--json", help="Write every run's numbers here.")
    cli = parser.parse_args()
    os.makedirs(cli.workdir, exist_ok=True)
    catalogue = {**ROWS, **SCALING, **GPU_ROWS}
    if cli.gpu:
        import torch

        if not torch.cuda.is_available():
            parser.error("--gpu: no CUDA device is visible to PyTorch")
        cli.bf16 = True
    names = cli.only or (list(GPU_ROWS) if cli.gpu else list(ROWS) + (list(SCALING) if cli.scaling else []))
    unknown = [n for n in names if n not in catalogue]
    if unknown:
        parser.error(f"--only: unknown rows {unknown}; known: {sorted(catalogue)}")
    if cli.quick:
        names, cli.repeats = [n for n in names if "tiny" in n], 1  # not the real-vocabulary rows
    models = build_models(cli.workdir, sorted({catalogue[n][0] for n in names}))
    rows, methods, extras = [], {}, {}
    for name in names:
        model, method, options, steps, warmup = catalogue[name]
        options = {**options, "bf16": cli.bf16, **({"extra": json.dumps(cli.extra)} if cli.extra else {})}
        if cli.lora:
            options["lora"] = cli.lora
        if method in REWARDED:
            options["reward"] = cli.reward
        if method in RL_METHODS and cli.ours_extra:
            options["ours_extra"] = json.dumps(cli.ours_extra)
        name = (name + ("-bf16" if cli.bf16 and not cli.gpu else "") + (f"-lora{cli.lora}" if cli.lora else "")
                + ("-rare" if method in REWARDED and cli.reward == "rare" else ""))
        methods[name] = method
        results = alternating(models[model], method, options, steps, cli.workdir, cli.repeats)
        rows.append(summarize(name, method, results, warmup, steps))
        if cli.gpu:
            peak = peak_tflops(rows[-1]["ours"]["device"], cli.peak_tflops)
            extras[name] = gpu_extra(rows[-1], method, options, matmul_parameters(models[model]), peak)
        print_table(rows[-1:], methods, extras if cli.gpu else None)
        if method in REWARDED:
            print("frac_reward_zero_std (mean over steps, per repeat): " + ", ".join(
                f"{framework} {[round(r['frac_reward_zero_std'], 2) for r in results[framework]]}"
                for framework in ("trl", "ours")))
        sys.stdout.flush()
    print("\nAll rows:")
    print_table(rows, methods, extras if cli.gpu else None)
    if cli.json:
        with open(cli.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
