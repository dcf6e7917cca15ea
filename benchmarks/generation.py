"""Generation alone: the lean engine against HF ``generate`` (and the engine without oneDNN packed weights, and
with each projection packed on its own instead of q/k/v and gate/up stacked), on the benchmark models, for one
GRPO round (2 prompts x 8 completions of 64 tokens, forced to full length).

    python benchmarks/generation.py [--tokens 64] [--repeats 3] [--bf16] [--models tiny small]
    python benchmarks/generation.py --models qwen05 --bf16 --tokens 256   # on a GPU

On a GPU (used when PyTorch sees one) the packed-weights columns are left out: packing is a CPU layout.
``--compile`` adds the lean engine with its elementwise work (RMSNorm, RoPE, SiLU x up) compiled by
``torch.compile``; its first call, which compiles, is the untimed warm-up.
"""

import argparse
import inspect
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.compare_trl import MODELS, build_models  # noqa: E402
from trainers.generation import engine  # noqa: E402
from trainers.generation.sampling import SamplingParams, generate  # noqa: E402


def timed(functions: dict, repeats: int) -> dict:
    """Median seconds of each function, run in turns (one call of each per repeat, after one warm-up call
    each): on a noisy host, variants measured back to back drift apart more than the effects measured."""
    times = {name: [] for name in functions}
    for repeat in range(repeats + 1):
        for name, function in functions.items():
            started = time.perf_counter()
            function()
            if repeat:
                times[name].append(time.perf_counter() - started)
    return {name: statistics.median(values) for name, values in times.items()}


def patched(owner, name: str, value, function):
    """``function`` run with ``owner.name`` replaced by ``value`` (restored after each call)."""
    def run():
        original = inspect.getattr_static(owner, name)  # a staticmethod stays one when restored
        setattr(owner, name, value)
        try:
            function()
        finally:
            setattr(owner, name, original)
    return run


def pack_one_by_one(run, batch: int) -> None:
    """``engine.Decoder.pack_weights`` before projections sharing an input were stacked: one product each."""
    if not engine._can_pack(run.decoder.embed_tokens.weight.device, run.dtype):
        return
    run._pack([run.lm.lm_head], batch)
    for layer in run.layers:
        for module in (m for group in engine.projection_groups(layer) for m in group):
            run._pack([module], batch)


def with_compiled_elementwise(function):
    """``function`` run with the lean engine's RMSNorm, RoPE and SiLU x up replaced by ``torch.compile``d functions
    (dynamic shapes: the batch shrinks and the cache grows during a round). Only the elementwise work: inductor
    lowers oneDNN-packed products only for weights frozen into the graph as constants, which weights trained
    between rounds are not, and without packing a round is 1.6-1.75x slower on CPU (that column). The
    compiled functions take tensors, not modules, so one compilation serves every layer. Assumes SiLU gating
    (every benchmark model)."""
    silu_mul = torch.compile(lambda gate, up: F.silu(gate) * up, dynamic=True)

    def compiled_mlp(self, mlp, x):  # engine.Decoder.mlp with mlp.act_fn taken as SiLU
        gate, up = self.linears([mlp.gate_proj, mlp.up_proj], x)
        return self.linear(mlp.down_proj, silu_mul(gate, up))

    function = patched(engine, "rms_norm", torch.compile(engine.rms_norm, dynamic=True), function)
    function = patched(engine.Decoder, "_rope", staticmethod(torch.compile(engine.Decoder._rope, dynamic=True)),
                       function)
    return patched(engine.Decoder, "mlp", compiled_mlp, function)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bf16", action="store_true", help="Under bf16 autocast, as bf16 mixed precision samples.")
    parser.add_argument("--models", nargs="+", default=["tiny", "small"], choices=sorted(MODELS))
    parser.add_argument("--compile", action="store_true",
                        help="Also time the lean engine with its elementwise work compiled by torch.compile.")
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "trainers-bench"))
    cli = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    os.makedirs(cli.workdir, exist_ok=True)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    compiled_column = " lean, elementwise compiled s |" if cli.compile else ""
    print("| model | device | HF generate s | lean s | lean without packed weights s | lean, one product per "
          f"projection s |{compiled_column} HF / lean | lean completion tok/s |")
    print("|---|---|---|---|---|---|---|---|" + ("---|" if cli.compile else ""))
    for name, path in build_models(cli.workdir, cli.models).items():
        model = AutoModelForCausalLM.from_pretrained(path).to(device).eval()
        tokenizer = AutoTokenizer.from_pretrained(path)
        prompts = [tokenizer("alpha beta gamma delta the model learns")["input_ids"]] * 8 + \
                  [tokenizer("a cat sat on the mat")["input_ids"]] * 8
        params = SamplingParams(max_new_tokens=cli.tokens, extra={"min_new_tokens": cli.tokens})
        eos = {tokenizer.eos_token_id}

        def run(kind):
            torch.manual_seed(0)
            with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16, enabled=cli.bf16):
                generate(model, prompts, params, tokenizer.pad_token_id, eos, engine=kind)

        variants = {"hf": lambda: run("hf"), "lean": lambda: run("lean")}
        if device == "cpu":
            variants |= {"unpacked": patched(engine, "_can_pack", lambda *a: False, lambda: run("lean")),
                         "one_by_one": patched(engine.Decoder, "pack_weights", pack_one_by_one, lambda: run("lean"))}
        if cli.compile:
            variants["compiled"] = with_compiled_elementwise(lambda: run("lean"))
        seconds = timed(variants, cli.repeats)
        hf, lean = seconds["hf"], seconds["lean"]
        unpacked, one_by_one = (f"{seconds[k]:.2f}" if k in seconds else "-" for k in ("unpacked", "one_by_one"))
        compiled = f" {seconds['compiled']:.2f} |" if cli.compile else ""
        where = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
        print(f"| {name} ({MODELS[name]['hidden_size']} x {MODELS[name]['num_layers']}) | {where} | {hf:.2f} | "
              f"{lean:.2f} | {unpacked} | {one_by_one} |{compiled} {hf / lean:.1f}x | "
              f"{len(prompts) * cli.tokens / lean:.0f} |", flush=True)


if __name__ == "__main__":
    main()
