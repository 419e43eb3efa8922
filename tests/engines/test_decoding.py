"""The rules every decode loop shares (llmstep.engines.decoding): the budget, the stop, the bytes of a step, the
result base; and that every loop keeps to them."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import make_checkpoint
from llmstep.batching import Completion, Request, run_batch
from llmstep.fast import FastDecoder, FastResult, FastSpeculativeResult, FastSpeculator

import llmstep
from llmstep.core.cost import model_step_cost
from llmstep.core.quantize import QuantConfig, quantize
from llmstep.engines.decoding import (
    CACHE_ROUNDING,
    Budget,
    DecodeResult,
    NonFiniteLogits,
    NonFiniteLogitsError,
    budget,
    cache_len,
    check_int,
    cut_at_stop,
    end_reason,
    room,
    round_bytes,
    step_bytes_by_context,
)
from llmstep.engines.drafts import LayerSkipDraft
from llmstep.engines.generate import Generation
from llmstep.engines.speculative import SpeculativeGeneration, speculative_generate


@pytest.fixture(scope="module")
def loaded(tmp_path_factory, tokenizer_file):
    """A float64 model (a batched step gives the single-row tokens exactly) with a context of 32 positions."""
    path = tmp_path_factory.mktemp("short")
    make_checkpoint(path, tokenizer_file, seed=5, max_position_embeddings=32)
    model, tok = llmstep.load(path, dtype="float32")
    return model.double(), tok


def test_a_cache_of_max_len_slots_allows_max_len_minus_the_prompt_plus_one_new_tokens():
    # the prompt takes T slots, every new token but the last is written: T + (n - 1) <= max_len
    assert room(5, 32) == 28 and room(32, 32) == 1 and room(33, 32) == 0 and room(40, 32) == 0
    assert budget(5, 10, 32) == Budget(10, "length")
    assert budget(30, 10, 32) == Budget(3, "context")
    assert budget(31, 2, 32) == Budget(2, "length")  # exactly room for max_new_tokens: the length ends it
    assert budget(31, 3, 32) == Budget(2, "context")
    assert budget(5, 0, 32) == Budget(0, "length")
    assert cache_len(5, 10, 32) == 15 and cache_len(30, 10, 32) == 32


def test_one_sizing_rule_gives_every_engines_cache():
    # a one-shot loop: the prompt and its new tokens; at least a slot past the prompt; never past the context
    assert cache_len(5, 0, 32) == 6 and cache_len(31, 5, 32) == 32
    # an engine that keeps its cache: rounded up, so nearby requests share one; never the whole context unasked
    assert CACHE_ROUNDING == 256
    assert cache_len(100, 200, 131072, rounding=CACHE_ROUNDING) == 512
    assert cache_len(131000, 200, 131072, rounding=CACHE_ROUNDING) == 131072
    assert cache_len(1, 0, 131072, rounding=CACHE_ROUNDING) == 256
    # a speculative run: k more slots, written by its rounds past the last token kept
    assert cache_len(10, 10, 1024, reserve=4) == 24 and cache_len(10, 10, 1024, reserve=4, rounding=256) == 256


def test_a_speculative_round_reads_one_target_forward_and_k_draft_steps():
    target, draft = (lambda c: 1000 + 10 * c), (lambda c: 100 + c)
    assert round_bytes(target, draft, 8, 3) == (1000 + 70) + (107 + 108 + 109)
    assert round_bytes(target, draft, 8, 0) == 1070


def test_integer_arguments_are_checked_in_one_place():
    check_int(3, "n_slots", low=1)
    for bad in (0, True, 1.0, "2", None):
        with pytest.raises(ValueError, match=f"n_slots must be an integer >= 1, got {bad!r}"):
            check_int(bad, "n_slots", low=1)
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 0, got -1"):
        check_int(-1, "max_new_tokens")


def test_non_finite_logits_are_flagged_per_request_on_the_device():
    flag = NonFiniteLogits(torch.device("cpu"), requests=4)
    logits = torch.zeros(3, 5)
    logits[1, 2] = float("nan")
    flag.update(logits, torch.tensor([0, 3, 2]))  # rows of requests 0, 3 and 2: request 3's is NaN
    flag.update(torch.full((1, 5), float("inf")), torch.tensor([1]))
    with pytest.raises(NonFiniteLogitsError, match=r"for request\(s\) 1, 3: their tokens are meaningless"):
        flag.check()
    fine = NonFiniteLogits(torch.device("cpu"), requests=2)
    fine.update(torch.zeros(2, 5), torch.tensor([0, 1]))
    fine.check()


def test_a_stop_token_ends_a_sequence_and_is_kept():
    plan = Budget(4, "length")
    assert end_reason([], {9}, plan) is None
    assert end_reason([1, 2], {9}, plan) is None
    assert end_reason([1, 9], {9}, plan) == "stop"
    assert end_reason([1, 2, 3, 9], {9}, plan) == "stop"  # a stop token on the last allowed token is a stop
    assert end_reason([1, 2, 3, 4], {9}, plan) == "length"
    assert end_reason([1, 2], set(), Budget(2, "context")) == "context"
    assert cut_at_stop([1, 9, 3, 9], {9}) == ([1, 9], True)
    assert cut_at_stop([1, 2, 3], {9}) == ([1, 2, 3], False)
    assert cut_at_stop([], {9}) == ([], False)


@pytest.mark.parametrize("spec", [None, "int8", "int4"])
def test_step_bytes_count_the_weights_once_and_equal_the_cost_model_at_every_context(loaded, spec):
    model, _ = loaded
    if spec is not None:
        model = quantize(model, QuantConfig(spec, 16 if spec == "int4" else None), inplace=False)
    for start in (0, 7):
        at = step_bytes_by_context(model, context=start)
        for c in (0, 1, 7, 30, 100):
            assert at(c) == pytest.approx(model_step_cost(model, context=c).bytes, rel=1e-12)


def test_every_loops_result_is_a_decode_result():
    for cls in (Generation, FastResult, SpeculativeGeneration, FastSpeculativeResult, Completion):
        assert issubclass(cls, DecodeResult), cls
    g = Generation(prompt_ids=[1, 2], tokens=[5, 6, 7], prefill_seconds=0.5, step_seconds=[0.25, 0.25],
                   decode_bytes=4e6)
    assert g.decode_steps == 2 and g.decode_seconds == 0.5 and g.decode_tokens_per_second == 4
    assert g.bytes_per_token == 2e6 and g.bandwidth_gb_per_second == pytest.approx(8e-3)
    assert g.prefill_tokens_per_second == 4 and "decode 2 tokens at 4.0 tok/s" in g.summary()
    f = FastResult(prompt_ids=[1], tokens=[5], decode_seconds=0.1, decode_steps=0)
    assert math.isnan(f.decode_tokens_per_second) and math.isnan(f.bandwidth_gb_per_second)  # nothing decoded
    assert "stop: " in f.summary()
    c = Completion(id=3, prompt_ids=[1], tokens=[5, 6, 7], first_token_seconds=1.0, latency_seconds=2.0)
    assert c.decode_steps == 2 and c.decode_seconds == 1.0 and c.decode_tokens_per_second == 2
    assert math.isnan(c.bytes_per_token)  # a batch step's bytes are shared: not counted per request


CASES = [  # (prompt length, max_new_tokens, cache slots): length-bound, context-bound, both at once, nothing
    (5, 10, 32), (28, 10, 32), (31, 2, 32), (31, 3, 32), (5, 0, 32),
]


@pytest.mark.parametrize(("T", "max_new_tokens", "max_len"), CASES)
def test_every_loop_ends_where_the_budget_says(loaded, T, max_new_tokens, max_len):
    """generate, FastDecoder, speculative_generate and the batcher make budget().tokens tokens and give its
    reason when no stop token comes first; FastSpeculator (a fixed k) stops at the same place or, out of room
    for a whole round, earlier, with the reason "context"."""
    model, tok = loaded
    assert model.config.max_seq_len == max_len  # generate's cache ends at the model's context
    prompt = [(7 * i) % tok.vocab_size for i in range(1, T + 1)]
    plan = budget(T, max_new_tokens, max_len)
    request = Request(prompt, max_new_tokens, temperature=0, stop_ids=[])  # one request for every loop
    runs = {
        "generate": llmstep.generate(model, tok, request),
        "FastDecoder": FastDecoder(model, max_len, compile=False).generate(request),
        "speculative_generate": speculative_generate(model, LayerSkipDraft(model, 1), tok, request, k=3),
        "batching": run_batch(model, [request], n_slots=2, max_len=max_len).completions[0],
    }
    for name, r in runs.items():
        assert (len(r.tokens), r.stop_reason) == (plan.tokens, plan.stop_reason), name
        assert r.tokens == runs["generate"].tokens, name
    out = FastSpeculator(model, LayerSkipDraft(model, 1), k=3, max_len=max_len, compile=False).generate(request)
    assert out.tokens == runs["generate"].tokens  # the rounds that no longer fit the cache: the target alone
    assert (len(out.tokens), out.stop_reason) == (plan.tokens, plan.stop_reason)


def test_every_loop_stops_at_a_stop_token_and_keeps_it(loaded):
    model, tok = loaded
    prompt = [5, 17, 101, 42, 7]
    ref = llmstep.generate(model, tok, prompt, 20, temperature=0, stop_ids=[]).tokens
    stop = ref[5]
    expected = ref[: ref.index(stop) + 1]
    request = Request(prompt, 20, temperature=0, stop_ids=[stop])
    runs = {
        "generate": llmstep.generate(model, tok, request),
        "FastDecoder": FastDecoder(model, 32, compile=False).generate(request, sync_every=3),
        "speculative_generate": speculative_generate(model, LayerSkipDraft(model, 1), tok, request, k=3),
        "FastSpeculator": FastSpeculator(model, LayerSkipDraft(model, 1), k=3, max_len=32,
                                         compile=False).generate(request),
        "batching": run_batch(model, [request], n_slots=1, max_len=32).completions[0],
    }
    for name, r in runs.items():
        assert (r.tokens, r.stop_reason) == (expected, "stop"), name


def test_the_teaching_loop_and_the_fast_loop_count_the_same_bytes(loaded):
    model, tok = loaded
    prompt = [5, 17, 101, 42, 7]
    g = llmstep.generate(model, tok, prompt, 12, temperature=0, stop_ids=[])
    f = FastDecoder(model, 32, compile=False).generate(prompt, 12, temperature=0, stop_ids=[])
    exact = sum(model_step_cost(model, context=len(prompt) + i).bytes for i in range(11))
    assert g.decode_bytes == pytest.approx(exact) and f.decode_bytes == pytest.approx(exact)


def test_a_tensor_prompt_is_one_sequence(loaded):
    model, tok = loaded
    with pytest.raises(ValueError, match=r"got shape \[2, 3\]"):
        llmstep.generate(model, tok, torch.ones(2, 3, dtype=torch.long), 4)


def test_the_summary_never_prints_nan_for_what_did_not_run():
    from llmstep.engines.generate import Generation

    nothing = Generation(prompt_ids=[1, 2, 3], stop_reason="length")
    one = Generation(prompt_ids=[1, 2, 3], tokens=[7], prefill_seconds=0.01, stop_reason="length")
    more = Generation(prompt_ids=[1, 2, 3], tokens=[7, 8, 9], prefill_seconds=0.01, step_seconds=[0.5, 0.5],
                      decode_bytes=2e6, stop_reason="stop")
    for g in (nothing, one, more):
        assert "nan" not in g.summary().lower(), g.summary()
    assert nothing.summary() == "prompt 3 tokens | 0 new tokens, no decode step | stop: length"
    assert "1 new token, no decode step" in one.summary() and "prefill 10.0 ms" in one.summary()
    assert "decode 2 tokens at 2.0 tok/s | 1.00 MB read per token, 0.00 GB/s achieved" in more.summary()


def test_the_summary_of_a_loop_that_ran_past_its_stop_says_how_many_tokens_it_kept(loaded):
    """FastDecoder checks its stop ids every sync_every steps: the steps it ran after the stop are timed (the rate
    is the loop's) and not passed off as tokens made."""
    from llmstep.fast import FastDecoder

    model, _ = loaded
    free = FastDecoder(model, compile=False).generate([1, 2], 12, temperature=0, stop_ids=()).tokens
    r = FastDecoder(model, compile=False).generate([1, 2], 12, temperature=0, stop_ids=[free[2]], sync_every=8)
    kept = len(r.tokens) - 1
    assert r.tokens == free[: free.index(free[2]) + 1] and r.decode_steps == 7 > kept  # checked before step 8
    assert f"decode 7 steps ({kept} kept: the rest came after the stop)" in r.summary()


def test_a_stop_id_outside_the_vocabulary_is_refused_by_every_loop(loaded):
    from llmstep.batching import Request, run_batch
    from llmstep.fast import FastDecoder

    model, tok = loaded
    v = model.config.vocab_size
    with pytest.raises(ValueError, match=f"stop id {v} is outside the vocabulary"):
        llmstep.generate(model, tok, "hi", 3, stop_ids=[1, v])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        FastDecoder(model, compile=False).generate([1, 2], 3, stop_ids=[v + 5], temperature=0)
    with pytest.raises(ValueError, match="request 0: stop id"):
        run_batch(model, [Request([1, 2], 3, stop_ids=[-1], temperature=0)], n_slots=1)


def test_an_unknown_compile_mode_is_refused_even_when_nothing_compiles(loaded):
    from llmstep.fast import FastDecoder

    with pytest.raises(ValueError, match="unknown torch.compile mode 'bogus'"):
        FastDecoder(loaded[0], compile=False, mode="bogus")


def test_a_negative_stop_id_is_named_with_or_without_a_vocabulary():
    from llmstep.engines.decoding import stop_id_set

    with pytest.raises(ValueError, match=r"stop id -3 is outside the vocabulary \(ids are >= 0\)"):
        stop_id_set([1, -3])
    with pytest.raises(ValueError, match=r"stop id -3 is outside the vocabulary \(0..9\)"):
        stop_id_set([1, -3], vocab_size=10)
    assert stop_id_set([0, 9], vocab_size=10) == {0, 9}


def test_a_paged_batchs_completion_leaves_its_untimed_prefill_out_of_the_summary(loaded):
    from llmstep.engines.batching import PagedBatcher, Request

    model, tok = loaded
    request = Request(tok.encode("ROMEO:"), 4, temperature=0, stop_ids=())
    done = PagedBatcher(model, n_slots=2, block_size=4).run([request])
    c = done.completions[0]
    assert c.prefill_seconds == 0 and len(c.tokens) == 4  # its prompt chunks shared steps with others' work
    assert "nan" not in c.summary().lower() and "prefill" not in c.summary(), c.summary()
    assert c.summary().startswith(f"prompt {len(c.prompt_ids)} tokens | decode 3 tokens at ")
