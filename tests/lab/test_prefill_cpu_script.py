"""scripts/prefill_cpu.py (results/README.md, claim 2, session 38): its record holds each shape's two timings and
the prefill's, both sides' logits against float32, and it leaves llmstep.core.linear's rule as it found it."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from conftest import import_script

from llmstep.core import linear


def test_a_small_run_writes_its_record_and_restores_what_it_changed(tmp_path, monkeypatch):
    """It widens at 8 rows too (WIDEN_ROWS forced to 1: the shapes' timings compare two computations), and leaves
    linear's rule, torch's threads and grad mode as it found them (this runs inside a CI worker)."""
    script, before, rows = import_script("prefill_cpu.py"), linear._slow_half_gemm, linear.WIDEN_ROWS
    seen, real = [], linear.F.linear
    record_call = lambda x, w, b=None: seen.append((x.dtype, x.shape[-2])) or real(x, w, b)  # noqa: E731
    monkeypatch.setattr(linear, "F", SimpleNamespace(linear=record_call))
    out, threads = tmp_path / "prefill.json", torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        script.main(["--rows", "8", "--rounds", "2", "--prompt-len", "16", "--json", str(out)])
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    assert linear._slow_half_gemm is before and linear.WIDEN_ROWS == rows and torch.is_grad_enabled()
    assert (torch.float32, 8) in seen  # 8-row products were widened: not torch's matmul timed twice
    record = json.loads(out.read_text())
    assert record["command"].startswith("python scripts/prefill_cpu.py --rows 8")
    assert record["torch_slow_half_gemm"] == before(torch.bfloat16)
    assert [s["matmul"] for s in record["shapes"]] == ["wq", "wk", "w1", "w2", "head"]
    assert all(s["rows"] == 8 and len(s["rounds_us"]["torch"]) == len(s["rounds_us"]["widened"]) == 2
               for s in record["shapes"])
    for side in ("torch", "widened"):
        p = record["prefill"][side]
        assert len(p["seconds"]) == 2 and p["tokens_per_second"] > 0
        assert 0 <= p["max_abs_logit_diff_vs_float32"] < 1  # bf16 rounding, not another function


def test_json_is_checked_before_any_model_loads(tmp_path, capsys, monkeypatch):
    script = import_script("prefill_cpu.py")
    monkeypatch.setattr(script.llmstep, "load", lambda *a, **k: pytest.fail("loaded a model"))
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit):
        script.main(["--json", str(tmp_path / "file" / "x.json")])
    assert "is a file, not a directory" in capsys.readouterr().err
