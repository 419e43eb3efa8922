"""The paged KV cache's benchmarks (llmstep.lab.bench_batching, scripts/bench_paged.py) on a tiny model: what
they count is what the runs did, and the tokens never change with the cache's layout."""

from __future__ import annotations

import json
import math
import shlex

import pytest
from conftest import import_script, make_checkpoint

import llmstep
from llmstep.lab.bench_batching import (
    measure_capacity,
    measure_chunked_prefill,
    measure_prefix_caching,
    percentile,
    random_workload,
    schedule_capacity,
    shared_prefix_workload,
)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory, tokenizer_file):
    path = tmp_path_factory.mktemp("tinybenchpaged")
    make_checkpoint(path, tokenizer_file, seed=3, max_position_embeddings=96, num_hidden_layers=2)
    return path


@pytest.fixture(scope="module")
def tiny(tiny_path):
    model, _ = llmstep.load(tiny_path, dtype="float32")
    return model.double()


def test_percentile_interpolates_like_numpy():
    assert percentile([3, 1, 2, 4], 50) == 2.5 and percentile([1, 2, 3, 4, 5], 100) == 5
    assert percentile([10.0], 99) == 10.0 and percentile([0, 10], 25) == 2.5


def test_prefix_caching_counts_the_shared_prompt_once(tiny):
    requests = shared_prefix_workload(6, tiny.config.vocab_size, system_len=32, user_len=(2, 6), new_tokens=(2, 3))
    assert all(r.prompt_ids[:32] == requests[0].prompt_ids[:32] for r in requests)
    assert [r.arrival for r in requests][:2] != [0, 0]  # one after another: the first has cached the prompt
    row = measure_prefix_caching(tiny, requests, n_slots=3, block_size=8)
    users = sum(len(r.prompt_ids) - 32 for r in requests)
    assert row["same_tokens"] and row["uncached"]["prefill_tokens"] == 6 * 32 + users
    assert row["cached"]["prefix_hit_tokens"] == 5 * 32 and row["cached"]["prefill_tokens"] == 32 + users
    assert row["prefill_tokens_cut"] == pytest.approx((6 * 32 + users) / (32 + users))


def test_capacity_compares_equal_memory(tiny):
    requests = random_workload(10, tiny.config.vocab_size, prompt_len=(2, 8), new_tokens=(2, 60), seed=2)
    row = measure_capacity(tiny, requests, contiguous_slots=2, block_size=4)
    assert row["same_tokens"] and row["positions"] == 2 * row["slot_len"] == 4 * row["kv_blocks"]
    assert row["contiguous"]["peak_sequences"] == 2 and row["contiguous"]["mean_sequences_while_full"] == 2
    assert row["paged"]["peak_blocks_used"] <= row["kv_blocks"]
    assert row["sequences_ratio"] > 1 and row["paged"]["engine_steps"] < row["contiguous"]["engine_steps"]
    counted = schedule_capacity(requests, tiny.config.max_seq_len, contiguous_slots=2, block_size=4)  # no model
    assert counted["sequences_ratio"] == row["sequences_ratio"] and counted["kv_blocks"] == row["kv_blocks"]
    assert (counted["contiguous_steps"], counted["paged_steps"]) == (row["contiguous"]["engine_steps"],
                                                                     row["paged"]["engine_steps"])
    assert counted["preemptions"] == row["paged"]["preemptions"]


def test_chunked_prefill_rows_keep_the_tokens(tiny):
    rows = measure_chunked_prefill(tiny, running=2, new_tokens=6, long_prompt=40, arrival=2, chunks=(None, 8),
                                   repeats=1)
    assert [r["prefill_chunk"] for r in rows] == [None, 8] and all(r["same_tokens"] for r in rows)
    assert all(0 < r["itl_p50_ms"] <= r["itl_p99_ms"] <= r["itl_max_ms"] for r in rows)


def load_script():
    return import_script("bench_paged.py")


@pytest.mark.parametrize("q", [-10, 150, math.nan, math.inf, True, "50"])
def test_a_percentile_outside_0_to_100_is_refused(q):
    """percentile([1, 2, 3], -10) was 0.8, q=150 an IndexError, q=nan 'cannot convert float NaN to integer'."""
    with pytest.raises(ValueError, match="percentile q must be a number in 0..100"):
        percentile([1, 2, 3], q)


@pytest.mark.parametrize("values", [[math.nan, 1, 2], [1, 2, math.nan], [], [1, math.inf]])
def test_percentile_values_must_be_finite_and_some(values):
    """A NaN sorted anywhere: percentile([nan, 1, 2], 50) was 1.0 and of [1, 2, nan] nan; no values gave NaN."""
    with pytest.raises(ValueError, match="percentile values"):
        percentile(values, 50)


def test_capacity_with_nothing_waiting_records_null_not_nan(tiny, tmp_path):
    """One request never waits: there is no ratio, and the record said "sequences_ratio": NaN (not JSON)."""
    requests = random_workload(1, tiny.config.vocab_size, prompt_len=(2, 4), new_tokens=(2, 3), seed=1)
    row = measure_capacity(tiny, requests, contiguous_slots=2, block_size=4)
    assert row["sequences_ratio"] is None and row["contiguous"]["mean_sequences_while_full"] is None
    counted = schedule_capacity(requests, tiny.config.max_seq_len, contiguous_slots=2, block_size=4)
    assert counted["sequences_ratio"] is None and counted["paged_mean_sequences_while_full"] is None
    with pytest.raises(ValueError, match="at least one request"):
        measure_capacity(tiny, [], contiguous_slots=2)  # was max() of an empty sequence
    with pytest.raises(ValueError, match="at least one request"):
        schedule_capacity([], tiny.config.max_seq_len)


@pytest.mark.parametrize("kwargs, match", [({"repeats": 0}, "repeats must be an integer >= 1"),
                                           ({"chunks": ()}, "at least one prefill chunk"),
                                           ({"chunks": (None, 0)}, "None or an integer >= 1"),
                                           ({"chunks": (8, 8)}, "given once"),
                                           ({"new_tokens": 1}, "new_tokens must be an integer >= 2"),
                                           ({"running": 0}, "running must be an integer >= 1")])
def test_chunked_prefill_settings_are_refused_before_any_run(tiny, monkeypatch, kwargs, match):
    """repeats=0 and chunks=() ended in a bare StopIteration, new_tokens=1 in max() of an empty sequence."""
    import llmstep.lab.bench_batching as bb

    monkeypatch.setattr(bb, "run_batch", lambda *a, **k: pytest.fail("ran a batch"))
    settings = {"running": 2, "new_tokens": 6, "long_prompt": 40, "arrival": 2, "chunks": (None, 8), "repeats": 1}
    with pytest.raises(ValueError, match=match):
        measure_chunked_prefill(tiny, **(settings | kwargs))


def test_chunked_prefill_takes_its_chunks_from_a_generator(tiny):
    """The chunks are read once, before the check: a generator is not drained by it (it was: StopIteration)."""
    rows = measure_chunked_prefill(tiny, running=1, new_tokens=2, long_prompt=4, arrival=0,
                                   chunks=(c for c in (None, 2)), repeats=1)
    assert [r["prefill_chunk"] for r in rows] == [None, 2]


@pytest.mark.parametrize("argv, flag", [(["--parts", "prefx"], "--parts"), (["--parts", "sweep,sweep"], "--parts"),
                                        (["--repeats", "0"], "--repeats"), (["--requests", "0"], "--requests"),
                                        (["--threads", "0"], "--threads")])
def test_the_script_refuses_a_bad_flag_before_loading_or_writing(tmp_path, monkeypatch, capsys, argv, flag):
    """--parts prefx exited 0 having measured nothing; --repeats 0 ended in StopIteration after the other parts."""
    script = load_script()
    monkeypatch.setattr(script, "load_model", lambda *a, **k: pytest.fail("loaded a model"))
    with pytest.raises(SystemExit) as e:
        script.main([*argv, "--out", str(tmp_path / "r.json")])
    assert e.value.code == 2 and f"argument {flag}" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


def test_the_sweep_of_one_request_records_null_and_the_script_its_own_command(tiny_path, tmp_path):
    """--parts sweep --requests 1 raised StatisticsError (median of no ratios); the command began `llmstep python`."""
    script = load_script()
    out = tmp_path / "r.json"
    argv = ["--model", str(tiny_path), "--requests", "1", "--parts", "sweep", "--out", str(out)]
    script.main(argv)

    def refuse(constant):
        raise ValueError(constant)

    record = json.loads(out.read_text(), parse_constant=refuse)
    assert record["command"] == "python scripts/bench_paged.py " + shlex.join(argv)
    for row in record["capacity_schedule_sweep"].values():
        assert row["ratios"] == [] and row["workloads_where_all_fit_at_once"] == 20
        assert row["median"] is None and row["min"] is None and row["max"] is None
