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
