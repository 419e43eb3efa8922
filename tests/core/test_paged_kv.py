"""The paged KV cache alone: the block pool's bookkeeping (reference counts, prefix keys, LRU eviction), and
the flattened forward through block tables equal to each sequence's own forward (and to the by-hand gather)."""

from __future__ import annotations

import pytest
import torch

from llmstep.core.attention import sdpa
from llmstep.core.config import LlamaConfig
from llmstep.core.paged_kv import (
    BlockPool,
    PagedKVCache,
    SeqChunk,
    attend_by_hand,
    block_key,
    blocks_for,
    gather_blocks,
)
from llmstep.lab.hardware import random_model

CONFIG = LlamaConfig(dim=64, n_layers=2, n_heads=8, n_kv_heads=2, hidden_dim=128, vocab_size=97, max_seq_len=64)


@pytest.fixture(scope="module")
def model64():
    return random_model(CONFIG, device="cpu", dtype=torch.float32, std=0.1).double()


def test_blocks_for_counts_the_partial_block():
    assert [blocks_for(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_block_keys_chain_the_whole_prefix():
    a = block_key(None, [1, 2, 3, 4])
    assert a == block_key(None, [1, 2, 3, 4]) and a != block_key(None, [1, 2, 3, 5])
    assert block_key(a, [5, 6, 7, 8]) != block_key(block_key(None, [9, 2, 3, 4]), [5, 6, 7, 8])  # other past
    assert block_key(None, [1, 23]) != block_key(None, [12, 3])  # ids are separated


def test_allocate_and_release_return_every_block():
    m = BlockPool(3, 4)
    blocks = [m.allocate() for _ in range(3)]
    assert sorted(blocks) == [0, 1, 2] and m.n_free == 0 and m.n_used == 3 and m.peak_used == 3
    with pytest.raises(RuntimeError, match="pool is empty"):
        m.allocate()
    m.release(blocks)
    assert m.n_free == 3 and m.ref == [0, 0, 0] and not m.cached


def test_prefix_cache_shares_holds_and_evicts_least_recently_used_first():
    m = BlockPool(4, 2, prefix_caching=True)
    k1 = block_key(None, [1, 2])
    k2 = block_key(k1, [3, 4])
    a = [m.allocate(), m.allocate()]
    m.register(a[0], k1)
    m.register(a[1], k2)
    assert m.cached_prefix([k1, k2, block_key(k2, [5, 6])]) == a  # the longest cached prefix
    m.hold(a)  # a second sequence shares both
    assert [m.ref[b] for b in a] == [2, 2]
    m.release(a)
    m.release(a)  # both gone: cached, reference 0, evictable, still found
    assert m.n_free == 4 and m.cached_prefix([k1, k2]) == a and list(m.evictable) == [a[1], a[0]]
    assert m.can_allocate(2, holding=a) and not m.can_allocate(3, holding=a)  # held, they are no longer free
    fresh = [m.allocate(), m.allocate()]  # the never-used blocks go first
    assert set(fresh).isdisjoint(a) and m.cached_prefix([k1, k2]) == a
    evicted = m.allocate()  # then the least recently used cached block: the tail of the prefix
    assert evicted == a[1] and m.cached_prefix([k1, k2]) == a[:1] and k2 not in m.cached
    assert m.n_free == 1 and list(m.evictable) == [a[0]]
    m.hold(a[:1])  # held again: not evictable
    assert m.n_free == 0 and not m.evictable and m.ref[a[0]] == 1


def test_without_prefix_caching_nothing_is_found_or_kept():
    m = BlockPool(2, 2)
    b = m.allocate()
    m.register(b, block_key(None, [1, 2]))
    assert m.cached_prefix([block_key(None, [1, 2])]) == []
    m.release([b])
    assert m.n_free == 2 and not m.evictable


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, None])
def test_a_pool_needs_positive_integer_sizes(bad):
    with pytest.raises(ValueError, match="kv_blocks"):
        BlockPool(bad, 4)
    with pytest.raises(ValueError, match="block_size"):
        PagedKVCache(CONFIG, 4, bad)


@torch.no_grad()
def test_one_flattened_forward_equals_each_sequence_alone(model64):
    """Sequence A: a 7-token prompt in two chunks (5 now, after 0 cached); B: decoding its 10th token after a
    9-token prefill, in blocks scattered over the pool. Both in one forward [1, 5 + 1]: each sequence's
    logits equal its own contiguous forward."""
    torch.manual_seed(0)
    a, b = torch.randint(0, 97, (7,)).tolist(), torch.randint(0, 97, (10,)).tolist()
    cache = PagedKVCache(CONFIG, 8, 4, dtype=torch.float64)
    ta, tb = [6, 1], [3, 7, 0]  # block tables: any blocks, in any order
    positions = cache.plan([SeqChunk(tb, 0, 9)])
    model64(torch.tensor([b[:9]]), positions, cache)  # B's prompt
    positions = cache.plan([SeqChunk(ta, 0, 5), SeqChunk(tb, 9, 1)])
    assert positions.tolist() == [[0, 1, 2, 3, 4, 9]]
    logits = model64(torch.tensor([a[:5] + b[9:]]), positions, cache)[0]  # [6, vocab]
    alone_a = model64(torch.tensor([a[:5]]))[0]
    alone_b = model64(torch.tensor([b]))[0, -1]
    torch.testing.assert_close(logits[:5], alone_a, rtol=0, atol=1e-12)
    torch.testing.assert_close(logits[5], alone_b, rtol=0, atol=1e-12)
    positions = cache.plan([SeqChunk(ta, 5, 2)])  # A's second chunk reads its first through the table
    last = model64(torch.tensor([a[5:]]), positions, cache, keep=torch.tensor([1]))[0, 0]
    torch.testing.assert_close(last, model64(torch.tensor([a]))[0, -1], rtol=0, atol=1e-12)


def test_the_gather_by_hand_equals_the_package_path():
    """Keys written through write() into scattered blocks, read back block by block and attended one
    sequence at a time: the same numbers as the flattened gather and one masked SDPA."""
    torch.manual_seed(1)
    cfg = CONFIG
    cache = PagedKVCache(cfg, 6, 4, dtype=torch.float64)
    tables, lengths = [[4, 0, 2], [5, 1]], [10, 6]
    positions = cache.plan([SeqChunk(t, 0, n) for t, n in zip(tables, lengths, strict=True)])  # [1, 16]
    N, hd = sum(lengths), cfg.head_dim
    q = torch.randn(1, cfg.n_heads, N, hd, dtype=torch.float64)
    k, v = (torch.randn(1, cfg.n_kv_heads, N, hd, dtype=torch.float64) for _ in range(2))
    k_all, v_all = cache.write(0, positions, k, v)
    mask, kv_len = cache.mask(positions)
    assert kv_len is None and mask.visible.shape == (1, 1, N, N)
    fast = sdpa(q, k_all, v_all, mask)[0]  # [n_heads, N, hd]
    start = 0
    for table, n in zip(tables, lengths, strict=True):
        torch.testing.assert_close(gather_blocks(cache.k[0], table, n, 4), k[0, :, start:start + n], rtol=0, atol=0)
        by_hand = attend_by_hand(q[0, :, start:start + n], cache.k[0], cache.v[0], table, torch.arange(n), 4)
        # the textbook `attention` takes its softmax in float32: equal to float32's rounding
        torch.testing.assert_close(fast[:, start:start + n], by_hand, rtol=0, atol=1e-6)
        start += n


def test_a_forward_must_follow_its_plan_and_a_plan_needs_its_blocks(model64):
    cache = PagedKVCache(CONFIG, 4, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="call plan"):
        model64(torch.tensor([[1, 2]]), torch.tensor([[0, 1]]), cache)
    with pytest.raises(ValueError, match="explicit|plan"):
        model64(torch.tensor([[1, 2]]), cache=cache)
    with pytest.raises(ValueError, match="chunk 1: 3 tokens from position 4 need 2 blocks, its table has 1"):
        cache.plan([SeqChunk([0], 0, 2), SeqChunk([1], 4, 3)])
    with pytest.raises(ValueError, match="chunk 0: starts at position -2"):
        cache.plan([SeqChunk([0, 1], -2, 3)])
    for table in ([7], [-1], [0, 4]):
        with pytest.raises(ValueError, match=f"chunk 0: its table names block {table[-1]}; this pool's blocks are 0"):
            cache.plan([SeqChunk(table, 0, 1)])
    positions = cache.plan([SeqChunk([0], 0, 2)])
    with pytest.raises(ValueError, match="planned layout"):
        model64(torch.tensor([[1, 2, 3]]), torch.tensor([[0, 1, 2]]), cache)
    assert model64(torch.tensor([[1, 2]]), positions, cache).shape == (1, 2, CONFIG.vocab_size)


def test_a_plan_lays_out_each_sequences_slots_and_mask_position_by_position():
    """The plan's tensors against the layout written one position at a time: slot of position p = its block's
    first slot + p mod block_size; each query sees its own sequence's keys up to its position."""
    cache = PagedKVCache(CONFIG, 10, 4, dtype=torch.float64)
    chunks = [SeqChunk([5, 3, 9], 7, 4), SeqChunk([1], 0, 3), SeqChunk([2, 4, 0], 8, 1), SeqChunk([8, 0, 6, 7], 9, 6)]
    positions = cache.plan(chunks)
    write, read, mask = cache._plan

    def slot(table, p):
        return table[p // 4] * 4 + p % 4

    assert positions.tolist() == [[p for c in chunks for p in range(c.start, c.start + c.n_tokens)]]
    assert write.tolist() == [slot(c.table, p) for c in chunks for p in range(c.start, c.start + c.n_tokens)]
    assert read.tolist() == [slot(c.table, p) for c in chunks for p in range(c.start + c.n_tokens)]
    keys = [(s, p) for s, c in enumerate(chunks) for p in range(c.start + c.n_tokens)]
    queries = [(s, p) for s, c in enumerate(chunks) for p in range(c.start, c.start + c.n_tokens)]
    assert mask.tolist() == [[[[ks == qs and kp <= qp for ks, kp in keys] for qs, qp in queries]]]
    with pytest.raises(ValueError, match="at least one chunk"):
        cache.plan([])


def test_a_forward_whose_mask_and_scores_cannot_fit_is_refused_before_they_are_built(monkeypatch):
    """A 30,000-token prompt in one piece asked for a 7.2 GB mask in one layer and died in the allocator."""
    from llmstep.core import cost

    config = LlamaConfig(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=64, hidden_dim=128,
                         max_seq_len=8192)
    cache = PagedKVCache(config, n_blocks=512, block_size=16)
    monkeypatch.setattr(cost, "free_memory_bytes", lambda device: 5 * 10**8)
    table = list(range(512))
    with pytest.raises(cost.MemoryBudgetError, match=r"the attention of a paged forward of 8,192 tokens over 8,192 "
                                                     r"keys .*prefill_chunk computes a long prompt in parts"):
        cache.plan([SeqChunk(table, 0, 8192)])  # 8192**2 x (1 + 2 x (1 + 4)) bytes: 0.74 GB
    cache.plan([SeqChunk(table, 0, 4096)])  # 4096**2 x 11 bytes: 0.18 GB
