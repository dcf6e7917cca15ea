"""The configuration reference (docs/config-reference.md), generated from the config dataclasses.

Each class's docstring and each field's ``opt()`` declaration (its help text and its constraints, the ones
``TrainingConfig.__post_init__`` checks) are the single source; regenerate the page with

    python -m trainers.cli.config_reference > docs/config-reference.md

``tests/unit/test_config_reference.py`` fails when the committed page differs from ``render()``.
"""

from __future__ import annotations

import dataclasses
import inspect

from trainers.config.trl_options import TRL_ONLY_OPTIONS
from trainers.config.training import TrainingConfig
from trainers.distillation.config import DistillationConfig
from trainers.dpo.config import DPOConfig
from trainers.grpo.asynchronous import AsyncGRPOConfig
from trainers.grpo.config import GRPOConfig
from trainers.kto.config import KTOConfig
from trainers.config.options import describe_constraints
from trainers.reward.config import RewardConfig
from trainers.rloo.config import RLOOConfig
from trainers.sampling.config import PolicyGradientConfig, SamplingConfig
from trainers.sft.config import SFTConfig

REGENERATE = "python -m trainers.cli.config_reference > docs/config-reference.md"
# the sampling trainers' configs compose SamplingConfig (and PolicyGradientConfig): those parts have their own section
CONFIG_CLASSES = (TrainingConfig, SFTConfig, SamplingConfig, PolicyGradientConfig, GRPOConfig, AsyncGRPOConfig,
                  RLOOConfig, DistillationConfig, DPOConfig, RewardConfig, KTOConfig)
PARTS = (SamplingConfig, PolicyGradientConfig)  # not a trainer's config: what the sampling trainers' configs compose
_BASE = TrainingConfig


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell: pipes escaped, newlines flattened."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return dataclasses.MISSING


def _code(value: str) -> str:
    return f"`{value}`"


def _base_of(cls):
    """The config a class's table is relative to: the nearest config it extends that has a section (RLOOConfig's
    is PolicyGradientConfig), else TrainingConfig."""
    return next((base for base in cls.__mro__[1:] if base in CONFIG_CLASSES), _BASE)


def documented_fields(cls) -> list[dataclasses.Field]:
    """The fields ``cls`` documents: all of them for the base class; for a subclass, those it adds or
    overrides."""
    fields = dataclasses.fields(cls)
    if cls is _BASE:
        return list(fields)
    base = {f.name: f for f in dataclasses.fields(_base_of(cls))}
    out = []
    for f in fields:
        inherited = base.get(f.name)
        if (inherited is None or _default(f) != _default(inherited) or str(f.type) != str(inherited.type)
                or dict(f.metadata) != dict(inherited.metadata)):
            out.append(f)
    return out


def _table(fields: list[dataclasses.Field], overridden: dict[str, dataclasses.Field], base=_BASE) -> list[str]:
    lines = ["| Field | Type | Default | Valid values | Description |", "| --- | --- | --- | --- | --- |"]
    for f in fields:
        help_text = f.metadata.get("help", "")
        if f.name in overridden and _default(f) != _default(overridden[f.name]):
            default = _code(repr(_default(overridden[f.name])))
            help_text = f"{help_text} (Overrides {base.__name__}'s default {default}.)"
        lines.append(f"| {_cell(_code(f.name))} | {_cell(_code(str(f.type)))} | {_cell(_code(repr(_default(f))))} "
                     f"| {_cell(describe_constraints(f))} | {_cell(help_text)} |")
    return lines


def undocumented_fields(cls) -> list[str]:
    """Names of ``cls``'s fields without a help text (``opt(default, help)`` in trainers/config/training.py)."""
    return [f.name for f in dataclasses.fields(cls) if not str(f.metadata.get("help", "")).strip()]


def _anchor(title: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces as hyphens."""
    kept = "".join(c for c in title.lower() if c.isalnum() or c in " -_")
    return "#" + kept.replace(" ", "-")


def render() -> str:
    """The whole Markdown page."""
    lines = [
        "# Configuration reference",
        "",
        "Generated from the config dataclasses' docstrings and help texts (trainers/config/training.py,",
        "trainers/config/trl_options.py); do not edit it by hand. Regenerate it with",
        "",
        "```bash",
        REGENERATE,
        "```",
        "",
        "Every config rejects an option it does not know with a `ConfigError` that names it (and suggests close",
        "names); a TRL option this project does not implement is accepted only at TRL's default",
        f"([see below]({_anchor('TRL options accepted only at their default')})). The same fields are the",
        "`trainers sft` / `trainers grpo` command-line flags and YAML keys. A value outside a field's *Valid",
        "values* (declared beside its default) raises `ConfigError` when the config is built, and so do options",
        "that cannot work together (e.g. `packing` without a `max_length`).",
        "",
    ]
    for cls in CONFIG_CLASSES:
        lines += [f"## {cls.__name__}", "", inspect.cleandoc(cls.__doc__ or ""), ""]
        fields = documented_fields(cls)
        if cls is _BASE:
            lines += [f"`from trainers import {cls.__name__}`. Every field below is shared by "
                      + ", ".join(_code(c.__name__) for c in CONFIG_CLASSES if c is not _BASE) + ".", ""]
            lines += _table(fields, {}) + [""]
        else:
            base = _base_of(cls)
            where = (f"`from trainers.sampling.config import {cls.__name__}`: not a trainer's config, the part the "
                     f"sampling trainers' configs compose." if cls in PARTS else f"`from trainers import {cls.__name__}`.")
            lines += [(f"{where} It also takes every field of [{base.__name__}]({_anchor(base.__name__)}); the "
                       f"table lists only the fields it adds or whose default it overrides."), ""]
            base_fields_of = {f.name: f for f in dataclasses.fields(base)}
            overridden = {f.name: base_fields_of[f.name] for f in fields if f.name in base_fields_of}
            lines += _table(fields, overridden, base) + [""]

    lines += [
        "## TRL options accepted only at their default",
        "",
        "TRL 1.16's `SFTConfig`, `GRPOConfig` and `transformers.TrainingArguments` have these options and this",
        "project does not implement them. Passing one at the TRL default shown is accepted and changes nothing;",
        "any other value raises `ConfigError` when the config is built (or when it is set later). Each reads as",
        "its default, so a TRL script's `if training_args.push_to_hub:` works unchanged.",
        "",
        "| Option | Only accepted value |",
        "| --- | --- |",
    ]
    for name in sorted(TRL_ONLY_OPTIONS):
        # a TrainingArguments option one config implements is still refused by the others
        implemented = [c.__name__ for c in CONFIG_CLASSES if name in {f.name for f in dataclasses.fields(c)}]
        note = f" (`{'`, `'.join(implemented)}` implements it)" if implemented else ""
        lines.append(f"| {_cell(_code(name) + note)} | {_cell(_code(repr(TRL_ONLY_OPTIONS[name])))} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    print(render(), end="")


if __name__ == "__main__":
    main()
