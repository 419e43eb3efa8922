"""`llmstep batch --kv paged ...`: the paged cache's flags reach the run and its record, and a flag of one
layout given to the other is refused in one line before the model is built."""

from __future__ import annotations

import json

import pytest

from llmstep.cli import main


@pytest.mark.parametrize("argv, message", [
    (["--block-size", "8"], "--block-size set the paged KV cache: add --kv paged"),
    (["--prefix-caching", "--prefill-chunk", "4"], "--prefix-caching, --prefill-chunk set the paged KV cache"),
    (["--kv", "paged", "--compile"], "--compile: the paged step runs eager"),
])
def test_a_flag_of_the_other_layout_is_one_line_and_status_2(argv, message, capsys, monkeypatch):
    from llmstep.core import checkpoint

    monkeypatch.setattr(checkpoint, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit) as e:
        main(["batch", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.splitlines()) == 1 and message in err, err


@pytest.mark.parametrize("argv, message", [
    (["--batch-sizes", "1,2000000000"], "its largest KV cache (--batch-sizes 2000000000 x 65 positions, float32) "
                                         "needs about"),
    (["--slots", "1,2000000000"], "its largest KV cache (--slots 2000000000 x "),
    (["--kv", "paged", "--slots", "2000000000"], "its largest KV cache (a paged pool of "),
    (["--kv", "paged", "--kv-blocks", "2000000000"], "(a paged pool of 2,000,000,000 blocks x 16 positions, float32)"),
    (["--kv", "paged", "--block-size", "100000"], "--block-size 100000 is longer than the model's context (512"),
    (["--kv", "paged", "--kv-blocks", "1"], "--kv-blocks 1: request 0: its prompt ("),
    # slots a 64-block pool could never run: the scheduler's bookkeeping of 10**9 slots was a MemoryError
    (["--kv", "paged", "--kv-blocks", "64", "--slots", "1000000000"], "--slots 1,000,000,000: a pool of 64 blocks "
                                                                      "runs at most 64 sequences at once"),
    # arrivals spread past what a run records: refused by the flag, not by a request after the table's header
    (["--rate", "1e-10"], "--rate 1e-10: request 1: arrival step"),
])
def test_what_no_run_could_hold_is_refused_from_the_config_before_the_model_loads(argv, message, capsys, monkeypatch):
    """The largest cache of any run (the most slots, the pool, the largest batch size of the step timing, which
    comes after the whole workload) and each request against a --kv-blocks pool: checked before the weights."""
    from llmstep.core import checkpoint

    monkeypatch.setattr(checkpoint, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit) as e:
        main(["batch", "--requests", "4", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.splitlines()) == 1 and message in err, err


def test_paged_batch_runs_and_records_its_cache(tmp_path, capsys):
    out = tmp_path / "b.json"
    main(["batch", "--kv", "paged", "--block-size", "4", "--kv-blocks", "40", "--prefix-caching", "--prefill-chunk",
          "8", "--slots", "1,3", "--requests", "4", "--prompt-len", "2:12", "--new-tokens", "2:4", "--batch-sizes",
          "1", "--context", "8", "--json", str(out)])
    record = json.loads(out.read_text())
    assert record["kv"] == {"kv": "paged", "block_size": 4, "kv_blocks": 40, "prefix_caching": True,
                            "prefill_chunk": 8}
    assert [(r["policy"], r["slots"]) for r in record["runs"]] == [("continuous", 1), ("continuous", 3),
                                                                   ("static", 3)]
    assert all(r["kv_blocks_total"] == 40 and r["kv_block_size"] == 4 for r in record["runs"])
    assert all(r["same_tokens_as_first_run"] for r in record["runs"])
    assert "kv: peak" in capsys.readouterr().out
