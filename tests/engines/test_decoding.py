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
    Budget,
    DecodeResult,
    budget,
    cache_len,
    cut_at_stop,
    end_reason,
    room,
    step_bytes_by_context,
)
from llmstep.engines.generate import Generation
from llmstep.engines.speculative import LayerSkipDraft, SpeculativeGeneration, speculative_generate


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
    runs = {
        "generate": llmstep.generate(model, tok, prompt, max_new_tokens, temperature=0, stop_ids=[]),
        "FastDecoder": FastDecoder(model, max_len, compile=False).generate(prompt, max_new_tokens),
        "speculative_generate": speculative_generate(model, LayerSkipDraft(model, 1), tok, prompt, k=3,
                                                     max_new_tokens=max_new_tokens, temperature=0, stop_ids=[]),
        "batching": run_batch(model, [Request(prompt, max_new_tokens)], n_slots=2, max_len=max_len).completions[0],
    }
    for name, r in runs.items():
        assert (len(r.tokens), r.stop_reason) == (plan.tokens, plan.stop_reason), name
        assert r.tokens == runs["generate"].tokens, name
    out = FastSpeculator(model, LayerSkipDraft(model, 1), k=3, max_len=max_len, compile=False).generate(
        prompt, max_new_tokens)
    assert out.tokens == runs["generate"].tokens[: len(out.tokens)]
    assert (len(out.tokens), out.stop_reason) == (plan.tokens, plan.stop_reason) or (
        out.stop_reason == "context" and len(out.tokens) > plan.tokens - 4)  # a round of k=3 makes up to 4


def test_every_loop_stops_at_a_stop_token_and_keeps_it(loaded):
    model, tok = loaded
    prompt = [5, 17, 101, 42, 7]
    ref = llmstep.generate(model, tok, prompt, 20, temperature=0, stop_ids=[]).tokens
    stop = ref[5]
    expected = ref[: ref.index(stop) + 1]
    runs = {
        "generate": llmstep.generate(model, tok, prompt, 20, temperature=0, stop_ids=[stop]),
        "FastDecoder": FastDecoder(model, 32, compile=False).generate(prompt, 20, stop_ids=[stop], sync_every=3),
        "speculative_generate": speculative_generate(model, LayerSkipDraft(model, 1), tok, prompt, k=3,
                                                     max_new_tokens=20, temperature=0, stop_ids=[stop]),
        "FastSpeculator": FastSpeculator(model, LayerSkipDraft(model, 1), k=3, max_len=32,
                                         compile=False).generate(prompt, 20, stop_ids=[stop]),
        "batching": run_batch(model, [Request(prompt, 20, stop_ids=[stop])], n_slots=1, max_len=32).completions[0],
    }
    for name, r in runs.items():
        assert (r.tokens, r.stop_reason) == (expected, "stop"), name


def test_the_teaching_loop_and_the_fast_loop_count_the_same_bytes(loaded):
    model, tok = loaded
    prompt = [5, 17, 101, 42, 7]
    g = llmstep.generate(model, tok, prompt, 12, temperature=0, stop_ids=[])
    f = FastDecoder(model, 32, compile=False).generate(prompt, 12)
    exact = sum(model_step_cost(model, context=len(prompt) + i).bytes for i in range(11))
    assert g.decode_bytes == pytest.approx(exact) and f.decode_bytes == pytest.approx(exact)


def test_a_tensor_prompt_is_one_sequence(loaded):
    model, tok = loaded
    with pytest.raises(ValueError, match=r"got shape \[2, 3\]"):
        llmstep.generate(model, tok, torch.ones(2, 3, dtype=torch.long), 4)
