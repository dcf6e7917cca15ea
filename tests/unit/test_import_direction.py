"""Imports flow one way (docs/design.md): every module is in a room; the core knows no trainer and no tool, no
algorithm imports another (GRPO does not import SFT or RLOO, nor SFT GRPO), the library never imports the CLI, and no two modules import each other, even lazily inside a function.

Read from the source with ``ast``, so an import inside a function counts as much as one at the top.
"""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "trainers"


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: pathlib.Path) -> set[str]:
    """Every ``trainers`` module ``path`` imports (``from trainers import x`` counts as trainers.x when x is one)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names if alias.name.startswith("trainers")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("trainers"):
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                names.add(candidate if candidate in MODULES else node.module)
    return names


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}
GRAPH = {name: imported_modules(path) - {name} for name, path in MODULES.items()}


# the modules whose job is to re-export: the package's public names, and TRL's `trl.rewards` path
FACADES = {"trainers", "trainers.rewards"}
# what every room may use, at the package's root: the errors and the logger
ROOT = {"trainers.errors", "trainers.logs"}

# The rooms, lower first. The core: optim < config; parallel < model; data; loop over all of them. Beside it the
# JSON-over-HTTP layer (services) < running code in sandboxes (execution), both used by sampling's rewards. Then generation <
# agents < sampling (the base of the trainers that learn from their own samples) and preference (the base of DPO,
# KTO and the reward trainer) < the algorithms, siblings that never import each other < cli.
CORE = {"root", "optim", "config", "parallel", "model", "data", "loop"}
SAMPLING = CORE | {"services", "execution", "generation", "agents", "sampling"}
ALLOWED = {
    "root": {"root"}, "optim": {"root", "optim"}, "config": {"root", "optim", "config"},
    "parallel": {"root", "parallel"}, "model": {"root", "parallel", "model"},
    "data": {"root", "config", "parallel", "data"}, "loop": CORE,
    "services": {"root", "services"}, "execution": {"root", "services", "execution"},
    "generation": CORE | {"generation"}, "agents": CORE | {"generation", "agents"}, "sampling": SAMPLING,
    "preference": CORE | {"preference"},
    "grpo": SAMPLING | {"grpo"}, "rloo": SAMPLING | {"rloo"}, "distillation": SAMPLING | {"distillation"},
    "sft": CORE | {"sft"}, "dpo": CORE | {"preference", "dpo"}, "kto": CORE | {"preference", "kto"},
    "reward": CORE | {"preference", "reward"},
    "cli": SAMPLING | {"preference", "grpo", "rloo", "distillation", "sft", "dpo", "kto", "reward", "cli"},
}
ROOMS = tuple(room for room in ALLOWED if room != "root")


def room(name: str) -> str | None:
    """The room a module lives in: the folder under trainers/ it is in, or 'root' for the errors and the logger
    (None for any other module: it belongs to no room)."""
    if name in ROOT:
        return "root"
    parts = name.split(".")
    return parts[1] if len(parts) >= 2 and parts[1] in ROOMS else None


def test_every_module_is_in_a_room():
    """A module at the package's root beyond its face (the facades, the errors, the logger), or in a folder no room
    names, fails here: add it to a room (or a room to ALLOWED, with what it may import)."""
    homeless = sorted(name for name in MODULES if name not in FACADES and room(name) is None)
    assert not homeless, homeless
    assert len(list(PACKAGE.glob("*.py"))) <= 8  # the root: its face and what has no better room


def test_the_graph_was_read():
    assert {"trainers.loop.base", "trainers.grpo.trainer", "trainers.sft.trainer", "trainers.cli.main"} <= set(GRAPH)
    assert "trainers.loop.base" in GRAPH["trainers.sampling.trainer"]  # the reader finds imports at all


@pytest.mark.parametrize("name", sorted(name for name in set(MODULES) - FACADES if room(name) is not None))
def test_each_room_imports_only_the_rooms_below_it(name):
    wrong = {dep for dep in GRAPH[name] if dep not in FACADES and room(dep) not in ALLOWED[room(name)]}
    wrong |= {dep for dep in GRAPH[name] if dep in FACADES and room(name) != "cli"}  # the library never uses them
    assert not wrong, f"{name} ({room(name)}) imports {sorted(wrong)}"


def test_no_import_cycles():
    """Between modules; a package's __init__ re-exporting its own modules is not a cycle of the code."""
    edges = {name: {dep for dep in deps if not name.startswith(dep + ".") and dep in GRAPH}
             for name, deps in GRAPH.items() if name not in FACADES}
    edges = {name: {dep for dep in deps if dep not in FACADES and not MODULES[dep].name == "__init__.py"}
             for name, deps in edges.items()}
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for dep in sorted(edges.get(node, ())):
            if state.get(dep) == "open":
                cycle = path[path.index(dep):] + [dep] if dep in path else [node, dep]
                pytest.fail(f"import cycle: {' -> '.join(cycle)}")
            if dep not in state:
                visit(dep, path + [dep])
        state[node] = "done"

    for name in sorted(edges):
        if name not in state:
            visit(name, [name])


def trainer_parameters(path: pathlib.Path) -> list[str]:
    """The functions of ``path`` with a parameter named ``trainer`` (a trainer object passed in)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names = [a.arg for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs]
            if "trainer" in names:
                found.append(node.name)
    return found


# The trainer's own parts: the callback handler fires transformers' events with the trainer's state, model and
# optimizer (the TrainerCallback contract); the trainer's mixins are the trainer itself (``self``)
TRAINER_PARTS = {"trainers.loop.callbacks"}


BELOW_THE_ALGORITHMS = CORE | {"generation", "agents", "sampling"}  # the sampling base: its stage, scorer, evaluation


@pytest.mark.parametrize("name", sorted(name for name in MODULES if room(name) in BELOW_THE_ALGORITHMS
                                        and name not in FACADES | TRAINER_PARTS))
def test_no_module_below_the_algorithms_takes_a_trainer(name):
    """Below the algorithms, components are built from explicit arguments, never from a trainer object."""
    assert not trainer_parameters(MODULES[name]), f"{name}: {trainer_parameters(MODULES[name])} take a trainer"

