"""The prepared GPU check (issue 48): one call on a lent GPU machine runs the package on CUDA and writes one report.

    bash benchmarks/gpu_check.sh                       # on the GPU machine (installs the carried wheels first)
    python benchmarks/gpu_check.py --dry-run --out D   # here, on CPU: the same parts, tiny, GPU-only ones skipped

Parts, each in its own process with its own time limit, so a failure or a hang in one does not stop the rest:

    runs       SFT and GRPO a few steps on a tiny model (bf16 on CUDA): finite losses, a save and an exact resume,
               the lean engine's greedy tokens against HF generate's, vLLM colocated in sleep mode if vLLM's CUDA
               build is there
    rows       benchmarks/compare_trl.py --gpu: a Qwen2.5-0.5B-shaped model, ours and TRL's on the same card
               (SFT tokens/s, MFU, peak memory; GRPO s/step, generated tokens/s, peak memory)
    head       the output head's weight gradient on the Qwen2.5-0.5B shape: bf16 products with float32 accumulation
               (what the head chooses on CUDA) against the float32 product it replaced, and the whole head's
               forward and backward as chosen
    templates  accelerate_configs/fsdp2.yaml and single_gpu.yaml, one process, a few SFT steps each
    profile    where a GRPO step's time goes: sampling, the weight sync, the rest (scoring, backward, optimizer)
    sync       seconds per weight sync into a vLLM server on the second GPU, NCCL against gloo (0.5B shape, bf16),
               and the part an in-flight push keeps the trainer (until the tensors have left); skipped without
               vLLM or a second GPU, saying which

Writes OUT/gpu_check.json, OUT/gpu_check.md (a table naming the card, for docs/benchmarks.md's "GPU") and
OUT/parts.log (each part's output), nothing else: the device tool brings back 8 files of 16 MiB at most, two folders
deep, so models, checkpoints and the rows' workdir go to --work (a temporary folder). Each part runs in a process
group of its own, killed whole past its limit. What can differ on CUDA without a bug (a resume's last bits under
SDPA's non-deterministic backward, a greedy near tie under bf16 attention) is reported with its numbers, not failed.

Within the 15 minutes of device time a task gets, two calls of at most 6 minutes each (start-up is extra):

    bash benchmarks/gpu_check.sh --parts runs head rows          # 5.5 min at most
    bash benchmarks/gpu_check.sh --parts templates profile sync  # 2.5 min, 5 with the sync part (vLLM, 2 GPUs)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARTS = ("runs", "head", "rows", "templates", "profile", "sync")
# seconds each: runs + head + rows 5.5 minutes, the others 4 (sync takes no time where it is skipped: no vLLM, one GPU)
LIMITS = {"runs": 90, "head": 30, "rows": 210, "templates": 60, "profile": 90, "sync": 150}


# ---------------------------------------------------------------------------------------------- the parts


def part_runs(device: str, work: str) -> dict:
    """Tiny SFT and GRPO on ``device``: finite losses, an exact resume, lean against HF greedy, vLLM colocated."""
    import torch

    from trainers import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer
    from trainers.cli.tiny import save_tiny_model
    from trainers.generation.sampling import SamplingParams, generate

    cuda = device == "cuda"
    model = save_tiny_model(os.path.join(work, "tiny"), hidden_size=128, num_layers=2)
    common = dict(logging_steps=1, disable_tqdm=True, seed=0, report_to="none", bf16=cuda, use_cpu=not cuda)
    details: dict = {}
    sft = SFTTrainer(model=model, train_dataset=[{"prompt": "12+3=", "completion": "15"}] * 32, args=SFTConfig(
        output_dir=os.path.join(work, "sft"), per_device_train_batch_size=8, max_steps=4, save_strategy="no",
        learning_rate=1e-3, **common))
    sft.train()
    details["sft_losses"] = [r["loss"] for r in sft.state.log_history if "loss" in r]
    details["sft_finite"] = all(math.isfinite(v) for v in details["sft_losses"])
    # CUDA only: each step record's peak of torch's allocator (issue 59, finding 11)
    details["sft_peak_allocated_gb"] = [r.get("memory/peak_allocated_gb") for r in sft.state.log_history if "loss" in r]

    def grpo(name, steps, **extra):
        args = GRPOConfig(output_dir=os.path.join(work, name), per_device_train_batch_size=8, num_generations=4,
                          max_completion_length=8, max_steps=steps, learning_rate=1e-3, save_strategy="steps",
                          save_steps=2, **common, **extra)
        return GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
                           args=args, train_dataset=[{"prompt": p} for p in ("abc", "hello", "xyz", "12")] * 4)

    straight = grpo("grpo", 4)
    straight.train()
    details["grpo_losses"] = [r["loss"] for r in straight.state.log_history if "loss" in r]
    resumed = grpo("grpo-resumed", 4)
    resumed.train(resume_from_checkpoint=os.path.join(work, "grpo", "checkpoint-2"))
    # on CUDA a resume can differ in the last bits without a bug (SDPA's backward is not deterministic there):
    # reported with its size, not a failure of the part
    gaps = [float((a.float() - b.float()).abs().max()) for a, b in zip(straight.model.parameters(),
                                                                        resumed.model.parameters(), strict=True)]
    details["resume_exact"] = max(gaps) == 0.0
    details["resume_max_abs_diff"] = max(gaps)
    policy, tokenizer = straight.unwrapped_model, straight.processing_class
    prompts = [tokenizer(p)["input_ids"] for p in ("abc", "hello there", "12+3=")]
    greedy = SamplingParams(max_new_tokens=16, do_sample=False)
    eos = {tokenizer.eos_token_id}
    with torch.autocast(device, dtype=torch.bfloat16, enabled=cuda):
        lean = generate(policy.eval(), prompts, greedy, tokenizer.pad_token_id, eos, engine="lean")
        hf = generate(policy, prompts, greedy, tokenizer.pad_token_id, eos, engine="hf")
    # bf16 attention in either engine can flip a near tie: reported as how many prompts agree and, where they do
    # not, the policy's gap between its two best logits at the first difference (a near tie is not a bug)
    details["lean_equals_hf_greedy"] = lean == hf
    details["lean_hf_equal_prompts"] = f"{sum(a == b for a, b in zip(lean, hf))}/{len(prompts)}"
    details["lean_hf_top2_gaps"] = []
    for prompt, ours, theirs in zip(prompts, lean, hf):
        at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        if at is not None:
            with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16, enabled=cuda):
                logits = policy(torch.tensor([prompt + ours[:at]], device=policy.device)).logits[0, -1].float()
            top = logits.topk(2).values
            details["lean_hf_top2_gaps"].append(float(top[0] - top[1]))
    try:
        import vllm

        details["vllm"] = vllm.__version__
    except Exception as error:  # not installed, or a CPU build on the GPU machine
        details["vllm"] = f"not importable: {type(error).__name__}: {str(error)[:200]}"
    if cuda and not details["vllm"].startswith("not importable"):
        # in sleep mode (level 2; issue 59): every step's sync wakes the weights, each round the KV cache too
        colocated = grpo("grpo-vllm", 3, use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.2,
                         vllm_enable_sleep_mode=True)
        colocated.train()
        details["vllm_colocate_sleep_mode_losses"] = [r["loss"] for r in colocated.state.log_history if "loss" in r]
    ok = details["sft_finite"] and all(map(math.isfinite, details["grpo_losses"])) and math.isfinite(
        details["resume_max_abs_diff"])
    return {"ok": ok, "details": details}


def part_rows(device: str, work: str) -> dict:
    """The rows that matter, ours and TRL's on this card (benchmarks/compare_trl.py --gpu)."""
    if device != "cuda":
        return {"skipped": "needs CUDA"}
    rows = os.path.join(work, "rows.json")
    command = [sys.executable, os.path.join(REPO, "benchmarks", "compare_trl.py"), "--gpu", "--repeats", "1",
               "--only", "sft-qwen05-unpacked", "grpo-qwen05-256", "--json", rows,
               "--workdir", os.path.join(work, "rows")]
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    table = [line for line in result.stdout.splitlines() if line.startswith("|")]
    return {"ok": result.returncode == 0, "details": {"table": table, "stderr_tail": result.stderr[-1500:]}}


def part_templates(device: str, work: str) -> dict:
    """fsdp2.yaml and single_gpu.yaml with one process: a few SFT steps each (FSDP engages only on GPUs)."""
    details = {}
    for template in ("single_gpu", "fsdp2"):
        if device != "cuda" and template == "fsdp2":
            details[template] = "skipped: FSDP through Accelerate engages only on GPUs"
            continue
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                   os.path.join(REPO, "accelerate_configs", f"{template}.yaml"), "--num_processes", "1",
                   os.path.join(REPO, "examples", "sft.py"), "--max_steps", "3", "--logging_steps", "1",
                   "--save_strategy", "no", "--report_to", "none", "--output_dir", os.path.join(work, template)]
        if device != "cuda":
            command[5:5] = ["--cpu"]  # after --num_processes 1: accelerate's own flag, before the script
        result = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
        details[template] = "ok" if result.returncode == 0 else f"failed ({result.returncode}): " \
                                                               f"{result.stderr[-800:]}"
    return {"ok": all(v == "ok" or v.startswith("skipped") for v in details.values()), "details": details}


def part_head(device: str, work: str) -> dict:
    """The output head's backward (issue 59, finding 6): one chunk's weight-gradient product, float32 (before) against
    bf16 with float32 accumulation (now, on CUDA), and a whole forward and backward of the chunked head as chosen.
    The Qwen2.5-0.5B shape (V 151,936, H 896) over 2,048 positions on CUDA; small on CPU."""
    import torch

    from trainers.model.output_head import (chunk_bytes_for, chunk_positions, chunked_head_scores,
                                      low_precision_weight_grad)

    cuda = device == "cuda"
    vocab, width, positions = (151936, 896, 2048) if cuda else (4096, 64, 256)
    dtype = torch.bfloat16 if cuda else torch.float32
    chunk = chunk_positions(vocab, chunk_bytes_for(device))

    def timed(fn, repeats=5) -> float:
        fn()  # warm-up
        if cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(repeats):
            fn()
        if cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - started) / repeats

    torch.manual_seed(0)
    grad = torch.randn(chunk, vocab, device=device)  # [c, V] float32: one chunk's logit gradient
    hidden = torch.randn(chunk, width, device=device, dtype=dtype)  # [c, H]
    out = torch.zeros(vocab, width, device=device)  # [V, H] float32
    details = {"chunk_positions": chunk, "low_precision_chosen": low_precision_weight_grad(device, dtype),
               "float32_product_s": timed(lambda: out.addmm_(grad.t(), hidden.float()))}
    if cuda:
        low = torch.zeros_like(out)
        details["bf16_product_s"] = timed(lambda: torch.addmm(low, grad.t().to(dtype), hidden, out_dtype=torch.float32,
                                                              out=low))
        once = torch.addmm(torch.zeros_like(out), grad.t().to(dtype), hidden, out_dtype=torch.float32)
        exact = grad.t().double() @ hidden.double()
        details["bf16_relative_error"] = float((once - exact).norm() / exact.norm())
    weight = (torch.randn(vocab, width, device=device) * 0.02).to(dtype).requires_grad_()
    states = torch.randn(positions, width, device=device, dtype=dtype, requires_grad=True)
    targets = torch.randint(vocab, (positions,), device=device)

    def head():
        weight.grad = states.grad = None
        chunked_head_scores(states, weight, targets, with_entropy=False)["logps"].sum().backward()

    details["head_forward_backward_s"] = timed(head, repeats=3)
    return {"ok": all(math.isfinite(v) for v in details.values() if isinstance(v, float)), "details": details}


def part_profile(device: str, work: str) -> dict:
    """Where a GRPO step's time goes: the backend's sampling and weight sync (timed around the backend), the
    rest (scoring, forward and backward, optimizer) from step_time. A 0.5B-shaped model on CUDA, tiny on CPU."""
    import torch

    from trainers import GRPOConfig, GRPOTrainer
    from trainers.cli.tiny import save_tiny_model
    from trainers.generation.backend import PolicyBackend, register_backend

    timed = {"sample": 0.0, "sync": 0.0}

    class Timed(PolicyBackend):
        def sample(self, prompts, prompt_ids, params):
            if device == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
            samples = super().sample(prompts, prompt_ids, params)
            if device == "cuda":
                torch.cuda.synchronize()
            timed["sample"] += time.perf_counter() - started
            return samples

    register_backend("timed_policy", Timed)
    shape = dict(hidden_size=896, num_layers=24, vocab_size=151936) if device == "cuda" else \
        dict(hidden_size=64, num_layers=2)
    model = save_tiny_model(os.path.join(work, "profile-model"), **shape)
    steps = 4 if device == "cuda" else 2
    args = GRPOConfig(output_dir=os.path.join(work, "profile"), per_device_train_batch_size=16, num_generations=8,
                      max_completion_length=128 if device == "cuda" else 8, max_steps=steps, logging_steps=1,
                      save_strategy="no", disable_tqdm=True, report_to="none", bf16=device == "cuda",
                      use_cpu=device != "cuda", generation_backend="timed_policy")
    records = []

    from transformers import TrainerCallback

    class Split(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "step_time" in logs:
                records.append({"step_s": logs["step_time"], "sample_s": timed["sample"]})
                timed["sample"] = 0.0

    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
                          args=args, train_dataset=[{"prompt": p} for p in ("abc", "hello", "xyz", "12")] * 8,
                          callbacks=[Split()])
    trainer.train()
    after_first = records[1:] or records
    step = sum(r["step_s"] for r in after_first) / len(after_first)
    sample = sum(r["sample_s"] for r in after_first) / len(after_first)
    return {"ok": True, "details": {"steps": records, "step_s": step, "sampling_s": sample,
                                    "rest_s": step - sample, "sampling_share": sample / step if step else None}}


def part_sync(device: str, work: str) -> dict:
    """Seconds per weight sync into a `trainers vllm-serve` server on the second GPU, by transport: vLLM's NCCL
    engine (GPU to GPU) and ours over gloo (through host memory), the same Qwen2.5-0.5B-shaped bf16 weights from
    the first GPU, median of 3 pushes each, and of each the seconds until its tensors had left (``*_sent_s``: where
    asynchronous GRPO's in-flight push returns to the trainer, the server loading meanwhile). Needs vLLM here and
    two GPUs (NCCL will not put two ranks on one)."""
    import importlib.util

    import torch

    if device != "cuda":
        return {"skipped": "needs CUDA"}
    missing = [why for why, lacking in (("vLLM is not installed", importlib.util.find_spec("vllm") is None),
                                        (f"{torch.cuda.device_count()} GPU (NCCL needs the trainer and the server on "
                                         f"a GPU each)", torch.cuda.device_count() < 2)) if lacking]
    if missing:
        return {"skipped": "; ".join(missing)}
    import statistics

    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    from trainers.cli.tiny import save_tiny_model
    from trainers.generation.local_server import free_port, start_local_server
    from trainers.generation.vllm_client import VLLMClient
    from trainers.generation.vllm_common import policy_weights

    model_dir = save_tiny_model(os.path.join(work, "sync-model"), hidden_size=896, num_layers=24, num_heads=14,
                                num_kv_heads=2, intermediate_size=4864, vocab_size=151936)
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to("cuda:0")
    accelerator, details = Accelerator(), {}
    for transport in ("nccl", "gloo"):
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        os.environ["CUDA_VISIBLE_DEVICES"] = "1"  # the server's GPU (this process keeps the devices it has)
        try:
            server = start_local_server(model_dir, os.path.join(work, f"sync-{transport}.log"), dtype="bfloat16",
                                        extra=("--weight_transfer", transport, "--gpu_memory_utilization", "0.3"),
                                        timeout=150)
        finally:
            os.environ.pop("CUDA_VISIBLE_DEVICES") if visible is None else os.environ.update(
                CUDA_VISIBLE_DEVICES=visible)
        try:
            client, seconds, sent = VLLMClient(server.url, group_port=free_port(), connection_timeout=60), [], []
            for _ in range(4):  # the first opens the group
                torch.cuda.synchronize()
                started = time.perf_counter()
                with client.weight_update():
                    for batch in policy_weights(accelerator, policy):
                        client.update_named_params(batch)
                    # the tensors have left: an in-flight push (asynchronous GRPO) returns to the trainer here
                    sent.append(time.perf_counter() - started)
                seconds.append(time.perf_counter() - started)
            client.close()
            details[f"{transport}_s"] = statistics.median(seconds[1:])
            details[f"{transport}_sent_s"] = statistics.median(sent[1:])
        finally:
            server.stop(grace=10)
    details["bytes"] = sum(t.numel() * t.element_size() for t in policy.state_dict().values())
    return {"ok": True, "details": details}


# ---------------------------------------------------------------------------------------------- the driver


def environment() -> dict:
    import importlib

    found = {}
    for name in ("torch", "transformers", "accelerate", "deepspeed", "peft", "trl", "vllm"):
        try:
            found[name] = getattr(importlib.import_module(name), "__version__", "?")
        except Exception as error:
            found[name] = f"missing ({type(error).__name__})"
    import torch

    found["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU (no CUDA)"
    return found


def run_part(name: str, device: str, work: str, limit: float) -> tuple[dict, str]:
    """One part in a process group of its own, within ``limit`` seconds (past it, the whole group is killed, so the
    next part has the GPU to itself): its report, or why there is none, and its output."""
    started = time.monotonic()
    path = os.path.join(work, f"part-{name}.json")
    command = [sys.executable, os.path.abspath(__file__), "--part", name, "--device", device, "--work", work]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                               start_new_session=True)
    try:
        output, _ = process.communicate(timeout=limit)
        if os.path.exists(path):
            with open(path) as f:
                report = json.load(f)
        else:
            report = {"ok": False, "error": f"exit {process.returncode}: {output[-1500:]}"}
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the part and everything it started (a server, launcher workers)
        output, _ = process.communicate()
        report = {"ok": False, "error": f"timed out after {limit:g} s"}
    report["seconds"] = round(time.monotonic() - started, 1)
    return report, output


def markdown(report: dict) -> str:
    lines = [f"GPU check on {report['environment']['device']} ({'dry run' if report['dry_run'] else 'CUDA'})", "",
             "| part | status | seconds | details |", "|---|---|---|---|"]
    for name, part in report["parts"].items():
        status = "skipped" if "skipped" in part else "ok" if part.get("ok") else "FAILED"
        detail = part.get("skipped") or part.get("error") or json.dumps(part.get("details", {}))[:400]
        lines.append(f"| {name} | {status} | {part.get('seconds', '')} | {detail.replace('|', '/')} |")
    versions = ", ".join(f"{k} {v}" for k, v in report["environment"].items() if k != "device")
    return "\n".join(lines + ["", f"Versions: {versions}", ""])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT") or os.path.join(tempfile.gettempdir(), "gpu-check"),
                        help="Where the report goes: gpu_check.md, gpu_check.json and parts.log, nothing else (the "
                             "device tool brings back 8 files at most).")
    parser.add_argument("--work", default=None, help="Models, checkpoints and the parts' own files (default: a new "
                                                     "temporary folder, outside --out).")
    parser.add_argument("--dry-run", action="store_true", help="On CPU: the parts tiny, the GPU-only ones skipped.")
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    parser.add_argument("--limit", type=float, default=None,
                        help="Seconds each part may take at most (default: each part's own, LIMITS).")
    parser.add_argument("--part", choices=PARTS, help=argparse.SUPPRESS)  # internal: run one part here
    parser.add_argument("--device", choices=("cuda", "cpu"), help=argparse.SUPPRESS)
    cli = parser.parse_args(argv)
    if cli.part:  # one part, in this process
        report = globals()[f"part_{cli.part}"](cli.device, cli.work)
        with open(os.path.join(cli.work, f"part-{cli.part}.json"), "w") as f:
            json.dump(report, f)
        return 0
    os.makedirs(cli.out, exist_ok=True)
    work = cli.work or tempfile.mkdtemp(prefix="gpu-check-work-")
    import torch

    if not cli.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA device here: run on the GPU machine, or pass --dry-run")
    device = "cpu" if cli.dry_run else "cuda"
    report = {"dry_run": cli.dry_run, "environment": environment(), "parts": {}}
    with open(os.path.join(cli.out, "parts.log"), "w") as log:
        for name in cli.parts:
            limit = LIMITS[name] if cli.limit is None else min(cli.limit, LIMITS[name])
            report["parts"][name], output = run_part(name, device, work, limit)
            log.write(f"===== {name} =====\n{output}\n")
            print(f"{name}: {report['parts'][name]}", flush=True)
    with open(os.path.join(cli.out, "gpu_check.json"), "w") as f:
        json.dump(report, f, indent=1)
    with open(os.path.join(cli.out, "gpu_check.md"), "w") as f:
        f.write(markdown(report))
    print(markdown(report))
    return 0 if all(p.get("ok") or "skipped" in p for p in report["parts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
