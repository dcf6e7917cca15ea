"""The shipped Accelerate templates: the one place that knows where they are.

They are package data, ``trainers/templates/*.yaml``, so a pip-installed ``trainers`` carries them. In a source
checkout the top-level ``accelerate_configs/`` is a symlink to that folder, so the documented
``accelerate launch --config_file accelerate_configs/zero3.yaml ...`` works there, and the planner's printed
commands keep naming ``accelerate_configs/<name>.yaml``.

``trainers grpo|sft --accelerate_config``, ``trainers env --accelerate_config`` and ``trainers plan`` all find
templates through :func:`resolve_template` and :func:`shipped_templates`. Finding none is an error naming the
folder looked in, never an empty result.
"""

from __future__ import annotations

import os
from pathlib import Path

from trainers.errors import ConfigError

CHECKOUT_FOLDER = "accelerate_configs"  # the name shipped templates have in a checkout and in printed commands


class TemplatesNotFoundError(ConfigError):
    """A folder that should hold Accelerate templates (``*.yaml``) holds none, or does not exist."""


def templates_dir() -> Path:
    """The folder of the shipped templates: ``trainers/templates/`` inside the installed package."""
    return Path(__file__).resolve().parent.parent / "templates"


def shipped_templates(directory: str | os.PathLike | None = None) -> dict[str, Path]:
    """Template name (the file's stem) -> path, for every ``*.yaml`` in ``directory`` (default: the shipped
    ones), sorted by name. No template there raises TemplatesNotFoundError naming the folder."""
    folder = Path(directory) if directory is not None else templates_dir()
    found = {path.stem: path for path in sorted(folder.glob("*.yaml")) if path.is_file()} if folder.is_dir() else {}
    if not found:
        what = "the shipped templates' folder" if directory is None else "the templates folder"
        state = "has no *.yaml file" if folder.is_dir() else "does not exist"
        hint = (" The installed trainers package lacks its package data (trainers/templates/*.yaml); reinstall it."
                if directory is None else "")
        raise TemplatesNotFoundError(f"No Accelerate templates found: {what} {str(folder)!r} {state}.{hint}")
    return found


def resolve_template(name_or_path: str, directory: str | os.PathLike | None = None) -> str:
    """``zero3`` / ``zero3.yaml`` -> the shipped template's path; an existing file -> its absolute path."""
    if os.path.isfile(name_or_path):
        return os.path.abspath(name_or_path)
    stem = name_or_path.removesuffix(".yaml")
    shipped = shipped_templates(directory)
    if stem in shipped:
        return str(shipped[stem])
    raise ConfigError(f"--accelerate_config {name_or_path!r} is neither a file nor a shipped template; "
                      f"shipped: {sorted(shipped)}.")


def is_shipped(path: str | os.PathLike) -> bool:
    """Whether ``path`` is one of the shipped templates (through the checkout's symlink or not)."""
    return Path(path).resolve().parent == templates_dir().resolve()


def checkout_path(name: str) -> str:
    """How printed commands name a shipped template: ``accelerate_configs/<name>.yaml``."""
    return f"{CHECKOUT_FOLDER}/{name}.yaml"
