"""docs/config-reference.md is generated from the config dataclasses, and every field is documented."""

import dataclasses
from pathlib import Path

import pytest

from trainers.cli.config_reference import CONFIG_CLASSES, REGENERATE, render, undocumented_fields
from trainers.config.options import opt

PAGE = Path(__file__).resolve().parents[2] / "docs" / "config-reference.md"


@pytest.mark.parametrize("cls", CONFIG_CLASSES, ids=lambda c: c.__name__)
def test_every_field_has_help(cls):
    missing = undocumented_fields(cls)
    assert not missing, (f"{cls.__name__} fields without a help text: {missing}; "
                         f"declare them with opt(default, help) in trainers/config/training.py.")
    assert (cls.__doc__ or "").strip(), f"{cls.__name__} has no docstring (it heads its section of the reference)."


def test_undocumented_field_is_caught_and_named():
    @dataclasses.dataclass
    class Probe:
        documented: int = opt(1, "Has a help text.")
        blank: int = opt(2, "  ")
        bare: int = 3

    assert undocumented_fields(Probe) == ["blank", "bare"]


def test_reference_page_is_current():
    assert PAGE.is_file(), f"{PAGE} is missing; generate it with: {REGENERATE}"
    assert PAGE.read_text() == render(), f"docs/config-reference.md is stale; regenerate it with: {REGENERATE}"


def test_render_covers_every_field_and_escapes_pipes():
    page = render()
    for cls in CONFIG_CLASSES:
        assert f"## {cls.__name__}" in page
    for f in dataclasses.fields(CONFIG_CLASSES[-1]):  # GRPOConfig: its own fields and the shared ones
        assert f"| `{f.name}` |" in page, f.name
    for line in page.splitlines():
        if line.startswith("| `"):
            cells = line.replace("\\|", "").strip("|").split("|")
            assert len(cells) in (2, 5), line


def test_subclass_sections_list_only_added_or_overridden_fields():
    page = render()
    sft = page[page.index("## SFTConfig"):page.index("## GRPOConfig")]
    assert "| `learning_rate` |" in sft and "| `max_length` |" in sft
    assert "| `per_device_train_batch_size` |" not in sft  # inherited unchanged: only in TrainingConfig's table
    assert "(#trainingconfig)" in sft


def test_constraints_are_shown_from_the_declarations():
    """Each field's Valid values cell comes from its opt() declaration, the one the config checks."""
    rows: dict[str, str] = {}  # field -> its rows (a field several configs declare has one per config)
    for line in render().splitlines():
        if line.startswith("| `"):
            name = line.split(" | ")[0][3:-1]
            rows[name] = rows.get(name, "") + line
    assert "| one of: 'grpo', 'bnpo', 'dr_grpo', 'dapo'," in rows["loss_type"]
    assert "| ≥ 1 |" in rows["per_device_train_batch_size"]
    assert "| in [0, 1) |" in rows["adam_beta1"]
    assert "| ≥ 1, or -1 (-1 trains for num_train_epochs) |" in rows["max_steps"]
    assert "| ≥ 1, or None |" in rows["eval_steps"]
    assert "| ≥ 2 (GRPO compares completions within a group) |" in rows["num_generations"]
    assert "| a list of: 'inputs', 'loss' |" in rows["include_for_metrics"]
    assert "`output_dir` | `str` | `'trainer_output'` |  |" in rows["output_dir"]  # no constraint: an empty cell


def test_a_changed_constraint_alone_lists_the_field_under_the_subclass():
    from trainers.cli.config_reference import documented_fields

    base = CONFIG_CLASSES[0]
    same_help = next(f for f in dataclasses.fields(base) if f.name == "logging_steps").metadata["help"]

    @dataclasses.dataclass
    class Narrower(base):
        logging_steps: int = opt(10, same_help, ge=5)  # same default and help, another bound

    assert [f.name for f in documented_fields(Narrower)] == ["logging_steps"]
