"""`./dev test`'s two workers get the longest work first (tests/balance.py): the order hands out every test once,
a module's (or class's) tests together, known long units first; the units it names exist."""

from __future__ import annotations

import ast
from pathlib import Path

from balance import LONGEST, SPLIT, _unit, order

REPO = Path(__file__).parents[2]


def test_the_order_hands_out_every_test_once_each_unit_together_the_long_ones_first():
    ids = [
        "tests/unit/test_a.py::test_1",
        "tests/unit/test_a.py::test_2",
        "tests/test_notebooks.py::test_run[01]",
        "tests/integration/test_chat_model.py::test_x[local]",
        "tests/unit/test_a.py::test_3",
        "tests/integration/test_chat_model.py::test_y",
        "tests/test_notebooks.py::test_run[02]",
    ]
    ordered = order(ids)
    assert sorted(ordered) == sorted(ids)
    units = [_unit(i) for i in ordered]
    runs = [u for n, u in enumerate(units) if n == 0 or units[n - 1] != u]
    assert len(runs) == len(set(runs))  # each unit's tests together
    assert runs[0] == "tests/integration/test_chat_model.py"  # the longest known unit first
    assert ordered[:2] == [
        "tests/integration/test_chat_model.py::test_x[local]",
        "tests/integration/test_chat_model.py::test_y",
    ]
    assert {"tests/test_notebooks.py::test_run[01]", "tests/test_notebooks.py::test_run[02]"} <= set(runs)  # split


def test_the_units_it_names_exist():
    for unit in [*LONGEST, *SPLIT]:
        path, _, cls = unit.partition("::")
        assert (REPO / path).is_file(), f"tests/balance.py names {path}, which does not exist"
        if cls:
            classes = {n.name for n in ast.walk(ast.parse((REPO / path).read_text())) if isinstance(n, ast.ClassDef)}
            assert cls in classes, f"tests/balance.py names {unit}, which does not exist"
