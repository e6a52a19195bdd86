"""docs/structure.md is what `python -m tools.structure` writes from the module docstrings,
so it stays current: every module of the packages appears, in one short line."""
from __future__ import annotations

import re

import pytest

from tools import structure


def test_page_is_what_the_script_writes():
    page = structure.PAGE.read_text(encoding="utf-8")
    assert page == structure.render(), "docs/structure.md is stale: run `make structure`"
    assert structure.main(["--check"]) == 0


def test_every_module_appears_with_its_summary():
    page = structure.PAGE.read_text(encoding="utf-8")
    listed = set(re.findall(r"^- `([^`]+\.py)`", page, re.M))
    modules = [p for p in structure.modules() if (structure.ROOT / p).stat().st_size > 0]
    assert modules and set(modules) <= listed, sorted(set(modules) - listed)
    for package in structure.PACKAGES:
        assert any(m.startswith(package + "/") for m in modules), package
    undocumented = [m for m in modules if not structure.summary(structure.ROOT / m)]
    assert not undocumented, f"modules without a docstring: {undocumented}"


def test_lines_are_short_and_the_lifecycle_is_numbered():
    page = structure.PAGE.read_text(encoding="utf-8")
    long = [line for line in page.splitlines() if len(line) > structure.WIDTH]
    assert not long, long
    steps = re.findall(r"^(\d+)\. ", page, re.M)
    assert steps == [str(i) for i in range(1, len(structure.LIFECYCLE) + 1)]


@pytest.mark.parametrize("doc, first", [
    ("One line. Then more.", "One line."),
    ("Wrapped\n  over two lines.\n\nA second paragraph.", "Wrapped over two lines."),
    ("Reads `a.py`, e.g. the engine. Then more.", "Reads `a.py`, e.g. the engine."),
    ("No final period", "No final period"),
    ("Long: " + "word " * 40 + "ends.", "Long."),
    ("`a: b` " + "word " * 40 + "ends.", "`a: b` " + ("word " * 40).strip() + " ends."),
    ("", ""),
])
def test_summary_is_the_first_sentence(tmp_path, doc, first):
    path = tmp_path / "m.py"
    path.write_text(f'"""{doc}"""\nx = 1\n' if doc else "x = 1\n")
    assert structure.summary(path) == first
