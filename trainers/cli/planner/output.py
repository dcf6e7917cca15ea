"""``trainers plan``'s output (a table or JSON) and its flags."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from trainers.errors import ConfigError
from trainers.cli.planner.memory import load_templates
from trainers.cli.planner.plan import Plan, make_plan
from trainers.cli.planner.shapes import GB, METHODS, SAMPLING, PlanInputs, shape_from_size, validate

# ----------------------------------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------------------------------


def describe(plan: Plan) -> str:
    i, s = plan.inputs, plan.shape
    what = (f"{i.method.upper()}, {s.name} ({s.num_parameters() / 1e9:.2f}B parameters), "
            + (f"LoRA rank {i.lora_r}" if i.lora else "full fine-tuning"))
    unit = "processes (CPU)" if i.on_cpu else f"x {i.gpu_memory:g} GB GPUs"
    lengths = (f"prompt {i.max_prompt_length} + completion {i.max_completion_length} tokens, "
               f"{i.num_generations} generations, beta {i.beta:g}" if i.method in SAMPLING
               else f"max_length {i.max_length}")
    if i.method == "distill":
        lengths = (f"prompt {i.max_prompt_length} + completion {i.max_completion_length} tokens, teacher "
                   f"{i.teacher or i.teacher_size or 'of the model' + chr(39) + 's shape'}")
    return (f"{what}; {i.num_gpus} {unit}; {'bf16' if i.uses_bf16 else 'fp32'}; per-device batch "
            f"{i.per_device_batch}; {lengths}; gradient checkpointing {'on' if i.gradient_checkpointing else 'off'}")


def format_table(plan: Plan) -> str:
    """A text table (template, GB per GPU, fits, headroom), the recommendation with its commands, and, when
    nothing fits, what would."""
    per = "GB per process" if plan.inputs.on_cpu else "GB per GPU"
    rows = [("template", "strategy", "processes", per, "fits", "headroom GB", "peak during")]
    for e in plan.estimates:
        fits = "yes" if e.fits else ("n/a" if not e.applicable else "no")
        rows.append((e.template, e.strategy, str(e.num_processes), f"{e.total_gb:.2f}", fits, f"{e.headroom_gb:.2f}",
                     e.phase + (f" ({e.note})" if e.note else "")))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = [describe(plan), ""]
    for index, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(w) if c in (0, 1, 4, 6) else cell.rjust(w)
                               for c, (cell, w) in enumerate(zip(row, widths))).rstrip())
        if index == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines.append("")
    if plan.recommended:
        e = plan.estimate_for(plan.recommended)
        lines.append(f"Recommended: {e.template} ({e.total_gb:.2f} {per}, {e.headroom_gb:.2f} GB headroom of "
                     f"{plan.inputs.gpu_memory:g}). At its peak ({e.phase}):")
        for name, value in sorted(e.breakdown.items(), key=lambda kv: -kv[1]):
            lines.append(f"  {name:<26} {value / GB:8.2f} GB")
        if e.host_bytes:
            lines.append(f"  offloaded to CPU RAM: {e.host_bytes / GB:.2f} GB per process, "
                         f"{e.host_bytes * e.num_processes / GB:.1f} GB per node")
        lines.append("Launch:")
        lines += [f"  {command}" for command in plan.commands]
    else:
        lines.append(f"Nothing fits in {plan.inputs.gpu_memory:g} GB. Recomputed with each memory saver:")
        for s in plan.suggestions:
            verdict = "fits        " if s.fits else "does not fit"
            host = f" (+{s.host_gb:.1f} GB CPU RAM per process)" if s.host_gb else ""
            lines.append(f"  {verdict} {s.total_gb:9.2f} GB  {s.template or '-':<14} {s.change}{host}")
    lines += [f"Note: {note}" for note in plan.notes]
    return "\n".join(lines)


def plan_to_json(plan: Plan) -> dict:
    """The plan as JSON-ready data: ``recommended`` (a template name or None), per-template breakdowns in bytes,
    totals in GB, the commands and the suggestions."""
    return {
        "inputs": {**dataclasses.asdict(plan.inputs), "bf16": plan.inputs.uses_bf16},
        "model": {**dataclasses.asdict(plan.shape), "num_parameters": plan.shape.num_parameters()},
        "recommended": plan.recommended,
        "templates": [
            {"template": e.template, "strategy": e.strategy, "num_processes": e.num_processes,
             "total_gb": round(e.total_gb, 3), "fits": e.fits, "headroom_gb": round(e.headroom_gb, 3),
             "applicable": e.applicable, "note": e.note, "peak_phase": e.phase,
             "phases_gb": {k: round(v / GB, 3) for k, v in e.phases.items()},
             "host_gb": round(e.host_bytes / GB, 3), "breakdown": dict(e.breakdown)}
            for e in plan.estimates
        ],
        "commands": list(plan.commands),
        "suggestions": [dataclasses.asdict(s) for s in plan.suggestions],
        "notes": list(plan.notes),
    }


# ----------------------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------------------


def _help(name: str) -> str:
    f = next(f for f in dataclasses.fields(PlanInputs) if f.name == name)
    return f"{f.metadata['help']} (default: {f.default})".replace("%", "%%")


def _model_size(text: str) -> str:
    try:
        shape_from_size(text)
    except ConfigError as error:
        raise argparse.ArgumentTypeError(str(error).replace(f"--model-size {text!r} is", f"{text!r} is")) from None
    return text.strip().upper()


def _model_path(text: str) -> str:
    if not os.path.isfile(os.path.join(text, "config.json")):
        raise argparse.ArgumentTypeError(f"{text!r} is not a model folder with a config.json")
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``trainers plan`` flags."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", metavar="PATH", type=_model_path, help=_help("model"))
    source.add_argument("--model-size", type=_model_size, metavar="SIZE", help=_help("model_size"))
    parser.add_argument("--method", choices=list(METHODS), default="grpo", help=_help("method"))
    parser.add_argument("--teacher", metavar="PATH", type=_model_path, default=None, help=_help("teacher"))
    parser.add_argument("--teacher-size", type=_model_size, metavar="SIZE", default=None, help=_help("teacher_size"))
    parser.add_argument("--lora", action="store_true", help=_help("lora"))
    parser.add_argument("--lora-r", type=int, default=16, help=_help("lora_r"))
    parser.add_argument("--num-gpus", type=int, default=1, help=_help("num_gpus"))
    parser.add_argument("--gpu-memory", type=float, default=80.0, metavar="GB", help=_help("gpu_memory"))
    parser.add_argument("--per-device-batch", type=int, default=8, help=_help("per_device_batch"))
    parser.add_argument("--num-generations", type=int, default=8, help=_help("num_generations"))
    parser.add_argument("--max-completion-length", type=int, default=512, help=_help("max_completion_length"))
    parser.add_argument("--max-prompt-length", type=int, default=512, help=_help("max_prompt_length"))
    parser.add_argument("--max-length", type=int, default=1024, help=_help("max_length"))
    parser.add_argument("--token-budget", type=int, default=None, help=_help("token_budget"))
    parser.add_argument("--gradient-checkpointing", action="store_true", help=_help("gradient_checkpointing"))
    parser.add_argument("--beta", type=float, default=0.0, help=_help("beta"))
    precision = parser.add_mutually_exclusive_group()
    precision.add_argument("--bf16", dest="bf16", action="store_true", default=None,
                           help="bf16 mixed precision (default: on for GPUs, off with --device cpu).")
    precision.add_argument("--no-bf16", dest="bf16", action="store_false",
                           help="fp32 training (default: off for GPUs, on with --device cpu).")
    parser.add_argument("--json", action="store_true", help="Print the plan as JSON (default: a table).")
    parser.add_argument("--device", choices=["gpu", "cpu"], default="gpu", help=_help("device"))
    parser.add_argument("--templates-dir", metavar="DIR", default=None,
                        help="Plan for the Accelerate config files (*.yaml) in this folder instead (default: the "
                             "shipped templates, trainers/templates/; accelerate_configs/ in a checkout).")


def inputs_from_args(args: argparse.Namespace) -> PlanInputs:
    """PlanInputs from parsed ``trainers plan`` flags (validated: a bad value raises ConfigError naming its flag)."""
    names = {f.name for f in dataclasses.fields(PlanInputs)}
    inputs = PlanInputs(**{k: v for k, v in vars(args).items() if k in names})
    validate(inputs)
    return inputs


def run(args: argparse.Namespace) -> int:
    """``trainers plan``: print the table (or JSON). Returns 0; bad input raises ConfigError naming the flag."""
    inputs = inputs_from_args(args)
    directory = getattr(args, "templates_dir", None)
    plan = make_plan(inputs, load_templates(directory) if directory else None)
    print(json.dumps(plan_to_json(plan), indent=1) if args.json else format_table(plan))
    return 0


def main(argv: list[str] | None = None) -> int:
    from trainers.cli import planner

    parser = argparse.ArgumentParser(prog="trainers plan", description=planner.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except ConfigError as error:
        print(f"trainers plan: error: {error}", file=sys.stderr)
        return 2
