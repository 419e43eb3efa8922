"""notebooks/nbval_sanitize.cfg: the widget-repr rule rewrites widgets' reprs and nothing else a notebook shows."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def widget_rule() -> tuple[str, str]:
    pytest.importorskip("nbval")
    from nbval.plugin import get_sanitize_patterns

    text = (ROOT / "notebooks" / "nbval_sanitize.cfg").read_text()
    rules = [(r, s) for r, s in get_sanitize_patterns(text) if s == "WIDGET"]
    assert len(rules) == 1
    return rules[0]


def texts(output: dict) -> list[str]:
    """Every string of an output that nbval compares, as it sanitizes them."""
    if output["output_type"] == "stream":
        return ["".join(output["text"])]
    return ["".join(v) if isinstance(v, list) else v for k, v in output.get("data", {}).items()
            if k.startswith("text/")]


def test_the_widget_rule_touches_only_the_text_beside_a_widget_view():
    regex, replace = widget_rule()
    seen = 0
    for path in sorted((ROOT / "notebooks").rglob("*.ipynb")):
        for cell in json.loads(path.read_text())["cells"]:
            for output in cell.get("outputs", []):
                for text in texts(output):
                    if re.sub(regex, replace, text) == text:
                        continue
                    where = f"{path.name}: {text[:80]!r}"
                    assert WIDGET_VIEW in output.get("data", {}), f"rewritten without a widget: {where}"
                    assert re.sub(regex, replace, text) == replace, f"more than the repr rewritten: {where}"
                    seen += 1
    assert seen >= 6  # 00, 02, 03 (two), 05 (two), 06: the course's widgets


@pytest.mark.parametrize("text", ["Box(children=(IntSlider(value=3),))", "VBox(children=(Output(),))",
                                  "interactive(children=(FloatSlider(value=1.0, description='t'), Output()))"])
def test_the_widget_rule_rewrites_a_widgets_repr(text):
    regex, replace = widget_rule()
    assert re.sub(regex, replace, text) == replace
