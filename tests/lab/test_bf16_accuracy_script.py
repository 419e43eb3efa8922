"""scripts/bf16_accuracy.py (results/README.md, claim 4) takes flags: --help answers at once (it started the minute
of loading and compiling), --out is checked before any work and gets a record with the run's command, machine and
versions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import import_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bf16_accuracy.py"


def load():
    return import_script("bf16_accuracy.py")


def test_help_answers_without_loading_torch():
    code = "\n".join(["import runpy, sys", f"sys.argv = [{str(SCRIPT)!r}, '--help']", "try:",
                      "    runpy.run_path(sys.argv[0], run_name='__main__')", "except SystemExit as e:",
                      "    assert e.code == 0, e.code", "assert 'torch' not in sys.modules, 'imported torch'"])
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env=os.environ | {"PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    assert "usage: python scripts/bf16_accuracy.py" in done.stdout and "--out" in done.stdout


def test_an_out_that_cannot_be_written_is_refused_before_any_work(tmp_path, monkeypatch, capsys):
    script = load()
    monkeypatch.setattr(script, "measure", lambda *a: pytest.fail("started measuring"))
    with pytest.raises(SystemExit) as e:
        script.main(["--out", str(tmp_path)])
    assert e.value.code == 2 and "--out path" in capsys.readouterr().err


def test_the_eager_check_writes_a_record_with_its_header(tmp_path):
    script = load()
    out = tmp_path / "bf16.json"
    script.main(["--no-compiled", "--out", str(out)])
    record = json.loads(out.read_text())
    assert record["command"] == f"python scripts/bf16_accuracy.py --no-compiled --out {out}"
    assert record["machine"]["dtype"] == "bfloat16" and record["versions"]["torch"]
    [row] = record["rows"]
    assert row["variant"] == "eager bf16" and 0.9 <= row["argmax_agreement"] <= 1 and row["kl_from_float32"] >= 0
