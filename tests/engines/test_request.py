"""One request, every engine (llmstep.engines.request): the same Request and nothing else gives the same tokens,
ending at the same place, in generate, stream, FastDecoder, the batchers (contiguous and paged) and, greedy, the
speculative loops; the defaults are one set, and a request is checked once, in one place."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import make_checkpoint
from llmstep.batching import ContinuousBatcher, run_batch
from llmstep.fast import FastDecoder, FastSpeculator

import llmstep
from llmstep.engines.drafts import LayerSkipDraft
from llmstep.engines.request import Request, as_request, check_request, end_ids
from llmstep.engines.speculative import speculative_generate, speculative_stream


def every_engine(model, tok, request: Request, speculative: bool = True) -> dict[str, tuple[list[int], str]]:
    """What each engine makes of `request`, built with nothing but the model (and the tokenizer, or a draft,
    where the engine needs one): (tokens, stop_reason) by engine name."""
    s = llmstep.stream(model, tok, request)
    streamed = [e.id for e in s]
    runs = {
        "generate": llmstep.generate(model, tok, request),
        "stream": s.result,
        "FastDecoder": FastDecoder(model).generate(request),
        "ContinuousBatcher": run_batch(model, [request]).completions[0],
        "PagedBatcher": run_batch(model, [request], kv="paged").completions[0],
    }
    if speculative:
        runs["speculative_generate"] = speculative_generate(model, LayerSkipDraft(model, 1), tok, request)
        runs["FastSpeculator"] = FastSpeculator(model, LayerSkipDraft(model, 1)).generate(request)
        sp = speculative_stream(model, LayerSkipDraft(model, 1), tok, request)
        assert [e.id for e in sp] == sp.result.tokens
    assert streamed == s.result.tokens
    return {name: (r.tokens, r.stop_reason) for name, r in runs.items()}


def assert_all_equal(runs: dict) -> None:
    first_name, first = next(iter(runs.items()))
    for name, run in runs.items():
        assert run == first, f"{name} differs from {first_name}: {run} != {first}"


@pytest.fixture(scope="module")
def shipped():
    return llmstep.load()


@pytest.fixture(scope="module")
def small(tmp_path_factory, tokenizer_file):
    path = tmp_path_factory.mktemp("one-request")
    make_checkpoint(path, tokenizer_file, seed=3)
    return llmstep.load(path, dtype="float32")


def test_the_shipped_model_gives_every_engine_the_same_tokens_greedy(shipped):
    model, tok = shipped
    runs = every_engine(model, tok, Request(tok.encode("ROMEO:"), 16, temperature=0))
    assert_all_equal(runs)
    assert len(runs["generate"][0]) > 1


def test_the_shipped_model_gives_every_engine_the_same_draws_seeded(shipped):
    """Seeded sampling at the defaults (temperature 1.0, no filter, the model's end tokens): one draw per token
    from the request's own generator in every plain engine. The speculative loops use their random numbers
    differently (speculative.py: the same distribution, another sample), so they are not compared here."""
    model, tok = shipped
    assert_all_equal(every_engine(model, tok, Request(tok.encode("ROMEO:"), 16, seed=11), speculative=False))


def with_end_token(model, end: int):
    """The model, now declaring `end` as its end token (as its generation_config.json would)."""
    model.generation_config = dict(model.generation_config, eos_token_id=end)
    return model


@pytest.mark.parametrize("seed", [None, 4])  # None: greedy
def test_a_model_whose_end_token_comes_early_stops_there_in_every_engine(small, seed):
    """The end token the model declares is made at its sixth token: every engine stops there, by default."""
    model, tok = small
    sampling = dict(temperature=0) if seed is None else dict(seed=seed)
    prompt = [295, 17, 101, 42, 7]
    free = llmstep.generate(model, tok, Request(prompt, 40, stop_ids=(), **sampling)).tokens
    end = next(t for i, t in enumerate(free) if i >= 5 and t not in free[:i])  # its first appearance
    saved = model.generation_config
    try:
        with_end_token(model, end)
        runs = every_engine(model, tok, Request(prompt, 40, **sampling), speculative=seed is None)
    finally:
        model.generation_config = saved
    assert_all_equal(runs)
    assert runs["generate"] == (free[: free.index(end) + 1], "stop")  # kept as the last token


def test_one_set_of_defaults_and_keyword_calls_are_the_request():
    r = Request([1, 2])
    assert (r.max_new_tokens, r.temperature, r.top_k, r.top_p, r.seed, r.stop_ids) == (128, 1.0, 0, 1.0, None, None)
    assert as_request([1, 2], max_new_tokens=5, temperature=None, stop_ids=()) == Request([1, 2], 5, stop_ids=())
    assert as_request(r, seed=3) == dataclasses.replace(r, seed=3)  # a keyword sets the request's field


def test_keyword_calls_give_what_the_request_gives(small):
    model, tok = small
    request = Request([295, 17, 101], 12, temperature=0.8, top_k=20, seed=2, stop_ids=())
    decoder = FastDecoder(model)
    assert (decoder.generate([295, 17, 101], 12, temperature=0.8, top_k=20, seed=2, stop_ids=()).tokens
            == decoder.generate(request).tokens
            == llmstep.generate(model, tok, [295, 17, 101], 12, 0.8, 20, seed=2, stop_ids=()).tokens)


def test_the_end_tokens_are_the_models_then_the_tokenizers(small):
    model, tok = small
    assert end_ids(model) == model.config.eos_token_id == [296]
    saved = model.generation_config
    try:
        model.generation_config = {"eos_token_id": [5, 6]}
        assert end_ids(model, tok) == [5, 6]  # generation_config.json first
        model.generation_config = {"eos_token_id": None}
        assert end_ids(model, tok) == tok.eos_ids  # a model that declares none: the tokenizer's, where there is one
        assert end_ids(model) == []
    finally:
        model.generation_config = saved


@pytest.mark.parametrize(("field", "value", "match"), [
    ("max_new_tokens", True, "max_new_tokens must be an integer >= 0"),
    ("temperature", -1.0, "temperature must be a finite number >= 0"),
    ("top_k", 2.5, "top_k must be an integer >= 0"),
    ("top_p", 0, "top_p must be in"),
    ("seed", 1.5, "seed must be an integer"),
    ("stop_ids", "eos", "stop_ids must be a collection of token ids"),
    ("arrival", -1, "arrival must be an engine step"),
    ("prompt_ids", [], "the prompt is empty"),
])
def test_a_bad_field_is_refused_by_every_engine_with_the_same_message(small, field, value, match):
    model, tok = small
    bad = dataclasses.replace(Request([1, 2], 4), **{field: value})
    with pytest.raises(ValueError, match=match):
        check_request(bad, model)
    with pytest.raises(ValueError, match=match):
        llmstep.generate(model, tok, bad)
    with pytest.raises(ValueError, match=match):
        FastDecoder(model).generate(bad)
    with pytest.raises(ValueError, match=match):
        FastSpeculator(model, LayerSkipDraft(model, 1)).generate(bad)
    with pytest.raises(ValueError, match="request 0: " + match):
        ContinuousBatcher(model).run([bad])
    with pytest.raises(ValueError, match="request 0: " + match):
        run_batch(model, [bad], kv="paged")


def test_a_request_is_read_once_so_a_one_shot_stop_iterator_works(small):
    model, tok = small
    free = FastDecoder(model).generate([1, 2, 3], 10, temperature=0, stop_ids=()).tokens
    r = FastDecoder(model).generate(Request([1, 2, 3], 10, temperature=0, stop_ids=iter([free[4]])))
    assert r.tokens == free[: free.index(free[4]) + 1] and r.stop_reason == "stop"


def test_run_batch_refuses_a_bad_policy_or_request_before_a_cache_is_allocated(small, monkeypatch):
    """The batcher's cache would be allocated, then the run refused: both are checked first."""
    model, _ = small
    import llmstep.engines.batching as batching

    def never(*args, **kwargs):
        raise AssertionError("a batcher was built for a run that is refused")

    monkeypatch.setattr(batching, "make_batcher", never)
    with pytest.raises(ValueError, match="unknown batching policy 'fifo'"):
        run_batch(model, [Request([1, 2, 3], 4)], policy="fifo")
    with pytest.raises(ValueError, match="request 1: temperature must be"):
        run_batch(model, [Request([1, 2, 3], 4), Request([1, 2], 4, temperature=-1)])
    monkeypatch.undo()
    free = FastDecoder(model).generate([1, 2, 3], 10, temperature=0, stop_ids=()).tokens
    done = run_batch(model, [Request([1, 2, 3], 10, temperature=0, stop_ids=iter([free[4]]))]).completions[0]
    assert done.tokens == free[: free.index(free[4]) + 1]  # a one-shot stop iterator, read once, still works


def test_seeds_that_differ_above_32_bits_draw_differently_on_a_cpu(shipped):
    """torch's CPU generator keeps a seed's low 32 bits: llmstep mixes larger seeds down (generator_seed), so 5,
    5 + 2**32 and 5 + 2**40 are three seeds; below 2**32 a seed is itself (the draws every record was made with)."""
    import torch

    from llmstep.engines.request import generator_seed

    model, tok = shipped
    runs = [llmstep.generate(model, tok, "ROMEO:", max_new_tokens=8, seed=s, stop_ids=()).tokens
            for s in (5, 5 + 2**32, 5 + 2**40)]
    assert len({tuple(r) for r in runs}) == 3
    cpu = torch.device("cpu")
    assert generator_seed(5, cpu) == 5 and generator_seed(2**32 - 1, cpu) == 2**32 - 1
    mixed = [generator_seed(s, cpu) for s in (2**32, 2**32 + 1, 2**63, 2**64 - 1)]
    assert all(0 <= m < 2**32 for m in mixed) and len(set(mixed)) == 4
    assert generator_seed(5 + 2**40, torch.device("meta")) == 5 + 2**40  # another device's generator keeps 64 bits
    g = check_request(Request([1], 1, seed=5 + 2**40), model).generator(cpu)
    assert g.initial_seed() == generator_seed(5 + 2**40, cpu)


def test_one_shot_prompt_and_stop_iterators_and_a_request_listed_twice_give_every_copy_the_same(small):
    """A batcher checks each request more than once and a request may be listed twice: its iterators are read
    once, into one settled copy, so each copy gets what `generate` gives the request alone."""
    model, tok = small
    free = FastDecoder(model).generate([1, 2, 3], 10, temperature=0, stop_ids=()).tokens
    alone = llmstep.generate(model, tok, Request([1, 2, 3], 10, temperature=0, stop_ids=[free[4]]))
    for kv in ("contiguous", "paged"):
        r = Request(iter([1, 2, 3]), 10, temperature=0, stop_ids=iter([free[4]]))
        run = run_batch(model, [r, r], kv=kv)
        assert [(c.tokens, c.stop_reason) for c in run.completions] == [(alone.tokens, "stop")] * 2, kv
        r = Request(iter([1, 2, 3]), 10, temperature=0, stop_ids=iter([free[4]]))
        run = ContinuousBatcher(model, n_slots=2).run([r, r])
        assert [c.tokens for c in run.completions] == [alone.tokens] * 2


def test_prompt_ids_are_checked_against_the_models_vocabulary_with_a_tokenizer_or_without(small):
    """The embedding reads the ids: an engine with a tokenizer takes the ids an engine without one takes."""
    import copy
    import dataclasses as dc

    model, tok = small
    padded = dc.replace(model.config, vocab_size=tok.vocab_size + 8)
    wide = llmstep.Llama(padded).eval().requires_grad_(False)  # 8 rows the tokenizer does not name
    with pytest.raises(ValueError, match="larger than its tokenizer's"):  # unless they are padding, as load says
        llmstep.generate(wide, tok, [1, 2], max_new_tokens=3)
    tok = copy.copy(tok)
    tok.padded_vocab_size = padded.vocab_size  # what llmstep.load sets from config.json
    pad_id = tok.vocab_size + 3
    with_tok = llmstep.generate(wide, tok, [1, pad_id], max_new_tokens=3, temperature=0, stop_ids=())
    assert with_tok.tokens == FastDecoder(wide).generate([1, pad_id], 3, temperature=0, stop_ids=()).tokens
    with pytest.raises(ValueError, match=rf"prompt token id {tok.vocab_size + 8} is outside the vocabulary "
                                         rf"\(size {tok.vocab_size + 8}\)"):
        llmstep.generate(wide, tok, [1, tok.vocab_size + 8], max_new_tokens=3)
    narrow_config = dc.replace(model.config, vocab_size=tok.vocab_size - 4, bos_token_id=None, eos_token_id=None)
    narrow = llmstep.Llama(narrow_config).eval().requires_grad_(False)
    with pytest.raises(ValueError, match=rf"prompt token id {tok.vocab_size - 2} is outside the vocabulary "
                                         rf"\(size {tok.vocab_size - 4}\)"):  # refused, not an IndexError later
        llmstep.generate(narrow, tok, [1, tok.vocab_size - 2], max_new_tokens=3, stop_ids=())


def test_greedy_is_one_sampling_setting_whatever_top_k_and_top_p_and_numbers_may_be_fractions(small):
    from fractions import Fraction

    from llmstep.engines.request import sampling_key

    model, tok = small
    assert sampling_key(0, 5, 0.3) == sampling_key(0.0, None, 1.0) == (0.0, 0, 1.0)
    assert sampling_key(Fraction(1, 2), 3, Fraction(9, 10)) == (0.5, 3, 0.9)
    decoder = FastDecoder(model)
    runs = [decoder.generate([1, 2, 3], 6, temperature=0, top_k=k, top_p=p, stop_ids=()).tokens
            for k, p in ((0, 1.0), (5, 0.3), (40, 0.9))]
    assert runs[0] == runs[1] == runs[2] and list(decoder._advances) == [(0.0, 0, 1.0)]  # one greedy step
    kw = dict(max_new_tokens=6, seed=2, stop_ids=())
    assert (llmstep.generate(model, tok, [1, 2, 3], temperature=Fraction(1, 2), top_p=Fraction(9, 10), **kw).tokens
            == llmstep.generate(model, tok, [1, 2, 3], temperature=0.5, top_p=0.9, **kw).tokens)


def test_the_fast_decoders_noise_is_float32_whatever_the_default_dtype(small):
    """Its seeded draws are `generate`'s: Exp(1) noise in float32, as `draw` makes it next to float32 probs."""
    import torch

    model, tok = small
    expected = llmstep.generate(model, tok, [1, 2, 3], max_new_tokens=8, seed=4, stop_ids=()).tokens
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        decoder = FastDecoder(model)
        got = decoder.generate([1, 2, 3], 8, temperature=1.0, seed=4, stop_ids=()).tokens
    finally:
        torch.set_default_dtype(before)
    assert got == expected
    assert decoder._noise.dtype == torch.float32  # the same tokens could come from float64 draws of the same bits


def test_a_prompt_array_of_no_sequence_or_of_strings_is_refused_by_name(small):
    import numpy as np
    import torch

    from llmstep.engines.decoding import check_prompt_ids

    with pytest.raises(ValueError, match=r"one sequence, \[T\] or \[1, T\]; got shape \[\]"):
        check_prompt_ids(torch.tensor(5), 300, 64)  # a plain 5 is refused too: one id is [5]
    with pytest.raises(ValueError, match="a prompt array must hold integer token ids, got one of dtype <U1"):
        check_prompt_ids(np.array(["a", "b"]), 300, 64)
    assert check_prompt_ids(np.array([[4, 5]]), 300, 64) == [4, 5]
    model, tok = small
    with pytest.raises(ValueError, match="got shape \\[\\]"):
        llmstep.generate(model, tok, torch.tensor(5), max_new_tokens=2)


def test_a_tensor_parallel_model_samples_only_with_a_seed(shipped):
    """Each rank draws from its own generator: without one seed the ranks pick different tokens, and their next
    all-reduce sums the activations of different sequences (or hangs on different lengths)."""
    from llmstep.core import parallel

    model, tok = shipped
    tp = parallel.build_rank_model(model.config, parallel.split(model.config, 0, 1), model.state_dict())
    with pytest.raises(ValueError, match="tensor-parallel model's ranks draw the same tokens only with one seed"):
        check_request(Request([1, 2, 3], max_new_tokens=2, temperature=0.5), tp)
    with pytest.raises(ValueError, match="only with one seed"):
        run_batch(tp, [Request([1, 2, 3], max_new_tokens=2)], n_slots=1)
    assert check_request(Request([1, 2, 3], max_new_tokens=2, temperature=0.5, seed=7), tp).seed == 7
    assert check_request(Request([1, 2, 3], max_new_tokens=2, temperature=0), tp).greedy  # nothing drawn
