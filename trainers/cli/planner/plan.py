"""The plan: every template's estimate, the cheapest that fits, its launch commands, and, when nothing fits,
what each memory saver would give."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from trainers.cli.planner.memory import Template, TemplateEstimate, estimate, load_templates
from trainers.cli.planner.shapes import GB, SAMPLING, ModelShape, PlanInputs, resolve_shape
from trainers.cli.templates import TemplatesNotFoundError, checkout_path, is_shipped

# ----------------------------------------------------------------------------------------------------------------
# The plan: every template, the recommendation, and what would fit when nothing does
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class Suggestion:
    """One change recomputed: its best template (the cheapest that fits, else the smallest) and its GB."""

    change: str
    template: str | None
    total_gb: float
    fits: bool
    host_gb: float = 0.0  # what offload keeps in CPU RAM per process


@dataclass
class Plan:
    """Estimates for every template, the recommended one (None when nothing fits), its launch commands, and,
    when nothing fits, what each memory saver would give."""

    inputs: PlanInputs
    shape: ModelShape
    estimates: list[TemplateEstimate]
    recommended: str | None
    commands: list[str] = field(default_factory=list)
    suggestions: list[Suggestion] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def estimate_for(self, template: str) -> TemplateEstimate:
        return next(e for e in self.estimates if e.template == template)


def cheapest_fit(estimates: list[TemplateEstimate]) -> TemplateEstimate | None:
    fitting = [e for e in estimates if e.fits]
    return min(fitting, key=lambda e: (e.cost_rank, e.total_bytes)) if fitting else None


def estimate_all(shape: ModelShape, inputs: PlanInputs, templates: list[Template]) -> list[TemplateEstimate]:
    return [estimate(shape, inputs, t) for t in templates]


def best_of(shape: ModelShape, inputs: PlanInputs, templates: list[Template],
            only: set[str] | None = None) -> TemplateEstimate | None:
    """The cheapest fitting estimate, else the smallest applicable one (restricted to strategy kinds ``only``)."""
    estimates = [e for e in estimate_all(shape, inputs, templates) if e.applicable]
    if only is not None:
        estimates = [e for e in estimates if e.strategy in only]
    if not estimates:
        return None
    return cheapest_fit(estimates) or min(estimates, key=lambda e: e.total_bytes)


def suggestions(shape: ModelShape, inputs: PlanInputs, templates: list[Template]) -> list[Suggestion]:
    """Recompute with each memory saver not already in use, then with all of them together."""
    changes: list[tuple[str, dict, set[str] | None]] = []
    if not inputs.lora:
        changes.append((f"LoRA (rank {inputs.lora_r})", {"lora": True}, None))
    if not inputs.gradient_checkpointing:
        changes.append(("gradient checkpointing", {"gradient_checkpointing": True}, None))
    batch = inputs.per_device_batch // 2
    while batch >= 1:
        changes.append((f"per-device batch {batch}", {"per_device_batch": batch}, None))
        batch //= 2
    offload = {t.strategy.label for t in templates if t.strategy.offload_optimizer or t.strategy.offload_params}
    if offload:
        changes.append(("offload (" + ", ".join(sorted(offload)) + ")", {}, offload))
    everything = {"lora": True, "gradient_checkpointing": True, "per_device_batch": 1}
    together = "LoRA + gradient checkpointing + per-device batch 1"
    if inputs.method in SAMPLING and inputs.ds3_gather_for_generation:
        changes.append(("ds3_gather_for_generation=False (ZeRO-3 generates layer by layer: slow)",
                        {"ds3_gather_for_generation": False}, None))
        everything["ds3_gather_for_generation"] = False
        together += " + ds3_gather_for_generation=False"
    changes.append((f"all of {together}", everything, None))
    out = []
    for change, fields, only in changes:
        best = best_of(shape, dataclasses.replace(inputs, **fields), templates, only)
        if best is not None:
            out.append(Suggestion(change, best.template, round(best.total_gb, 2), best.fits,
                                  round(best.host_bytes / GB, 2)))
    return out


def trainer_flags(inputs: PlanInputs) -> list[str]:
    """The config flags that reproduce the planned set-up (same names for examples/*.py and `trainers`)."""
    flags = ["--per_device_train_batch_size", str(inputs.per_device_batch)]
    if inputs.method == "distill":  # one completion per prompt; beta is the divergence, not a reference's KL
        flags += ["--max_completion_length", str(inputs.max_completion_length),
                  "--teacher_model_name_or_path", inputs.teacher or "TEACHER"]
    elif inputs.method in SAMPLING:
        flags += ["--num_generations", str(inputs.num_generations),
                  "--max_completion_length", str(inputs.max_completion_length)]
        if inputs.beta:
            flags += ["--beta", str(inputs.beta)]
    if inputs.method in SAMPLING:
        if not inputs.ds3_gather_for_generation:
            flags += ["--ds3_gather_for_generation", "false"]
        if inputs.token_budget is not None:
            flags += ["--padding_free", "true", "--token_budget", str(inputs.token_budget)]
    else:
        flags += ["--max_length", str(inputs.max_length)]
    if inputs.gradient_checkpointing:
        flags += ["--gradient_checkpointing", "true"]
    flags += ["--bf16", "true" if inputs.uses_bf16 else "false"]
    if inputs.on_cpu:
        flags += ["--use_cpu", "true"]
    if inputs.lora:
        flags += ["--lora_r", str(inputs.lora_r)]
    return flags


def launch_commands(inputs: PlanInputs, template: Template, num_processes: int) -> list[str]:
    """``accelerate launch`` of the example script, and the same run through ``trainers``."""
    shipped = is_shipped(template.path)
    config = checkout_path(template.name) if shipped else template.path
    processes = [] if template.strategy.kind == "single" else ["--num_processes", str(num_processes)]
    model = inputs.model or "PATH"
    flags = trainer_flags(inputs)
    example = "distillation" if inputs.method == "distill" else inputs.method  # examples/<example>.py and .yaml
    accelerate = ["accelerate", "launch", "--config_file", config, *processes, f"examples/{example}.py",
                  "--model", model, *flags]
    trainers = ["trainers", inputs.method, "--config", f"{example}.yaml", "--model", model,
                "--accelerate_config", template.name if shipped else template.path, *processes, *flags]
    return [" ".join(accelerate), " ".join(trainers)]


def plan_notes(inputs: PlanInputs) -> list[str]:
    notes = []
    if inputs.method in ("grpo", "rloo"):
        generation_batch = inputs.per_device_batch * inputs.num_gpus * inputs.steps_per_generation
        if generation_batch % inputs.num_generations:
            notes.append(f"per_device_batch x num_gpus x steps_per_generation = {generation_batch} is not a multiple "
                         f"of num_generations = {inputs.num_generations}: the GRPO trainer will refuse it.")
    if inputs.on_cpu:
        notes.append("--device cpu: peak RSS per process of a CPU run (gloo), including the process baseline.")
    return notes


def make_plan(inputs: PlanInputs, templates: list[Template] | None = None) -> Plan:
    """Estimate every template for ``inputs`` and pick the cheapest that fits."""
    shape = resolve_shape(inputs)
    templates = templates if templates is not None else load_templates()
    if not templates:  # never "Nothing fits" for want of templates
        raise TemplatesNotFoundError("make_plan was given no Accelerate templates to plan for.")
    estimates = sorted(estimate_all(shape, inputs, templates), key=lambda e: (e.cost_rank, e.template))
    best = cheapest_fit(estimates)
    result = Plan(inputs, shape, estimates, best.template if best else None, notes=plan_notes(inputs))
    if best:
        template = next(t for t in templates if t.name == best.template)
        result.commands = launch_commands(inputs, template, best.num_processes)
    else:
        result.suggestions = suggestions(shape, inputs, templates)
    return result
