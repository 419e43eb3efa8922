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
REPEATED = {"05_prefill_vs_decode.ipynb", "09_continuous_batching.ipynb"}  # found in review, 2026-12-01


@pytest.mark.parametrize("path", [pytest.param(p, marks=pytest.mark.xfail(
    strict=True, reason="its header repeats **Runs in:** with different times: fix the notebook, then drop this"))
    if p.name in REPEATED else p for p in NOTEBOOKS], ids=lambda p: p.name)
def test_the_header_says_each_thing_once(path):
    first = json.loads(path.read_text())["cells"][0]
    text = "".join(first["source"])
    assert first["cell_type"] == "markdown" and text.startswith("# ")
    assert {field: text.count(field) for field in FIELDS} == dict.fromkeys(FIELDS, 1)


NOT_RUN = {"00_setup_and_hardware.ipynb", "05_prefill_vs_decode.ipynb"}  # a cell without outputs: review, 2026-12-01


@pytest.mark.parametrize("path", [pytest.param(p, marks=pytest.mark.xfail(
    strict=True, reason="a code cell was not run with the others: re-execute the notebook, then drop this"))
    if p.name in NOT_RUN else p for p in NOTEBOOKS + sorted(ROOT.glob("solutions/*.ipynb"))], ids=lambda p: p.name)
def test_the_outputs_come_from_one_run_top_to_bottom(path):
    cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    assert [c["execution_count"] for c in cells] == list(range(1, len(cells) + 1))
