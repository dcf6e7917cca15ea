"""Config dataclasses <-> command-line flags: ``--field value`` for every field, help from its docstring."""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

import yaml


def parse_value(text: str, type_hint: str) -> Any:
    """Turn a command-line string into the value a field of type ``type_hint`` (a string annotation) wants."""
    hint = str(type_hint)
    if text in ("None", "null") and "None" in hint:
        return None
    if hint.startswith("bool"):
        lowered = text.lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")
    if hint.startswith("int"):
        return int(text)
    if hint.startswith("float"):
        return float(text)
    if hint.startswith(("dict", "list")) or (text[:1] in "[{" and ("list" in hint or "dict" in hint)):
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return yaml.safe_load(text)
    return text


def add_config_arguments(parser: argparse.ArgumentParser, config_class) -> None:
    """One ``--name`` flag per field of ``config_class``; its help is the field's docstring and default."""
    group = parser.add_argument_group(f"{config_class.__name__} options")
    for f in dataclasses.fields(config_class):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        help_text = f"{f.metadata.get('help', '')} (default: {default!r})".replace("%", "%%")
        group.add_argument(f"--{f.name}", dest=f"cfg_{f.name}", default=dataclasses.MISSING, metavar=str(f.type),
                           type=lambda text, hint=f.type: parse_value(text, hint), help=help_text)


def config_overrides(namespace: argparse.Namespace) -> dict:
    """The config fields given on the command line (not the ones left at their defaults)."""
    return {k[len("cfg_"):]: v for k, v in vars(namespace).items()
            if k.startswith("cfg_") and v is not dataclasses.MISSING}
