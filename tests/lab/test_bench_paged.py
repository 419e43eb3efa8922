"""The paged KV cache's benchmarks (llmstep.lab.bench_batching, scripts/bench_paged.py) on a tiny model: what
they count is what the runs did, and the tokens never change with the cache's layout."""

from __future__ import annotations

import pytest
from conftest import make_checkpoint

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
def tiny(tmp_path_factory, tokenizer_file):
    path = tmp_path_factory.mktemp("tinybenchpaged")
    make_checkpoint(path, tokenizer_file, seed=3, max_position_embeddings=96, num_hidden_layers=2)
    model, _ = llmstep.load(path, dtype="float32")
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
