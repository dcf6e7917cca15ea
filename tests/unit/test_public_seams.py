"""Tests go through public seams (docs/design.md, docs/testing.md): no test reads, calls or replaces a private
member (a single-underscore name) of this package's objects or modules. Read from the source with ``ast``: every
attribute a test file touches whose name is private and defined somewhere in trainers/ fails here, with where."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
# private names of other libraries that this package happens to define too
OTHERS = {
    "_timeout",  # torch's ProcessGroup options (tests/distributed/ddp_options_job.py)
    "_can_checkpoint_with_cache",  # transformers' GradientCheckpointingLayer switch (sampling/shared_prompt.py)
}


def private_names_of_the_package() -> set[str]:
    """Every single-underscore name trainers/ defines: functions, classes, methods, attributes set on self, module
    globals."""
    names = set()
    for path in (ROOT / "trainers").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
    return {name for name in names if name.startswith("_") and not name.startswith("__")} - OTHERS


def test_no_test_touches_a_private_member_of_the_package():
    private = private_names_of_the_package()
    assert "_place" in private  # the reader finds them at all (SamplingTrainer._place)
    touched = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            name = None
            if isinstance(node, ast.Attribute) and node.attr in private and not (
                    isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                name = node.attr
            elif (isinstance(node, ast.Call) and getattr(node.func, "attr", None) in ("setattr", "object")
                  and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and node.args[1].value in private):
                name = node.args[1].value  # monkeypatch.setattr(obj, "_name", ...), mock.patch.object(obj, "_name")
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("trainers"):
                name = next((alias.name for alias in node.names if alias.name in private), None)
            if name is not None:
                touched.append(f"{path.relative_to(ROOT)}:{node.lineno} {name}")
    assert not touched, touched
