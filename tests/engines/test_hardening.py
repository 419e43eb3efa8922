"""What the engines refuse and report: wrong types at the public boundary (once, by name), non-finite logits
(raised by the teaching loops at their step, reported by the fast loops and the batcher at the end), and a
decoder, speculator or batcher used from two threads at once."""

from __future__ import annotations

import copy

import pytest
import torch
from two_threads import run_two_threads

import llmstep
from llmstep.core.sampling import check_params
from llmstep.engines.batching import ContinuousBatcher, Request
from llmstep.engines.decoding import ConcurrentUseError, NonFiniteLogitsError, check_seed
from llmstep.engines.drafts import LayerSkipDraft
from llmstep.engines.fast import FastDecoder, FastSpeculator
from llmstep.engines.speculative import speculative_generate

GREEDY = dict(temperature=0, stop_ids=())  # greedy, never stopping early: what these runs ask for

PROMPT = [295, 17, 101, 42, 7, 250, 33]


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    return llmstep.load(tiny_checkpoint, device="cpu", dtype=torch.float32)


# ---- types at the boundary ------------------------------------------------------------------------

def test_a_bytes_prompt_is_refused_not_read_as_token_ids(tiny):
    model, tok = tiny
    with pytest.raises(ValueError, match="the prompt is bytes"):
        llmstep.generate(model, tok, b"thy", max_new_tokens=2)
    with pytest.raises(ValueError, match="prompt must be text, token ids"):
        FastDecoder(model, max_len=16, compile=False).generate(b"thy", 2, **GREEDY)


@pytest.mark.parametrize("prompt, words", [("thy", r"not text: .*tokenizer first \(tokenizer.encode\)"),
                                            ([{"role": "user", "content": "thy"}],
                                             r"not chat messages: .*tokenizer first \(tokenizer.encode_chat")])
def test_engines_without_a_tokenizer_say_text_and_messages_must_be_encoded_first(tiny, prompt, words):
    model, tok = tiny
    engines = {"FastDecoder": lambda: FastDecoder(model, max_len=16, compile=False).generate(prompt, 2, **GREEDY),
               "FastSpeculator": lambda: FastSpeculator(model, LayerSkipDraft(model, 1), k=2, max_len=16,
                                                        compile=False).generate(prompt, 2, **GREEDY),
               "batcher": lambda: ContinuousBatcher(model, 2, max_len=16, compile=False).run([Request(prompt, 2)])}
    for name, run in engines.items():
        with pytest.raises(ValueError, match=r"this takes token ids \(an engine without a tokenizer, .*\), " + words):
            run()
            pytest.fail(f"{name} took the prompt")
    assert len(llmstep.generate(model, tok, prompt, max_new_tokens=2, **GREEDY).tokens) == 2  # with a tokenizer


@pytest.mark.parametrize("seed", [1.5, "42", True, -1, 2**64, 2**70])
def test_a_seed_that_is_not_a_64_bit_integer_is_refused_by_name_before_any_work(tiny, seed):
    model, tok = tiny
    with pytest.raises(ValueError, match="seed must be"):
        llmstep.stream(model, tok, "thy", max_new_tokens=2, seed=seed)  # raised before the first token
    with pytest.raises(ValueError, match="seed must be"):
        speculative_generate(model, LayerSkipDraft(model, 1), tok, "thy", k=2, max_new_tokens=2, seed=seed)
    with pytest.raises(ValueError, match="seed must be"):
        FastDecoder(model, max_len=16, compile=False).generate(PROMPT, 2, seed=seed, **GREEDY)


def test_numpy_and_large_valid_seeds_are_accepted():
    np = pytest.importorskip("numpy")
    for seed in (None, 0, 2**64 - 1, np.int64(7)):
        check_seed(seed)


@pytest.mark.parametrize("kw, name", [(dict(temperature=True), "temperature"), (dict(temperature="0.7"), "temperature"),
                                      (dict(top_p="0.9"), "top_p"), (dict(top_p=True), "top_p"),
                                      (dict(top_k=2.0), "top_k"), (dict(temperature=float("nan")), "temperature")])
def test_sampling_parameters_of_the_wrong_type_are_refused_by_name(tiny, kw, name):
    with pytest.raises(ValueError, match=f"^{name} must be"):
        check_params(**kw)
    model, tok = tiny
    with pytest.raises(ValueError, match=f"^{name} must be"):
        llmstep.generate(model, tok, "thy", max_new_tokens=2, **kw)


def test_a_lone_surrogate_in_the_prompt_is_a_clear_value_error(tiny):
    model, tok = tiny
    with pytest.raises(ValueError, match="lone surrogate"):
        llmstep.generate(model, tok, "thy \udc80 brow", max_new_tokens=2)


@pytest.mark.parametrize("flag, value", [("compile", "no"), ("compile", 0), ("fuse", "false"), ("fuse", 1)])
def test_compile_and_fuse_take_true_false_or_none_only(tiny, flag, value):
    """"no" is truthy: it would compile (minutes on a CPU) or fuse against the caller's word."""
    model, _ = tiny
    engines = [lambda **kw: FastDecoder(model, max_len=16, **kw),
               lambda **kw: FastSpeculator(model, LayerSkipDraft(model, 1), k=2, max_len=16, **kw)]
    if flag == "compile":
        engines.append(lambda **kw: ContinuousBatcher(model, n_slots=2, max_len=16, **kw))
    for make in engines:
        with pytest.raises(ValueError, match=f"{flag} must be True, False or None, got {value!r}"):
            make(**{flag: value})


def test_fast_decoder_refuses_sync_every_0_and_speculation_refuses_empty_verify_costs(tiny):
    model, tok = tiny
    with pytest.raises(ValueError, match="sync_every must be an integer >= 1"):
        FastDecoder(model, max_len=16, compile=False).generate(PROMPT, 4, stop_ids=[1], sync_every=0, temperature=0)
    with pytest.raises(ValueError, match="verify_costs must be a non-empty list"):
        speculative_generate(model, LayerSkipDraft(model, 1), tok, "thy", k=2, max_new_tokens=4, adaptive=True,
                             verify_costs=[])


@pytest.mark.parametrize("kv", ["contiguous", "paged"])
def test_a_batcher_given_one_request_or_no_list_says_to_pass_a_list(tiny, kv):
    from llmstep.engines.batching import Request, make_batcher

    batcher = make_batcher(tiny[0], 2, 32 if kv == "contiguous" else None, None, kv)
    for bad, also in ((Request([1, 2, 3], 2), r"one request: pass \[request\]"), ("thy", ""), (7, "")):
        with pytest.raises(ValueError, match=f"requests must be a list of Request objects, got {type(bad).__name__}"
                                             f".*{also}"):
            batcher.run(bad)
    assert len(batcher.run(r for r in [Request([1, 2, 3], 2)]).completions) == 1  # any iterable of them


def test_a_prompt_that_fills_the_context_gets_its_one_new_token_from_every_engine(tiny):
    """The last token sampled is never written (decoding.budget): max_len slots hold a prompt of max_len tokens and
    one new token, the next token plain decoding gives, ended by the context; one token more is refused."""
    from llmstep.engines.batching import Request, make_batcher
    from llmstep.engines.drafts import LayerSkipDraft
    from llmstep.engines.fast import FastSpeculator

    model, tok = tiny
    ids = (tok.encode("ROMEO: thy brow, " * 20, bos=False))[:24]
    assert len(ids) == 24
    want = llmstep.generate(model, tok, ids, max_new_tokens=3, temperature=0).tokens[:1]
    got = {"fast": FastDecoder(model, max_len=24, compile=False).generate(ids, 3, temperature=0),
           "speculator": FastSpeculator(model, LayerSkipDraft(model, 1), k=2, max_len=24, compile=False).generate(
               ids, 3, temperature=0)}
    for name, r in got.items():
        assert (r.tokens, r.stop_reason) == (want, "context"), name
    [c] = make_batcher(model, 2, 24, None, "contiguous").run([Request(ids, 3, temperature=0)]).completions
    assert (c.tokens, c.stop_reason) == (want, "context")
    with pytest.raises(ValueError, match="the prompt is 25 tokens, but the cache it may fill is 24"):
        FastDecoder(model, max_len=24, compile=False).generate([*ids, ids[0]], 3, temperature=0)


def test_speculation_costs_must_be_finite_numbers(tiny):
    import numpy as np

    from llmstep.engines.speculative import check_costs

    check_costs(np.float32(0.3), [np.float64(1.0), 2])  # numpy's numbers are numbers
    for ratio, costs, match in ((float("inf"), None, "cost_ratio"), (float("nan"), None, "cost_ratio"),
                                (True, None, "cost_ratio"), (None, [True], "verify_costs"),
                                (None, [float("inf")], "verify_costs"), (None, [1.0, 0.0], "verify_costs")):
        with pytest.raises(ValueError, match=f"{match} must be"):
            check_costs(ratio, costs)


def test_a_batch_with_one_bad_seed_late_in_the_list_is_refused_up_front_with_its_index(tiny):
    model, _ = tiny
    batcher = ContinuousBatcher(model, n_slots=2, max_len=32, compile=False)
    calls = []
    handle = model.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        requests = [Request(PROMPT, 3, seed=i, **GREEDY) for i in range(5)] + [
            Request(PROMPT, 3, seed=2**70, arrival=9)]
        with pytest.raises(ValueError, match=r"request 5: seed must be in 0 \.\. 2\*\*64 - 1"):
            batcher.run(requests)
    finally:
        handle.remove()
    assert calls == []  # nothing ran: no partial results
    assert [len(c.tokens) for c in batcher.run(requests[:5]).completions] == [3] * 5  # the batcher is unharmed


# ---- non-finite logits ----------------------------------------------------------------------------

def nan_after(model, calls: int):
    """Make the LM head's output NaN from its (calls+1)-th call on; returns the hook's handle."""
    seen = []

    def hook(module, args, out):
        seen.append(1)
        return out if len(seen) <= calls else torch.full_like(out, float("nan"))

    return model.output.register_forward_hook(hook)


def test_the_teaching_loop_raises_at_the_step_whose_logits_are_nan(tiny):
    model, tok = tiny
    handle = nan_after(model, 3)
    try:
        s = llmstep.stream(model, tok, PROMPT, max_new_tokens=10, stop_ids=[])
        got = []
        with pytest.raises(NonFiniteLogitsError, match="non-finite logits .* at step 3"):
            for event in s:
                got.append(event.id)
        assert len(got) == 3  # the tokens before it, never a run of token 0
    finally:
        handle.remove()


def test_every_loop_reports_nan_weights_instead_of_token_0(tiny):
    model, tok = tiny
    broken = copy.deepcopy(model)
    with torch.no_grad():
        broken.norm.weight[0] = float("nan")
    draft = LayerSkipDraft(broken, 1)
    with pytest.raises(NonFiniteLogitsError, match="at step 0"):
        llmstep.generate(broken, tok, "thy", max_new_tokens=5)
    with pytest.raises(NonFiniteLogitsError, match="at step 0"):
        speculative_generate(broken, draft, tok, "thy", k=2, max_new_tokens=5)
    with pytest.raises(NonFiniteLogitsError, match="in a run of"):
        FastDecoder(broken, max_len=32, compile=False).generate(PROMPT, 8, temperature=0.8, seed=0, stop_ids=())
    for temperature in (0.0, 0.8):
        with pytest.raises(NonFiniteLogitsError, match="in a run of"):
            FastSpeculator(broken, draft, k=2, max_len=32, compile=False).generate(PROMPT, 8, temperature, seed=0,
                                                                                   stop_ids=())
    requests = [Request(PROMPT, 4, **GREEDY), Request(PROMPT[:3], 4, temperature=0.5, seed=1, stop_ids=())]
    with pytest.raises(NonFiniteLogitsError, match=r"request\(s\) 0, 1"):
        ContinuousBatcher(broken, n_slots=2, max_len=32, compile=False).run(requests)


def test_nan_logits_late_in_a_fast_run_are_reported_at_its_end(tiny):
    model, _ = tiny
    decoder = FastDecoder(model, max_len=32, compile=False)
    handle = nan_after(model, 5)
    try:
        with pytest.raises(NonFiniteLogitsError, match="in a run of 10 tokens"):
            decoder.generate(PROMPT, 10, **GREEDY)
    finally:
        handle.remove()
    assert len(decoder.generate(PROMPT, 10, **GREEDY).tokens) == 10  # the decoder itself is fine afterwards


# ---- one run at a time ----------------------------------------------------------------------------

def test_a_shared_fast_decoder_refuses_a_second_thread_and_the_first_keeps_its_tokens(tiny):
    model, _ = tiny
    decoder = FastDecoder(model, max_len=32, compile=False)
    alone = decoder.generate(PROMPT, 12, **GREEDY).tokens
    first, second = run_two_threads(model, lambda: decoder.generate(PROMPT, 12, **GREEDY),
                                    lambda: decoder.generate(list(reversed(PROMPT)), 12, **GREEDY))
    assert isinstance(second, ConcurrentUseError) and "already running" in str(second)
    assert first.tokens == alone


def test_a_shared_speculator_and_batcher_refuse_a_second_thread(tiny):
    model, _ = tiny
    spec = FastSpeculator(model, LayerSkipDraft(model, 1), k=2, max_len=32, compile=False)
    alone = spec.generate(PROMPT, 10, **GREEDY).tokens
    first, second = run_two_threads(model, lambda: spec.generate(PROMPT, 10, **GREEDY),
                                    lambda: spec.generate(PROMPT, 10, **GREEDY))
    assert isinstance(second, ConcurrentUseError) and first.tokens == alone
    batcher = ContinuousBatcher(model, n_slots=2, max_len=32, compile=False)
    requests = [Request(PROMPT, 6, **GREEDY), Request(PROMPT[:4], 6, **GREEDY)]
    alone = [c.tokens for c in batcher.run(requests).completions]
    first, second = run_two_threads(model, lambda: batcher.run(requests), lambda: batcher.run(requests))
    assert isinstance(second, ConcurrentUseError) and [c.tokens for c in first.completions] == alone


def test_a_warmup_or_step_from_a_second_thread_is_refused_not_run_over_the_first_ones_tokens(tiny):
    """warmup resets the cache and the run's state, and FastDecoder.step writes the cache: from another thread
    while an engine runs they are refused as a second run is, and the run's tokens are its tokens alone."""
    model, _ = tiny
    decoder = FastDecoder(model, max_len=64, compile=False)
    alone = decoder.generate(PROMPT, 12, **GREEDY).tokens
    zero = torch.zeros(1, 1, dtype=torch.long)
    for second in (lambda: decoder.warmup(temperature=0.5), lambda: decoder.step(zero, zero)):
        first, refused = run_two_threads(model, lambda: decoder.generate(PROMPT, 12, **GREEDY), second)
        assert isinstance(refused, ConcurrentUseError) and first.tokens == alone
    spec = FastSpeculator(model, LayerSkipDraft(model, 1), k=2, max_len=32, compile=False)
    alone = spec.generate(PROMPT, 10, **GREEDY).tokens
    first, refused = run_two_threads(model, lambda: spec.generate(PROMPT, 10, **GREEDY), lambda: spec.warmup(False))
    assert isinstance(refused, ConcurrentUseError) and first.tokens == alone
    batcher = ContinuousBatcher(model, n_slots=2, max_len=32, compile=False)
    requests = [Request(PROMPT, 6, **GREEDY), Request(PROMPT[:4], 6, **GREEDY)]
    alone = [c.tokens for c in batcher.run(requests).completions]
    first, refused = run_two_threads(model, lambda: batcher.run(requests), batcher.warmup)
    assert isinstance(refused, ConcurrentUseError) and [c.tokens for c in first.completions] == alone
    two = torch.zeros(2, 1, dtype=torch.long)  # the runner's own forwards write its cache too
    for second in (lambda: batcher.step(two, two), lambda: batcher.prefill(1, PROMPT[:3]),
                   lambda: batcher.decode([(5, 3), None])):
        first, refused = run_two_threads(model, lambda: batcher.run(requests), second)
        assert isinstance(refused, ConcurrentUseError) and [c.tokens for c in first.completions] == alone
    assert batcher.decode([(5, 3), None]).shape == (2, model.config.vocab_size)  # alone: fine
    assert decoder.warmup() == 0.0 and decoder.step(zero, zero).shape == (1, model.config.vocab_size)  # alone: fine


def test_generate_on_one_model_from_two_threads_is_fine(tiny):
    model, tok = tiny
    alone = llmstep.generate(model, tok, PROMPT, max_new_tokens=8, temperature=0).tokens
    first, second = run_two_threads(model, lambda: llmstep.generate(model, tok, PROMPT, 8, temperature=0),
                                    lambda: llmstep.generate(model, tok, PROMPT, 8, temperature=0))
    assert first.tokens == second.tokens == alone


def test_a_stream_broken_off_says_it_was_interrupted(tiny):
    model, tok = tiny
    s = llmstep.stream(model, tok, PROMPT, max_new_tokens=10, stop_ids=[])
    for event in s:
        if event.index == 2:
            break
    assert s.result.stop_reason == "interrupted" and len(s.result.tokens) == 3
    done = llmstep.stream(model, tok, PROMPT, max_new_tokens=3, stop_ids=[])
    list(done)
    assert done.result.stop_reason == "length"


@pytest.mark.parametrize("max_len", [0, 1, 10**12, 2.5, True, "16"])
def test_a_static_cache_size_outside_the_models_context_is_refused_before_it_is_allocated(tiny, max_len):
    model, _ = tiny
    with pytest.raises(ValueError, match=r"max_len must be an integer in 2\.\.128"):
        FastDecoder(model, max_len=max_len, compile=False)
    if max_len != 1:  # a batch runner may time a step at position 0 in a 1-slot cache
        with pytest.raises(ValueError, match=r"max_len must be an integer in 1\.\.128"):
            ContinuousBatcher(model, n_slots=2, max_len=max_len, compile=False)


def test_a_speculative_stream_broken_off_says_it_was_interrupted(tiny):
    model, tok = tiny
    s = llmstep.speculative_stream(model, LayerSkipDraft(model, 1), tok, PROMPT, k=2, max_new_tokens=10, stop_ids=[])
    for event in s:
        if event.index == 1:
            break
    assert s.result.stop_reason == "interrupted"


# ---- a refused request leaves an engine as it was ----------------------------------------------------

@pytest.fixture(scope="module")
def long_context(tmp_path_factory, tokenizer_file):
    """A model with 600 positions: a cache sized per request starts at 256 slots and can grow."""
    from conftest import make_checkpoint

    path = tmp_path_factory.mktemp("ctx600")
    make_checkpoint(path, tokenizer_file, seed=5, max_position_embeddings=600)
    return llmstep.load(path, device="cpu", dtype=torch.float32)


@pytest.mark.parametrize("engine", ["decoder", "speculator"])
def test_a_request_refused_for_memory_leaves_the_engine_as_it_was(long_context, monkeypatch, engine):
    from llmstep.core import cost

    model, tok = long_context
    fast = FastDecoder(model, compile=False) if engine == "decoder" else \
        FastSpeculator(model, LayerSkipDraft(model, 1), k=2, compile=False)
    short = fast.generate(PROMPT, 8, temperature=0, stop_ids=()).tokens
    long_prompt = (PROMPT * 40)[:250]  # with 8 new tokens: 258 slots, past the first cache's 256
    monkeypatch.setattr(cost, "free_memory_bytes", lambda device: 1)  # the next cache cannot be had
    with pytest.raises(cost.MemoryBudgetError):
        fast.generate(long_prompt, 8, temperature=0, stop_ids=())
    monkeypatch.undo()
    assert fast.generate(PROMPT, 8, temperature=0, stop_ids=()).tokens == short  # the old cache still serves
    # and, now that memory allows, the longer request grows it
    long = fast.generate(long_prompt, 8, temperature=0, stop_ids=()).tokens
    assert long == llmstep.generate(model, tok, long_prompt, max_new_tokens=8, temperature=0.0, stop_ids=()).tokens
