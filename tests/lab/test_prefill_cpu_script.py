"""scripts/prefill_cpu.py (results/README.md, claim 2, session 38): its record holds each shape's two timings and
the prefill's, both sides' logits against float32, and it leaves llmstep.core.linear's rule as it found it."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import import_script

from llmstep.core import linear


def test_a_small_run_writes_its_record_and_restores_the_rule(tmp_path):
    script, before = import_script("prefill_cpu.py"), linear._slow_half_gemm
    out = tmp_path / "prefill.json"
    script.main(["--rows", "16", "--rounds", "1", "--prompt-len", "16", "--json", str(out)])
    assert linear._slow_half_gemm is before
    record = json.loads(out.read_text())
    assert record["command"].startswith("python scripts/prefill_cpu.py --rows 16")
    assert record["torch_slow_half_gemm"] == before(torch.bfloat16)
    assert [s["matmul"] for s in record["shapes"]] == ["wq", "wk", "w1", "w2", "head"]
    assert all(s["rows"] == 16 and s["torch_us"] > 0 and s["widened_us"] > 0 for s in record["shapes"])
    for side in ("torch", "widened"):
        p = record["prefill"][side]
        assert len(p["seconds"]) == 1 and p["tokens_per_second"] > 0
        assert 0 <= p["max_abs_logit_diff_vs_float32"] < 1  # bf16 rounding, not another function


def test_json_is_checked_before_any_model_loads(tmp_path, capsys, monkeypatch):
    script = import_script("prefill_cpu.py")
    monkeypatch.setattr(script.llmstep, "load", lambda *a, **k: pytest.fail("loaded a model"))
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit):
        script.main(["--json", str(tmp_path / "file" / "x.json")])
    assert "is a file, not a directory" in capsys.readouterr().err
