"""The committed notebooks as files: each course notebook opens with one header (a title, then each of **You will
learn:**, **You need:** and **Runs in:** exactly once: a repeated line says two different things, e.g. two run
times), and every notebook's outputs come from one run top to bottom (execution counts 1, 2, ..., N: a cell
edited or skipped after the run shows as a gap)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(ROOT.glob("[0-9][0-9]_*.ipynb"))
FIELDS = ("**You will learn:**", "**You need:**", "**Runs in:**")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_the_header_says_each_thing_once(path):
    first = json.loads(path.read_text())["cells"][0]
    text = "".join(first["source"])
    assert first["cell_type"] == "markdown" and text.startswith("# ")
    assert {field: text.count(field) for field in FIELDS} == dict.fromkeys(FIELDS, 1)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_notebook_has_exercises_and_their_solutions(path):
    """The README's promise: exercises at the end of each notebook, worked answers in solutions/ (an edit that
    overwrote a notebook's exercise cell, or a notebook added without its solutions, fails here)."""
    headings = [line for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "markdown"
                for line in "".join(c["source"]).splitlines() if line.startswith("#")]
    assert any(h.lstrip("#").strip().startswith("Exercises") for h in headings), f"{path.name}: no Exercises heading"
    assert (ROOT / "solutions" / f"{path.name[:2]}_solutions.ipynb").is_file(), f"{path.name}: no solutions notebook"


@pytest.mark.parametrize("path", NOTEBOOKS + sorted(ROOT.glob("solutions/*.ipynb")), ids=lambda p: p.name)
def test_the_outputs_come_from_one_run_top_to_bottom(path):
    cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    assert [c["execution_count"] for c in cells] == list(range(1, len(cells) + 1))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_the_header_fields_leave_no_stray_fragment(path):
    """From **You will learn:** to the end of the **Runs in:** paragraph the brackets balance, and no line that ends
    a sentence is followed by one that starts in lower case: a fragment left by an edit, e.g. the tail of an older
    "Runs in" after the new one, shows as an unmatched ")" or as a sentence that starts mid-way."""
    text = "".join(json.loads(path.read_text())["cells"][0]["source"])
    start, runs = text.index(FIELDS[0]), text.index(FIELDS[-1])
    end = text.find("\n\n", runs)
    fields = text[start:] if end < 0 else text[start:end]
    assert fields.count("(") == fields.count(")"), f"{path.name}: unbalanced brackets in {fields!r}"
    lines = fields.split("\n")
    for before, line in zip(lines[:-1], lines[1:], strict=True):
        assert not (before.rstrip().endswith((".", ".)")) and line[:1].islower()), f"{path.name}: stray line {line!r}"
