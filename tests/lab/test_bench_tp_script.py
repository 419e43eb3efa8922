"""scripts/bench_tp.py (results/tp.json) checks every flag before its first torchrun, and its record starts with
llmstep.lab.runinfo's header as every benchmark's does; the torchrun runs are stood in for here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import import_script

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_tp.py"


def load():
    return import_script("bench_tp.py", "bench_tp_script")


def fake_run(shape: str, n: int, args) -> dict:
    """What one `torchrun ... llmstep bench` gives the script: a slower token and a larger all-reduce share at more
    ranks."""
    per_token = 0.01 * n
    return {"world_size": n, "shape": shape, "per_token_seconds": {"median": per_token},
            "all_reduce_seconds_alone": 1e-4 * (n > 1), "all_reduces_per_token": 13,
            "all_reduce_share": {"median": 0.0 if n == 1 else 0.5}, "weight_bytes_per_rank": 5e7 / n,
            "load_average_1min_before_after": [1.0, 1.0]}


@pytest.mark.parametrize("argv, flag", [(["--ranks", "2,4"], "--ranks"), (["--ranks", "0,1"], "--ranks"),
                                        (["--ranks", "1,1"], "--ranks"), (["--rounds", "0"], "--rounds"),
                                        (["--repeats", "0"], "--repeats"), (["--new-tokens", "1"], "--new-tokens")])
def test_a_bad_flag_is_refused_before_the_first_torchrun(tmp_path, monkeypatch, capsys, argv, flag):
    """--ranks 2,4 ran every torchrun, then failed 'median of no timings' (the prediction needs 1 rank); --rounds 0
    ran nothing and failed the same way."""
    script = load()
    monkeypatch.setattr(script, "run", lambda *a: pytest.fail("started torchrun"))
    with pytest.raises(SystemExit) as e:
        script.main([*argv, "--out", str(tmp_path / "tp.json")])
    assert e.value.code == 2 and f"argument {flag}" in capsys.readouterr().err
    assert not (tmp_path / "tp.json").exists()


def test_an_out_that_cannot_be_written_is_refused_before_the_first_torchrun(tmp_path, monkeypatch):
    script = load()
    monkeypatch.setattr(script, "run", lambda *a: pytest.fail("started torchrun"))
    with pytest.raises(ValueError, match="--out path .* is a directory"):
        script.main(["--out", str(tmp_path)])


def test_the_record_carries_the_command_machine_and_versions_beside_its_rows(tmp_path, monkeypatch):
    script = load()
    monkeypatch.setattr(script, "run", fake_run)
    out = tmp_path / "tp.json"
    script.main(["--rounds", "1", "--ranks", "1,2", "--out", str(out)])
    record = json.loads(out.read_text())
    assert record["command"] == f"python scripts/bench_tp.py --rounds 1 --ranks 1,2 --out {out}"
    assert record["machine"]["device"] == "cpu" and record["versions"]["llmstep"]
    assert len(record["load_average_1min_before_after"]) == 2
    assert {"cores", "rows", "runs", "gpu_model"} <= set(record)  # what notebook 11 and results/tp.md read
    assert [(r["shape"], r["ranks"]) for r in record["rows"]] == [(s, n) for s in script.SHAPES for n in (1, 2)]
    assert len(record["runs"]) == 2 * len(script.SHAPES)


def test_the_stored_record_still_reads_as_notebook_11_reads_it():
    stored = json.loads((SCRIPT.parents[1] / "results" / "tp.json").read_text())
    assert {"cores", "rows", "runs", "gpu_model"} <= set(stored)
