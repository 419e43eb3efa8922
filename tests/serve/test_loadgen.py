"""The load generator against a real server: every request answered with exactly its max_tokens (ignore_eos), a
time to first token and max_tokens - 1 inter-token gaps each; and its percentiles."""

from __future__ import annotations

import asyncio
import math

import pytest
from serving import load_shipped, running_server

from llmstep.serve.loadgen import percentiles, run_load, summarise

shipped = pytest.fixture(scope="module", name="shipped")(load_shipped)


def test_percentiles_interpolate_between_ranks_as_numpy():
    assert percentiles([1.0, 2.0, 3.0, 4.0]) == {"p50": 2.5, "p90": pytest.approx(3.7), "p99": pytest.approx(3.97)}
    assert all(math.isnan(v) for v in percentiles([]).values())


def test_a_poisson_load_is_answered_and_timed(shipped):
    model, tokenizer = shipped
    with running_server(model, tokenizer, n_slots=4) as (url, engine):
        timings, seconds = asyncio.run(run_load(url, rate=50.0, requests=6, prompt_len=(4, 12), new_tokens=(3, 6),
                                                seed=1))
    assert all(t.ok for t in timings), [t.error for t in timings]
    assert [len(t.token_times) for t in timings] == [t.max_tokens for t in timings]
    assert [t.completion_tokens for t in timings] == [t.max_tokens for t in timings]
    record = summarise(timings, seconds, 50.0)
    assert record["completed"] == 6 and record["output_tokens"] == sum(t.max_tokens for t in timings)
    assert 0 < record["ttft_ms"]["p50"] <= record["ttft_ms"]["p99"] <= record["e2e_latency_ms"]["p99"]
    assert record["itl_ms"]["p50"] > 0 and record["refused_429"] == record["failed"] == 0


def test_a_shared_system_prompt_is_what_the_prefix_cache_finds(shipped):
    model, tokenizer = shipped
    load = dict(rate=math.inf, prompt_len=(4, 12), new_tokens=(2, 3), shared_prefix=32)
    with running_server(model, tokenizer, n_slots=4, block_size=16) as (url, engine):
        asyncio.run(run_load(url, requests=1, seed=1, **load))  # the warm-up fills the cache with the 2 blocks
        before = engine.health()
        timings, _ = asyncio.run(run_load(url, requests=4, seed=0, **load))
        after = engine.health()
        assert all(t.ok for t in timings) and all(36 <= t.prompt_tokens <= 44 for t in timings)
        assert after["prefix_hit_tokens"] - before["prefix_hit_tokens"] == 4 * 32  # each found the 2 full blocks
        # and computed the rest of its prompt, then one token a step for each new token but the last
        assert after["prefill_tokens"] - before["prefill_tokens"] == sum(t.prompt_tokens for t in timings) - 4 * 32
        assert after["decode_tokens"] - before["decode_tokens"] == sum(t.max_tokens - 1 for t in timings)
        assert after["preemptions"] == 0
    with running_server(model, tokenizer, n_slots=4, prefix_caching=False, prefill_chunk=None) as (url, engine):
        asyncio.run(run_load(url, requests=3, seed=0, **load))
        health = engine.health()
        assert (health["prefix_hit_tokens"], health["prefix_caching"], health["prefill_chunk"]) == (0, False, None)
