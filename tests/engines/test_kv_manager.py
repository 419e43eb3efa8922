"""The KV-cache manager's contract, model-free: blocks for a request or "cannot fit" (and then nothing changed),
freed blocks back in the pool, a shared prefix found and held by both, cached blocks evicted least recently used
first, and a cancelled request's blocks back at once."""

from __future__ import annotations

import pytest

from llmstep.engines.decoding import budget
from llmstep.engines.kv_manager import KVCacheManager, Prefix, check_fits
from llmstep.engines.scheduler import Completion, Job, Scheduler


def computed(kv: KVCacheManager, rid: int, tokens: list[int]) -> list[int]:
    """Request rid computes all of `tokens` from scratch (blocks, then its full blocks cached); its table."""
    table = kv.allocate(rid, len(tokens), kv.cached_prefix(rid, tokens))
    kv.cache_blocks(rid, tokens, 0, len(tokens))
    return table


def found(kv: KVCacheManager, tokens: list[int]) -> int:
    """How many of `tokens` a new request would find cached (asked for a throwaway request id)."""
    n = kv.cached_prefix(-1, tokens).n_tokens
    kv.free(-1)
    return n


def test_allocate_until_full_then_cannot_fit_and_nothing_changes():
    kv = KVCacheManager(5, 4)
    assert kv.allocate(0, 9) == [0, 1, 2]  # 9 tokens: two full blocks and one partial
    assert kv.allocate(0, 12) == [0, 1, 2]  # still fits its blocks
    assert kv.allocate(1, 8) == [3, 4] and kv.pool.n_used == 5
    assert kv.allocate(0, 13) is None and kv.allocate(2, 1) is None  # no block left: for a new or a running one
    assert kv.table(0) == [0, 1, 2] and 2 not in kv.tables and kv.pool.n_used == 5  # a refusal takes nothing
    kv.free(1)
    assert kv.allocate(0, 13)[:3] == [0, 1, 2] and len(kv.table(0)) == 4


def test_free_returns_every_block_and_unknown_ids_are_ignored():
    kv = KVCacheManager(4, 2)
    kv.allocate(0, 3)
    kv.allocate(1, 4)
    assert kv.pool.n_used == 4 and kv.pool.peak_used == 4
    kv.free(0)
    kv.free(7)
    assert kv.pool.n_used == 2 and kv.allocate(2, 4) is not None
    for rid in (1, 2):
        kv.free(rid)
    assert kv.pool.n_used == 0 and kv.pool.ref == [0] * 4 and not kv.tables and kv.pool.peak_used == 4


def test_a_shared_prefix_is_found_and_held_by_both():
    kv = KVCacheManager(8, 4, prefix_caching=True)
    system = list(range(1, 9))  # two full blocks
    a = computed(kv, 0, system + [20, 21, 22])
    prefix = kv.cached_prefix(1, system + [30])
    assert prefix == Prefix(tuple(a[:2]), 8)  # both full blocks, found by their tokens
    b = kv.allocate(1, 9, prefix)
    assert b[:2] == a[:2] and b[2] not in a and [kv.pool.ref[x] for x in a] == [2, 2, 1]
    kv.free(0)
    assert [kv.pool.ref[x] for x in a] == [1, 1, 0] and kv.pool.n_used == 3  # B still holds the shared two
    assert found(kv, [9] + system) == 0  # the same tokens after another one are another prefix
    assert found(kv, system) == 4  # the whole prompt cached: its last block is computed again


def test_a_prefix_is_not_found_without_prefix_caching():
    kv = KVCacheManager(8, 4)
    computed(kv, 0, list(range(1, 10)))
    kv.free(0)
    assert kv.cached_prefix(1, list(range(1, 10))) == Prefix() and kv.pool.n_used == 0


def test_a_prefix_nobody_holds_counts_against_the_free_blocks_it_is_taken_from():
    """Three blocks: two cached (held by nobody) and one free. A request that starts from the two and needs two
    more cannot fit: the cached ones stop being free the moment it holds them."""
    kv = KVCacheManager(3, 2, prefix_caching=True)
    computed(kv, 0, [1, 2, 3, 4])
    kv.free(0)
    prefix = kv.cached_prefix(1, [1, 2, 3, 4, 5, 6, 7])
    assert prefix.n_tokens == 4 and kv.pool.n_free == 3
    assert kv.allocate(1, 8, prefix) is None and kv.cached_prefix(1, [1, 2, 3, 4, 5]) == prefix  # nothing evicted
    assert kv.allocate(1, 6, prefix) == list(prefix.blocks) + [2]


def test_cached_blocks_are_evicted_least_recently_used_first():
    kv = KVCacheManager(4, 2, prefix_caching=True)
    old, new = [1, 2, 3, 4], [5, 6, 7, 8]
    computed(kv, 0, old)
    computed(kv, 1, new)
    kv.free(0)  # the older request leaves first: its blocks are the least recently used
    kv.free(1)
    assert found(kv, old + [0]) == 4 and found(kv, new + [0]) == 4 and kv.pool.n_used == 0
    kv.allocate(2, 2)  # one block: the old prompt's last block goes first (a prefix's tail before its head)
    assert found(kv, old + [0]) == 2 and found(kv, new + [0]) == 4
    kv.allocate(2, 4)  # one more: the old prompt's first block
    assert found(kv, old + [0]) == 0 and found(kv, new + [0]) == 4


def test_a_cancelled_request_gives_its_blocks_back_at_once():
    kv = KVCacheManager(12, 2)
    jobs = [Job(Completion(id=i, prompt_ids=[1, 2, 3, 4, 5]), budget(5, 8, 48), set()) for i in range(3)]
    s = Scheduler(jobs, 2, kv, clock=lambda: 0.0)
    s.begin_step()
    work = s.schedule()
    assert [w.job.id for w in work] == [0, 1] and kv.pool.n_used == 6 and list(s.queue) == [jobs[2]]
    s.cancel(jobs[0])
    assert kv.pool.n_used == 3 and 0 not in kv.tables and jobs[0].completion.stop_reason == "interrupted"
    s.cancel(jobs[2])  # a queued one holds nothing
    assert kv.pool.n_used == 3 and not s.queue and [j.id for j in s.running] == [1]


def test_a_request_larger_than_the_pool_is_refused_naming_it():
    check_fits(5, 4, 2, 4)  # 8 positions written: two blocks
    with pytest.raises(ValueError, match=r"^its prompt \(5 tokens\) and 5 new tokens need 3 blocks of 4 positions, "
                                         r"the whole pool has 2$"):
        check_fits(5, 5, 2, 4)
    with pytest.raises(ValueError, match=r"^request 3: its prompt"):
        check_fits(5, 5, 2, 4, index=3)
