"""Config fields with declared constraints, and their one check: the machinery every config dataclass is built with.

A field is declared with ``opt(default, help, <constraints>)``: the help text (``metadata["help"]``) feeds the CLI's
``--help`` and ``docs/config-reference.md``; the constraints (allowed values, bounds) are checked for every field at
construction (``check_constraints``, after ``check_types``) and shown in the reference (``describe_constraints``).
``reject_unknown_options`` gives an unknown option a clear error, and accepts a TRL option this project does not
implement only at TRL's default. ``check_field`` states a rule that relates several fields. The configs themselves
(TrainingConfig in trainers/config/training.py, SFTConfig, GRPOConfig) hold only their fields and those rules.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
from dataclasses import field
from typing import Any

from trainers.config.trl_options import TRL_ONLY_OPTIONS
from trainers.errors import ConfigError


def opt(default: Any, help: str, *, choices: tuple | None = None, ge: float | None = None, gt: float | None = None,
        le: float | None = None, lt: float | None = None, finite: bool = False, note: str | None = None) -> Any:
    """A config field: its default, its help text and its constraints (a mutable default is copied per instance).

    The constraints are declared here once: ``check_constraints`` enforces them when a config is built and
    docs/config-reference.md shows them (``describe_constraints``). ``choices``: the allowed values (for a list
    field, of each item); ``ge``, ``gt``, ``le``, ``lt``: bounds (>=, >, <=, <); ``finite``: no inf or nan. With
    both choices and bounds, either is valid (max_steps: >= 1, or -1). None passes wherever the field's type
    allows it. ``note``, a few words on why, follows the constraint in errors and in the reference.
    """
    declared = {"choices": None if choices is None else tuple(choices), "ge": ge, "gt": gt, "le": le, "lt": lt,
                "finite": finite or None, "note": note}
    metadata = {"help": help, **{k: v for k, v in declared.items() if v is not None}}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)


_BOUNDS = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<"}


def describe_constraints(f: dataclasses.Field) -> str:
    """A field's declared constraints in words ("one of: 'a', 'b'", "in [0, 1)", "≥ 1, or None"); "" if none."""
    m = f.metadata
    low, high = [next((k for k in pair if k in m), None) for pair in (("ge", "gt"), ("le", "lt"))]
    if low and high:
        words = f"in {'[' if low == 'ge' else '('}{m[low]}, {m[high]}{']' if high == 'le' else ')'}"
    else:
        words = " and ".join(f"{_BOUNDS[k]} {m[k]}" for k in (low, high) if k)
    if m.get("finite"):
        words = f"a finite number {words}".strip()
    if "choices" in m:
        listed = ", ".join(repr(c) for c in m["choices"])
        if words:
            words = f"{words}, or {' or '.join(repr(c) for c in m['choices'])}"
        else:
            words = f"a list of: {listed}" if str(f.type).startswith("list") else f"one of: {listed}"
    if words and "None" in str(f.type):
        words += ", or None"
    return f"{words} ({m['note']})" if words and m.get("note") else words


def _satisfies(m, value: Any) -> bool:
    """Whether ``value`` (not None, of the field's type) meets the constraints in a field's metadata ``m``."""
    choices = m.get("choices", ())
    if isinstance(value, (list, tuple)):  # a list field: each item must be one of the choices
        return all(item in choices for item in value)
    if value in choices:
        return True
    if not any(k in m for k in (*_BOUNDS, "finite")):
        return False  # choices only, and it is none of them
    return (("ge" not in m or value >= m["ge"]) and ("gt" not in m or value > m["gt"])
            and ("le" not in m or value <= m["le"]) and ("lt" not in m or value < m["lt"])
            and (not m.get("finite") or not isinstance(value, float) or math.isfinite(value)))


def check_constraints(config) -> None:
    """Check every field's constraints declared with ``opt`` (after the type check)."""
    for f in dataclasses.fields(config):
        value, declared = getattr(config, f.name), describe_constraints(f)
        if value is not None and declared and not _satisfies(f.metadata, value):
            raise ConfigError(f"{type(config).__name__}: `{f.name}={value!r}` is invalid; it must be {declared}.")


def reject_unknown_options(cls):
    """Wrap a config's ``__init__`` so an unknown option gets a clear error instead of a bare ``TypeError``.

    A TRL option we do not implement is accepted only at TRL's default value (it then changes nothing);
    any other value is refused with a message that says so.
    """
    dataclass_init = cls.__init__
    known_fields = {f.name for f in dataclasses.fields(cls)}

    def __init__(self, *args, **kwargs):
        for name in list(kwargs):
            if name in known_fields:
                continue
            if name in TRL_ONLY_OPTIONS:
                _check_trl_only(cls.__name__, name, kwargs.pop(name))
                continue  # TRL's default: it changes nothing, so accepting it loses nothing.
            close = difflib.get_close_matches(name, sorted(known_fields), n=3)
            hint = f" Did you mean {', '.join('`' + c + '`' for c in close)}?" if close else ""
            raise ConfigError(f"{cls.__name__} has no option `{name}`.{hint}")
        dataclass_init(self, *args, **kwargs)

    def __getattr__(self, name):
        # Only reached when normal lookup fails: a TRL-only option reads as TRL's default, so a TRL script's
        # `if training_args.push_to_hub:` works unchanged.
        if name in TRL_ONLY_OPTIONS:
            return copy.deepcopy(TRL_ONLY_OPTIONS[name])
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __setattr__(self, name, value):
        if name in TRL_ONLY_OPTIONS and name not in known_fields:
            _check_trl_only(type(self).__name__, name, value)
            return  # setting TRL's default changes nothing
        object.__setattr__(self, name, value)

    __init__.__doc__ = dataclass_init.__doc__
    __init__.__signature__ = __import__("inspect").signature(dataclass_init)
    cls.__init__ = __init__
    cls.__getattr__ = __getattr__
    cls.__setattr__ = __setattr__
    return cls


def _check_trl_only(config_name: str, name: str, value: Any) -> None:
    """A TRL option this project does not implement: its TRL default is accepted, any other value refused."""
    trl_default = TRL_ONLY_OPTIONS[name]
    if value == trl_default or (value is None and trl_default is None):
        return
    if name == "debug" and value == []:  # TrainingArguments turns its default '' into [] (TrainingArguments.to_dict)
        return
    raise ConfigError(
        f"{config_name}: `{name}={value!r}` is a TRL option that this project does not support "
        f"(only its default {trl_default!r} is accepted). Remove it; docs/migrating-from-trl.md lists "
        f"what is supported."
    )


_TYPES = {"int": int, "float": (int, float), "bool": bool, "str": str, "dict": dict, "None": type(None)}


def _matches(value: Any, annotation: str) -> bool:
    """Whether ``value`` fits a field annotation written as a string ("int | None", "list[float] | None", ...)."""
    for part in (p.strip() for p in annotation.split("|")):
        if part.startswith("list["):
            if isinstance(value, (list, tuple)) and all(_matches(item, part[5:-1]) for item in value):
                return True
            continue
        expected = _TYPES.get(part)
        if expected is None:
            return True  # an annotation this check does not know: do not judge
        if isinstance(value, bool) and part in ("int", "float"):
            continue  # True is an int to Python, not to a user
        if isinstance(value, expected):
            return True
    return False


def check_types(config) -> None:
    """Check every field's value against its annotation (before the constraints: they assume the type)."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if not _matches(value, str(f.type)):
            raise ConfigError(f"{type(config).__name__}: `{f.name}={value!r}` is a {type(value).__name__}; "
                              f"expected {f.type}.")


def check_field(condition: bool, cls_name: str, name: str, value: Any, valid: str) -> None:
    if not condition:
        raise ConfigError(f"{cls_name}: `{name}={value!r}` is invalid; {valid}.")
