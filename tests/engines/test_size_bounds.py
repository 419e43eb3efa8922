"""Sizes nothing could run, refused by name before any work or allocation: more slots than a fixed paged pool could
ever run, a contiguous batcher whose step's logits cannot fit, more stop ids than the vocabulary, a prompt longer
than the context (counted before its ids are read), and chat messages whose contents alone overflow the context
(before the template renders them)."""

from __future__ import annotations

import pytest
import torch
from llmstep.batching import ContinuousBatcher, PagedBatcher, Request

from llmstep.core import cost
from llmstep.engines import batching
from llmstep.engines.decoding import check_prompt_ids, encode_prompt, stop_id_set
from llmstep.engines.session import PagedSession

GREEDY = dict(temperature=0, stop_ids=())


def test_more_slots_than_a_fixed_pool_could_run_are_refused_by_name(tiny64):
    model, _ = tiny64
    with pytest.raises(ValueError, match=r"n_slots 1,000,000,000: a pool of 64 blocks runs at most 64 sequences"):
        PagedBatcher(model, n_slots=10**9, kv_blocks=64)  # was accepted, then a MemoryError in run()
    with pytest.raises(ValueError, match=rf"n_slots 1,000,000: .* give at most {batching.SLOTS_PAST_POOL:,} slots"):
        PagedSession(model, n_slots=10**6, block_size=4, n_blocks=64)  # was a list of 10**6 slots
    with pytest.raises(ValueError, match="n_slots 1,025: a pool of 64 blocks"):
        PagedBatcher(model, n_slots=batching.SLOTS_PAST_POOL + 1, block_size=4, kv_blocks=64)
    # a few slots past the blocks run as before (one sequence at a time), and a pool as large as its slots is taken
    run = PagedBatcher(model, n_slots=8, block_size=4, kv_blocks=2).run([Request([1, 2], 3, **GREEDY)] * 2)
    assert [len(c.tokens) for c in run.completions] == [3, 3] and len(run.timeline[0]) == 8
    assert PagedBatcher(model, n_slots=2000, block_size=4, kv_blocks=2000).n_slots == 2000


def test_a_contiguous_batcher_counts_its_steps_logits_before_allocating(tiny64, monkeypatch):
    model, _ = tiny64
    n = 1000
    kv = cost.kv_cache_bytes(batching.cache_config(model), n, 1, model.dtype)
    logits = n * model.config.vocab_size * 4  # float32
    monkeypatch.setattr(cost, "free_memory_bytes", lambda device: kv + logits // 2)  # the cache fits, not the step
    with pytest.raises(cost.MemoryBudgetError, match=r"n_slots 1,000: .* decode step's logits \(1,000 x "):
        ContinuousBatcher(model, n_slots=n, max_len=1)
    monkeypatch.undo()
    assert ContinuousBatcher(model, n_slots=2, max_len=8).n_slots == 2


def test_more_stop_ids_than_the_vocabulary_are_refused_before_they_are_read():
    for many in (range(10**6), iter(range(10**6)), torch.arange(10**6), list(range(301))):
        with pytest.raises(ValueError, match=r"stop_ids holds (1,000,000|301) ids, more than the vocabulary's 300"):
            stop_id_set(many, 300)
    assert stop_id_set(range(300), 300) == set(range(300))  # every token once: still a stop set
    assert stop_id_set(iter([3, 3, 5]), 300) == {3, 5}


def test_a_prompt_longer_than_the_context_is_refused_before_its_ids_are_read():
    with pytest.raises(ValueError, match="the prompt is 1000 tokens, but the model's context is 48"):
        check_prompt_ids([10**9] * 1000, 300, 48)  # its length first, not its (bad) ids

    def ids():  # a one-shot iterator: read no further than the context and one more
        for i in range(10**4):
            assert i <= 48, "read past the context"
            yield 5
    with pytest.raises(ValueError, match="the prompt is 49 tokens, but the model's context is 48"):
        check_prompt_ids(ids(), 300, 48)
    with pytest.raises(ValueError, match="the prompt is 1000 tokens"):
        check_prompt_ids(torch.full((1000,), 10**9), 300, 48)
    assert check_prompt_ids(iter([1, 2, 3]), 300, 48) == [1, 2, 3]


def test_chat_messages_far_past_the_context_are_refused_before_rendering(tiny64, monkeypatch):
    _, tok = tiny64
    text = "ROMEO: what light through yonder window breaks. " * 100
    real = tok.encode_chat
    monkeypatch.setattr(tok, "encode_chat", lambda *a, **k: pytest.fail("the messages were rendered"))
    with pytest.raises(ValueError, match=r"the chat messages' contents are [\d,]+ bytes, at least [\d,]+ tokens: more "
                                         "than the 48 there is room for"):
        encode_prompt(tok, [{"role": "system", "content": "be brief"}, {"role": "user", "content": text}], 48)
    monkeypatch.setattr(tok, "encode_chat", real)
    short = [{"role": "user", "content": "  hi  "}]
    assert encode_prompt(tok, short, 48) == tok.encode_chat(short)  # what fits is encoded as before
    with pytest.raises(ValueError, match="the prompt is"):  # within the bound, yet too long once tokenized: as before
        encode_prompt(tok, [{"role": "user", "content": "ab " * 40}], 48)
