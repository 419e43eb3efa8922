"""Continuous batching over the paged KV cache: every request gets the tokens it gets alone (greedy and seeded,
with prefix caching, chunked prefill and preemption), the block pool holds only what the live sequences
need at every step and is whole again at the end, and bad requests are refused before any work."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from llmstep.batching import PagedBatcher, Request, run_batch

import llmstep
from llmstep.core.cost import MemoryBudgetError
from llmstep.core.paged_kv import BlockPool, PagedKVCache, SeqChunk, blocks_for
from llmstep.engines.decoding import NonFiniteLogitsError, budget
from llmstep.engines.kv_manager import KVCacheManager
from llmstep.engines.scheduler import Completion, Job, Scheduler
from llmstep.lab.bench_batching import random_workload

GREEDY = dict(temperature=0, stop_ids=())  # greedy, never stopping early: what these runs ask for


def solo(model, tok, r: Request):
    return llmstep.generate(model, tok, r.prompt_ids, r.max_new_tokens, r.temperature, r.top_k, r.top_p, r.seed,
                            stop_ids=r.stop_ids)


def workload(vocab: int, n: int = 8, seed: int = 0, shared: int = 0) -> list[Request]:
    """Greedy and seeded requests of different lengths arriving over time; the first `shared` prompt tokens
    are the same for all (a system prompt)."""
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(0, vocab, (shared,), generator=g).tolist()
    samplers = [dict(temperature=0.0), dict(temperature=0.9, seed=11), dict(temperature=1.3, top_k=20, seed=5),
                dict(temperature=0.7, top_p=0.8, seed=2)]
    out = []
    for i in range(n):
        prompt = system + torch.randint(0, vocab, (int(torch.randint(1, 14, (1,), generator=g)),), generator=g).tolist()
        out.append(Request(prompt, max_new_tokens=int(torch.randint(1, 16, (1,), generator=g)), arrival=i // 2,
                           **samplers[i % len(samplers)]))
    return out


def check_blocks(s: Scheduler) -> None:
    """The pool holds exactly the live sequences' blocks: each table a full block per block_size tokens in
    the cache plus at most one partial; every block's reference count is its holders; nothing lost."""
    m, bs = s.kv.pool, s.kv.block_size
    tables = {j.id: s.kv.table(j.id) for j in s.running}
    assert set(s.kv.tables) == set(tables)  # only running sequences hold blocks
    holders = [b for t in tables.values() for b in t]
    assert m.ref == [holders.count(b) for b in range(m.n_blocks)]
    assert m.n_used == len(set(holders)) <= sum(j.computed // bs + 1 for j in s.running)
    for j in s.running:
        assert len(tables[j.id]) == blocks_for(j.computed, bs), j.id
    assert len(m.free) + len(m.evictable) + m.n_used == m.n_blocks
    assert set(m.free).isdisjoint(m.evictable) and set(m.free).isdisjoint(holders)


@pytest.fixture
def checked_steps(monkeypatch):
    """Check the pool at the end of every engine step; return the schedulers seen (for the end state)."""
    seen, end_step = [], Scheduler.end_step

    def checking(self):
        check_blocks(self)
        if self not in seen:
            seen.append(self)
        end_step(self)

    monkeypatch.setattr(Scheduler, "end_step", checking)
    return seen


CONFIGS = {  # name: run_batch options (a 48-position request needs 12 blocks of 4)
    "roomy": dict(n_slots=4, block_size=4, kv_blocks=64),
    "preempting": dict(n_slots=4, block_size=4, kv_blocks=12),
    "prefix": dict(n_slots=4, block_size=4, kv_blocks=40, prefix_caching=True),
    "chunked": dict(n_slots=3, block_size=4, kv_blocks=40, prefill_chunk=5),
    "everything": dict(n_slots=5, block_size=2, kv_blocks=24, prefix_caching=True, prefill_chunk=3),
    "default_pool": dict(n_slots=2),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_request_gets_the_tokens_it_gets_alone(tiny64, checked_steps, name):
    model, tok = tiny64
    requests = workload(model.config.vocab_size, shared=9 if name in ("prefix", "everything") else 0)
    run = run_batch(model, requests, kv="paged", **CONFIGS[name])
    for r, c in zip(requests, run.completions, strict=True):
        alone = solo(model, tok, r)
        assert (c.tokens, c.stop_reason) == (alone.tokens, alone.stop_reason), f"request {c.id}"
    stats = run.kv_stats
    assert {"block_size", "blocks_total", "peak_blocks_used", "prefix_hit_tokens", "preemptions"} <= set(stats)
    assert 0 < stats["peak_blocks_used"] <= stats["blocks_total"]
    (s,) = checked_steps
    assert s.kv.pool.n_used == 0 and s.kv.pool.n_free == s.kv.n_blocks and not s.kv.tables  # every block back
    if name in ("preempting", "everything"):
        assert stats["preemptions"] > 0  # the small pool did force recomputation
    if name in ("prefix", "everything"):
        assert stats["prefix_hit_tokens"] >= 8 * (len(requests) - 2)  # the shared system prompt's full blocks
    if "prefill_chunk" in CONFIGS[name]:
        assert any(n > 0 for n in (len(c.prompt_ids) - CONFIGS[name]["prefill_chunk"] for c in run.completions))


def test_requests_that_run_into_the_context_and_stop_tokens_end_as_alone(tiny64, checked_steps):
    model, tok = tiny64
    base = solo(model, tok, Request(list(range(3, 12)), 20, **GREEDY)).tokens
    requests = [Request(list(range(1, 41)), 30, **GREEDY), Request([5] * 45, 10, **GREEDY),
                Request([9, 9], 60, **GREEDY),
                Request(list(range(3, 12)), 20, stop_ids=[base[6]], temperature=0), Request([1, 2], 0, **GREEDY)]
    run = run_batch(model, requests, n_slots=3, kv="paged", block_size=8, kv_blocks=8, prefill_chunk=16)
    for r, c in zip(requests, run.completions, strict=True):
        alone = solo(model, tok, r)
        assert (c.tokens, c.stop_reason) == (alone.tokens, alone.stop_reason)
    assert [c.stop_reason for c in run.completions] == ["context", "context", "context", "stop", "length"]


def test_a_preempted_seeded_request_draws_each_token_once(tiny64, checked_steps):
    """Two long sampled requests in a pool that holds one: the younger is preempted again and again and
    recomputes its tokens, never drawing them again from its generator."""
    model, tok = tiny64
    requests = [Request(list(range(1, 9)), 30, temperature=1.0, seed=s, stop_ids=()) for s in (1, 2)]
    run = run_batch(model, requests, n_slots=2, kv="paged", block_size=4, kv_blocks=10)
    assert run.kv_stats["preemptions"] >= 1
    for r, c in zip(requests, run.completions, strict=True):
        assert c.tokens == solo(model, tok, r).tokens


def test_prefix_caching_computes_a_shared_prompt_once(tiny64):
    """Six requests with the same 32-token prompt head, one after another: with prefix caching, the head's
    8 blocks are computed once and found five times. A seventh prompt is the head alone, all of it cached:
    its last block is computed again, for the logits of its last token."""
    model, tok = tiny64
    head = list(range(1, 33))
    requests = ([Request(head + [40 + i], 3, arrival=4 * i, **GREEDY) for i in range(6)]
                + [Request(head, 3, arrival=30, **GREEDY)])
    off = run_batch(model, requests, n_slots=2, kv="paged", block_size=4, kv_blocks=40)
    on = run_batch(model, requests, n_slots=2, kv="paged", block_size=4, kv_blocks=40, prefix_caching=True)
    assert off.kv_stats["prefill_tokens"] == 6 * 33 + 32 and off.kv_stats["prefix_hit_tokens"] == 0
    assert on.kv_stats["prefix_hit_tokens"] == 5 * 32 + 28 and on.kv_stats["prefill_tokens"] == 33 + 5 * 1 + 4
    assert [c.tokens for c in on.completions] == [c.tokens for c in off.completions]
    for i in (0, 6):
        assert on.completions[i].tokens == solo(model, tok, requests[i]).tokens


def test_a_block_of_the_same_tokens_after_another_prefix_is_not_found(tiny64):
    """A block's key chains every token before it: B's first block holds A's second block's tokens, at another place
    after another past, so nothing of A's is B's (a key of the block's tokens alone would hand B A's keys and
    values: other tokens). And a prompt that does share A's first block finds it, and only it."""
    model, tok = tiny64
    a = Request(list(range(1, 10)), 4, arrival=0, **GREEDY)  # blocks of 4: [1..4] [5..8] [9]
    b = Request([5, 6, 7, 8, 10], 4, arrival=8, **GREEDY)  # its first block is A's second
    c = Request([1, 2, 3, 4, 11], 4, arrival=16, **GREEDY)  # its first block is A's first
    run = run_batch(model, [a, b, c], n_slots=1, kv="paged", block_size=4, kv_blocks=12, prefix_caching=True)
    for r, done in zip((a, b, c), run.completions, strict=True):
        assert done.tokens == solo(model, tok, r).tokens
    assert run.kv_stats["prefix_hit_tokens"] == 4  # C's first block alone


def test_chunked_prefill_keeps_the_running_sequence_decoding(tiny64):
    """A 40-token prompt arrives while a request decodes: whole, it is one step; in chunks of 8 it takes five
    steps, and the running request makes a token in every one of them."""
    model, _ = tiny64
    requests = [Request([1, 2, 3], 20, **GREEDY), Request(list(range(1, 41)), 2, arrival=3, **GREEDY)]
    run = run_batch(model, requests, n_slots=2, kv="paged", block_size=4, kv_blocks=24, prefill_chunk=8)
    steps = [s for s, row in enumerate(run.timeline) if 1 in row]
    assert steps[:6] == [3, 4, 5, 6, 7, 8] and run.completions[1].tokens  # 5 chunks, then its decode step
    assert all(0 in run.timeline[s] for s in steps[:5])
    assert run.step_tokens[3:9] == [9, 9, 9, 9, 9, 2]  # 8 prompt tokens and a decode token; then two decodes
    whole = run_batch(model, requests, n_slots=2, kv="paged", block_size=4, kv_blocks=24)
    assert [s for s, row in enumerate(whole.timeline) if 1 in row][:2] == [3, 4]
    assert whole.step_tokens[3:5] == [41, 2]
    assert [c.tokens for c in run.completions] == [c.tokens for c in whole.completions]


def test_the_youngest_is_preempted_and_returns_first(tiny64):
    """Model-free: three jobs in a pool of 6 blocks of 2; when the pool runs dry the youngest leaves and waits
    at the head of the queue, and nobody fails."""
    jobs = [Job(Completion(id=i, prompt_ids=[1, 2, 3]), budget(3, 6, 48), set()) for i in range(3)]
    ticks = iter(range(10**6))
    s = Scheduler(jobs, 3, KVCacheManager(6, 2), clock=lambda: float(next(ticks)))
    preempted_at = []
    while not s.done:
        s.begin_step()
        before = s.stats["preemptions"]
        work = s.schedule()
        s.update(work, [7] * sum(w.samples for w in work))
        if s.stats["preemptions"] > before:
            preempted_at.append((s.step, s.queue[0].id))
        check_blocks(s)
        s.end_step()
    assert preempted_at and all(i == 2 for _, i in preempted_at[:1])  # the youngest goes first
    assert all(len(c.tokens) == 6 for c in s.run.completions)
    assert s.kv.pool.n_used == 0


def test_bad_requests_are_refused_before_the_run_with_their_index(tiny64, monkeypatch):
    model, tok = tiny64
    good = [Request([1, 2, 3], 4, **GREEDY), Request([4, 5], 3, temperature=0.8, seed=1, stop_ids=())]
    ran = []
    monkeypatch.setattr(PagedBatcher, "_run", lambda self, *a: ran.append(1))
    for bad, match in [(Request(list(range(1, 40)), 8, **GREEDY),
                        "request 1: .* need 12 blocks of 4 positions, the whole pool "
                                                        "has 10"),
                       (Request([], 4, **GREEDY), "request 1: .*empty"),
                       (Request([1], 4, temperature=-1.0, stop_ids=()), "request 1: .*temperature"),
                       (Request([1], 4, top_p=0.0, **GREEDY), "request 1: .*top_p"),
                       (Request([1], -2, **GREEDY), "request 1: max_new_tokens")]:
        with pytest.raises(ValueError, match=match):
            run_batch(model, [good[0], bad, good[1]], kv="paged", block_size=4, kv_blocks=10)
    assert ran == []  # nothing ran
    monkeypatch.undo()
    run = run_batch(model, good, kv="paged", block_size=4, kv_blocks=10)  # the others, unaffected
    assert [c.tokens for c in run.completions] == [solo(model, tok, r).tokens for r in good]


def test_the_options_belong_to_their_layout(tiny64):
    model, _ = tiny64
    r = [Request([1, 2], 2, **GREEDY)]
    with pytest.raises(ValueError, match="unknown KV cache layout 'pages'"):
        run_batch(model, r, kv="pages")
    with pytest.raises(ValueError, match="block_size, prefix_caching set the paged KV cache"):
        run_batch(model, r, block_size=8, prefix_caching=True)
    with pytest.raises(ValueError, match="compile is the contiguous cache.s option: the paged cache.s forward"):
        run_batch(model, r, kv="paged", compile=True)
    with pytest.raises(ValueError, match="unknown batching policy 'fifo'"):
        run_batch(model, r, kv="paged", policy="fifo")
    for kw, match in [({"kv_blocks": 0}, "kv_blocks"), ({"block_size": 1.5}, "block_size"),
                      ({"prefill_chunk": 0}, "prefill_chunk"), ({"prefix_caching": 1}, "prefix_caching")]:
        with pytest.raises(ValueError, match=match):
            run_batch(model, r, kv="paged", **kw)


def test_contiguous_runs_report_their_slots_as_blocks(tiny64):
    model, _ = tiny64
    run = run_batch(model, [Request([1, 2, 3], 4, **GREEDY), Request([4], 2, **GREEDY)], n_slots=3, max_len=16)
    assert run.kv_stats == {"block_size": 16, "blocks_total": 3, "peak_blocks_used": 2, "prefix_hit_tokens": 0,
                            "preemptions": 0, "prefill_tokens": 4, "decode_tokens": 4}
    assert run.summary()["kv_blocks_total"] == 3


def test_the_pool_a_run_builds_is_the_one_rule_the_cli_checks_with(tiny64):
    """`llmstep batch` checks the memory of the pool with `pool_blocks` before the model loads: the run's own."""
    from llmstep.engines.batching import pool_blocks

    model, _ = tiny64
    requests = [Request([1] * 30, 300, **GREEDY), Request([2] * 5, 3, **GREEDY)]
    batcher = PagedBatcher(model, n_slots=3, block_size=8)
    batcher.run(requests)
    context = model.config.max_seq_len
    # the longest request's 330 slots round up to CACHE_ROUNDING (256) steps, at most the context, in blocks of 8
    want = 3 * blocks_for(min(512, context), 8)
    assert batcher.runner.cache.n_blocks == pool_blocks([(30, 300), (5, 3)], 3, 8, context) == want
    assert pool_blocks([(30, 300)], 3, 8, context, kv_blocks=7) == 7
    assert pool_blocks([], 2, 8, context) == 2  # no request: one slot each


class BuiltUnchecked(Exception):
    """Raised by the spy below: the pool's bookkeeping was about to be built before its size was judged."""


def test_an_absurd_pool_or_block_is_refused_before_anything_is_built(tiny64, monkeypatch):
    model, _ = tiny64

    def spy(self, n_blocks, *args, **kwargs):
        raise BuiltUnchecked(f"BlockPool({n_blocks:,}) built before the pool was checked")

    monkeypatch.setattr(BlockPool, "__init__", spy)
    for kw in (dict(block_size=16, kv_blocks=10**9), dict(block_size=16, kv_blocks=10**7)):
        with pytest.raises(MemoryBudgetError, match=f"a paged KV cache of {kw['kv_blocks']:,} blocks"):
            run_batch(model, [Request([1, 2], 2)], kv="paged", **kw)
        with pytest.raises(MemoryBudgetError, match="GB free"):
            PagedKVCache(model.config, kw["kv_blocks"], 16, dtype=model.dtype)
    with pytest.raises(ValueError, match=r"block_size 49 is longer than the model's context \(48 positions\)"):
        PagedBatcher(model, block_size=49)  # at construction, before any request
    with pytest.raises(ValueError, match="block_size 1000000 is longer than the model's context"):
        PagedKVCache(model.config, 1, 10**6, dtype=model.dtype)


def test_a_sparse_paged_workload_records_its_idle_steps_at_once(tiny64):
    from llmstep.engines.batching import MAX_ARRIVAL_STEP

    model, _ = tiny64
    sparse = [Request([1, 2], 2, **GREEDY), Request([3], 2, arrival=MAX_ARRIVAL_STEP, **GREEDY)]  # 2 tokens each
    run = run_batch(model, sparse, n_slots=2, kv="paged", block_size=4, kv_blocks=8)
    assert run.steps == MAX_ARRIVAL_STEP + run.completions[1].latency_steps
    assert len({id(row) for row in run.timeline[2:MAX_ARRIVAL_STEP]}) == 1
    assert run.summary()["slot_utilisation"] == 4 / (2 * run.steps)  # 2 requests x 2 decode rows, over every step


@pytest.mark.parametrize("policy", ["continuous", "static"])
def test_one_scheduler_serves_both_caches_alike(tiny64, policy):
    """With blocks for everyone, the paged batcher runs the contiguous one's schedule, slot for slot, step for step,
    under either policy (one scheduler, two caches), and every request gets the same tokens."""
    model, _ = tiny64
    requests = random_workload(10, model.config.vocab_size, prompt_len=(2, 9), new_tokens=(1, 14), rate=0.6, seed=3)
    contiguous = run_batch(model, requests, n_slots=3, policy=policy)
    paged = run_batch(model, requests, n_slots=3, policy=policy, kv="paged", block_size=4, kv_blocks=64)
    assert paged.timeline == contiguous.timeline and paged.prefills == contiguous.prefills
    assert [c.tokens for c in paged.completions] == [c.tokens for c in contiguous.completions]
    assert paged.kv_stats["preemptions"] == 0


def test_paged_batching_on_a_tensor_parallel_model_gives_one_process_tokens(tmp_path, tokenizer_file, monkeypatch):
    """Each of 2 ranks holds 1 of the 2 KV heads: its paged cache holds its own heads (as its `new_cache` does),
    and run_batch(kv="paged") and PagedSession give the tokens one process gives. A key that overflows on one rank's
    heads alone is named by both ranks, for its own request only (each cache flags what its heads lost)."""
    from conftest import make_checkpoint

    from llmstep.core.checkpoint import load

    here = Path(__file__).parent
    monkeypatch.syspath_prepend(here.parent / "core")
    monkeypatch.syspath_prepend(here)
    from test_parallel import torchrun  # the 2-process gloo launcher of the tensor-parallel tests

    make_checkpoint(tmp_path / "gqa", tokenizer_file, num_key_value_heads=2)
    from tp_paged_worker import OVERFLOWING, requests

    done = torchrun(2, str(here / "tp_paged_worker.py"), str(tmp_path), str(tmp_path / "gqa"))
    assert done.returncode == 0, done.stderr[-3000:]

    model, tok = load(tmp_path / "gqa", device="cpu", dtype="float32")
    alone = [solo(model, tok, r).tokens for r in requests()]
    for rank in range(2):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert record["kv_heads"] == 1
        assert record["paged"] == alone
        assert record["session"] == alone[0]
        assert OVERFLOWING not in alone[0] and "non-finite logits (NaN or Inf) for request(s) 1:" in record["overflow"]


def overflowing(model, token: int):
    """A copy of the model whose embedding of `token` is infinite (what a float16 overflow on one input gives)."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        model.tok_embeddings.weight[token] = float("inf")
    return model


def test_a_sequence_whose_keys_overflow_leaves_the_others_in_its_forward_as_they_are_alone(tiny64):
    """One paged forward attends over every sequence's keys, the others' masked; a masked key weighs exactly 0, but
    0 * inf is NaN. The cache stores a key or value that is not finite as 0 and flags its slot: the other sequence's
    logits are its logits alone, and the tokens that saw the flagged slot (from the overflowing one on) are named."""
    from llmstep.engines.batching import cache_config

    model, _ = tiny64
    assert not model.config.tie_embeddings  # else the head's row of the token would be infinite too
    good, bad = [1, 2, 3, 4, 5], [6, 7, 8, 9]
    model = overflowing(model, 8)

    def forward(*prompts):
        cache = PagedKVCache(cache_config(model), n_blocks=8, block_size=4, dtype=model.dtype)
        chunks = [SeqChunk([2 * i, 2 * i + 1], 0, len(p)) for i, p in enumerate(prompts)]
        logits = model(torch.tensor([sum(prompts, [])]), cache.plan(chunks), cache)[0]  # [N, vocab]
        return logits, cache.nonfinite_rows()

    both, flagged = forward(good, bad)
    alone, _ = forward(good)
    assert torch.isfinite(both[:5]).all() and torch.allclose(both[:5], alone, rtol=0, atol=1e-12)
    assert flagged.tolist() == [False] * 5 + [False, False, True, True]  # bad's tokens 6, 7 see no infinite key
    assert torch.isfinite(both[5:7]).all() and torch.isnan(both[7:]).all()  # 9 read 8's key, stored as 0: NaN too


def test_a_paged_run_names_only_the_request_that_overflowed(tiny64):
    """Its prompt's last token (7) reads the overflowing one's key, stored as 0: its logits come out NaN, as they
    would have."""
    model, _ = tiny64
    model = overflowing(model, 8)
    for kv in ("paged", "contiguous"):  # the contiguous cache keeps each sequence in its own row: the same
        with pytest.raises(NonFiniteLogitsError, match=r"request\(s\) 1: their tokens"):
            run_batch(model, [Request([1, 2, 3], 4, **GREEDY), Request([6, 8, 7], 4, **GREEDY)], kv=kv)
