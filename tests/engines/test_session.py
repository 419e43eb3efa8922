"""PagedSession: the paged batcher one engine step at a time. Requests submitted while others run get the tokens
they get alone (greedy and seeded, with prefix caching, chunked prefill and preemption in a small pool); a
cancelled one frees its blocks at once and the others go on; bad requests are refused at submit."""

from __future__ import annotations

import contextlib
import itertools

import pytest
from llmstep.batching import Request
from test_paged_batching import check_blocks, solo, workload

from llmstep.engines.session import PagedSession


@contextlib.contextmanager
def nan_rows(session, bad_ids: set[int]):
    """While it holds, the rows of `bad_ids`' requests in each of the session's forwards turn NaN after the first
    block: every later layer's keys and values, and their logits."""
    model, forward, rows = session.model, session.runner.forward, []

    def breaking(work):  # the bad requests' rows of this forward's packed tokens, for the hook
        starts = itertools.accumulate([s.chunk.n_tokens for s in work], initial=0)
        rows[:] = [i for start, s in zip(starts, work, strict=False) if s.job.id in bad_ids
                   for i in range(start, start + s.chunk.n_tokens)]
        try:
            return forward(work)
        finally:
            rows.clear()

    def hook(module, args, out):
        if not rows:
            return out
        out = out.clone()
        out[:, rows] = float("nan")
        return out

    session.runner.forward = breaking
    handle = model.layers[0].register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()
        session.runner.forward = forward


@pytest.mark.parametrize("options", [dict(block_size=4), dict(block_size=4, prefill_chunk=5),
                                     dict(n_blocks=9, block_size=4)],
                         ids=["whole-prompts", "chunked-prefill", "small-pool-preempts"])
def test_requests_submitted_while_others_run_get_their_solo_tokens(tiny64, options):
    model, tok = tiny64
    requests = workload(tok.vocab_size, n=8, shared=9)  # a shared system prompt: prefix-cache hits
    session = PagedSession(model, n_slots=4, **options)
    made, ids, step = {}, {}, 0
    while len(ids) < len(requests) or session.pending:
        for i, r in enumerate(requests):
            if r.arrival == step:
                ids[session.submit(r)] = i
        for out in session.step():
            made.setdefault(ids[out.id], []).append(out.token)
        check_blocks(session.scheduler)
        step += 1
    assert [made[i] for i in range(len(requests))] == [solo(model, tok, r).tokens for r in requests]
    assert session.blocks.n_used == 0 and session.scheduler.run.timeline == []  # no per-step record kept
    if "n_blocks" in options:
        assert session.stats["preemptions"] > 0
    else:
        assert session.stats["prefix_hit_tokens"] > 0


def test_a_cancelled_request_frees_its_blocks_and_the_others_go_on(tiny64):
    model, tok = tiny64
    session = PagedSession(model, n_slots=4, block_size=4)
    keep = Request([5, 6, 7], max_new_tokens=12, temperature=0, stop_ids=())
    # the dropped request greedy and never stopping early: a fresh seed could sample an end token and finish it before
    # the cancel (CI saw it once: its blocks already freed)
    drop = session.submit(Request(list(range(20, 33)), max_new_tokens=30, temperature=0, stop_ids=()))
    kept = session.submit(keep)
    tokens = []
    for _ in range(3):
        tokens += [o.token for o in session.step() if o.id == kept]
    used = session.blocks.n_used
    session.cancel(drop)
    assert session.blocks.n_used < used and session.pending == 1
    while session.pending:
        out = session.step()
        assert all(o.id == kept for o in out)
        tokens += [o.token for o in out]
    assert tokens == solo(model, tok, keep).tokens and session.blocks.n_used == 0
    session.cancel(drop)  # already gone: nothing happens


def test_a_bad_request_is_refused_at_submit_and_a_closed_session_steps_no_more(tiny64):
    model, tok = tiny64
    session = PagedSession(model, n_slots=2, block_size=4, n_blocks=3)
    with pytest.raises(ValueError, match="temperature"):
        session.submit(Request([1, 2], temperature=-1))
    with pytest.raises(ValueError, match="the whole pool has 3"):
        session.submit(Request([1, 2, 3], max_new_tokens=20))
    assert session.pending == 0 and session.step() == []
    session.submit(Request([1, 2], max_new_tokens=5))
    session.close()
    assert session.pending == 0
    with pytest.raises(RuntimeError, match="closed"):
        session.step()


def test_a_closed_session_refuses_a_submitted_request_as_it_refuses_a_step(tiny64):
    model, _ = tiny64
    session = PagedSession(model, n_slots=2, block_size=4, n_blocks=3)
    session.close()
    with pytest.raises(RuntimeError, match="this PagedSession is closed"):
        session.submit(Request([1, 2], max_new_tokens=5))
    assert session.pending == 0



@pytest.mark.parametrize("when", ["prefill", "decode"])
def test_a_request_whose_logits_break_ends_with_an_error_and_the_others_go_on(tiny64, when):
    """Non-finite logits on one input alone (an fp16 overflow, say) end that request (finish_reason "error", no
    token shown, its blocks freed); the others get their solo tokens and the session stays usable."""
    model, tok = tiny64
    requests = [Request([5, 6, 7], max_new_tokens=6, temperature=0, stop_ids=()),
                Request([9, 10, 3, 4], max_new_tokens=6, temperature=0.8, seed=1, stop_ids=()),
                Request([11, 12], max_new_tokens=6, temperature=0.9, seed=3, stop_ids=())]
    expected = [solo(model, tok, r).tokens for r in requests]
    session = PagedSession(model, n_slots=4, block_size=4)
    ids = [session.submit(r) for r in requests]
    forward = session.runner.forward

    def breaking(work):  # NaN in the broken request's row: at its prompt's forward, or at its first decode step
        logits = forward(work)  # [K, vocab]: the chunks that sample, in order
        for k, s in enumerate([s for s in work if s.samples]):
            if s.job.id == ids[1] and (s.chunk.start == 0) == (when == "prefill"):
                logits[k, 7] = float("nan")
        return logits

    session.runner.forward = breaking
    made: dict[int, list] = {i: [] for i in ids}
    reasons = {}
    while session.pending:
        for out in session.step():
            made[out.id] += [out.token] if out.token >= 0 else []
            reasons[out.id] = out.finish_reason
        check_blocks(session.scheduler)
    assert reasons == {ids[0]: "length", ids[1]: "error", ids[2]: "length"}
    assert made[ids[1]] == ([] if when == "prefill" else expected[1][:1])  # nothing drawn from NaN is shown
    assert [made[ids[0]], made[ids[2]]] == [expected[0], expected[2]]
    assert session.blocks.n_used == 0
    session.runner.forward = forward
    again = session.submit(requests[1])  # the session goes on: the request itself was fine
    tokens = []
    while session.pending:
        tokens += [o.token for o in session.step() if o.id == again]
    assert tokens == expected[1]


def test_a_nan_in_one_sequences_keys_leaves_no_poisoned_block_for_a_later_request(tiny64):
    """NaN hidden states (so keys and values) in one request's rows: it ends with "error"; the paged cache keeps
    its NaN from the other request's prompt in the shared forward, and the blocks that step registered in the prefix
    cache are forgotten besides: a later request with that prompt gets its solo tokens, not a cached NaN."""
    model, tok = tiny64
    good = Request(list(range(20, 28)) + [5], max_new_tokens=3, temperature=0, stop_ids=())  # two full blocks
    bad = Request([40, 41, 42], max_new_tokens=3, temperature=0, stop_ids=())
    session = PagedSession(model, n_slots=4, block_size=4, prefix_caching=True)
    ids = [session.submit(good), session.submit(bad)]
    reasons = {}
    with nan_rows(session, {ids[1]}):
        while session.pending:
            reasons |= {o.id: o.finish_reason for o in session.step() if o.finish_reason}
    assert reasons[ids[1]] == "error"
    again = session.submit(good)
    tokens = []
    while session.pending:
        tokens += [o.token for o in session.step() if o.id == again and o.token >= 0]
    assert tokens == solo(model, tok, good).tokens and session.blocks.n_used == 0


def test_a_request_mid_prompt_beside_a_broken_one_starts_over_and_caches_no_nan(tiny64):
    """A request whose prompt chunk shared the broken forward has no logits to tell whether it took NaN keys (the
    paged cache keeps them from it; this is the second guard): it starts over, and later requests with its prompt
    get solo tokens."""
    model, tok = tiny64
    bad = Request([40, 41, 42], max_new_tokens=3, temperature=0, stop_ids=())
    prompt = Request(list(range(10, 20)), max_new_tokens=3, temperature=0, stop_ids=())
    session = PagedSession(model, n_slots=4, block_size=2, prefix_caching=True, prefill_chunk=2)
    bad_ids = set()
    with nan_rows(session, bad_ids):
        bad_ids.add(session.submit(bad))
        session.step()  # the bad prompt's first chunk
        mid = session.submit(prompt)
        assert [(o.id, o.finish_reason) for o in session.step()] == [(min(bad_ids), "error")]  # mid: one token
        assert session.stats["preemptions"] == 1  # the request mid-prompt starts over
        session.step()
        session.cancel(mid)  # a client gone: what it registered stays cached
    expected = solo(model, tok, prompt).tokens
    for _ in range(2):  # the first finds what `mid` left cached, the second what the first did
        again = session.submit(prompt)
        made = []
        while session.pending:
            made += [(o.token, o.finish_reason) for o in session.step() if o.id == again]
        assert [t for t, _ in made] == expected and made[-1][1] == "length"
    assert session.blocks.n_used == 0


def test_a_second_thread_driving_a_session_is_refused_and_the_first_ones_tokens_stand(tiny64):
    """One thread drives a session (submit, step, cancel): another thread's call while a step runs is refused
    (before, two threads stepping at once got a raw shape error and wrong tokens)."""
    from two_threads import run_two_threads

    from llmstep.engines.decoding import ConcurrentUseError

    model, tok = tiny64
    request = Request([5, 6, 7], max_new_tokens=4, temperature=0, stop_ids=())
    session = PagedSession(model, n_slots=2, block_size=4)
    first = session.submit(request)

    def other() -> list[str]:
        refused = []
        for call in (session.step, lambda: session.submit(request), lambda: session.cancel(first)):
            try:
                call()
            except ConcurrentUseError as e:
                refused.append(str(e))
        return refused

    made, refused = run_two_threads(model, session.step, other)
    assert len(refused) == 3 and "being driven by another thread" in refused[0]
    while session.pending:
        made += session.step()
    assert [o.token for o in made if o.id == first] == solo(model, tok, request).tokens
