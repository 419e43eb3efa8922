"""The forward's modes, read at the call site: `static` (what a compiled step traces, chosen by the engine, never
by asking torch), the `Mask` type, one `keep`, and the `Cache` both KV caches are."""

from __future__ import annotations

import pytest
import torch

import llmstep.core.attention as attention_module
from llmstep.core.attention import CAUSAL, UNMASKED, Mask, causal_mask, sdpa
from llmstep.core.config import LlamaConfig
from llmstep.core.kv_cache import Cache, KVCache
from llmstep.core.model import LAST
from llmstep.core.paged_kv import PagedKVCache, SeqChunk
from llmstep.engines.batching import BatchRunner
from llmstep.engines.fast import FastDecoder, FastSpeculator
from llmstep.lab.hardware import random_model

CONFIG = LlamaConfig(dim=64, n_layers=2, n_heads=8, n_kv_heads=2, hidden_dim=128, vocab_size=97, max_seq_len=64)
PROMPT = [[3, 14, 15, 92, 65], [35, 89, 79, 32, 38]]  # [2, 5]


@pytest.fixture(scope="module")
def model():
    return random_model(CONFIG, device="cpu", dtype=torch.float32, std=0.1)


@pytest.fixture
def routes(monkeypatch):
    """Every attention call of the model: (keys attended S, the mask's form, static)."""
    recorded, real_sdpa = [], attention_module.sdpa

    def recording(q, k, v, mask, static=False):
        form = "explicit" if mask.visible is not None else "causal" if mask.causal else "unmasked"
        recorded.append(dict(S=k.shape[2], mask=form, static=static))
        return real_sdpa(q, k, v, mask, static)

    monkeypatch.setattr(attention_module, "sdpa", recording)
    return recorded


def decode(model, rows: int, static: bool) -> list[torch.Tensor]:
    """The prompt's first `rows` rows prefilled (eagerly), then three decode steps (static or not) -> the logits."""
    cache = model.new_cache(rows, 16)
    out = [model(torch.tensor(PROMPT[:rows]), cache=cache, keep=LAST)]
    for t in range(3):
        out.append(model(torch.tensor([[7 + t]] * rows), cache=cache, keep=LAST, static=static))
    return out


@torch.no_grad()
@pytest.mark.parametrize("rows", [1, 2])
def test_the_static_forward_gives_the_eager_logits(model, rows):
    for eager, static in zip(decode(model, rows, False), decode(model, rows, True), strict=True):
        torch.testing.assert_close(static, eager, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_the_static_flag_picks_the_static_route_when_run_eagerly(model, routes):
    decode(model, 1, True)
    steps = routes[CONFIG.n_layers:]  # after the prefill: the decode steps, static
    assert len(steps) == 3 * CONFIG.n_layers
    assert all(r == dict(S=16, mask="explicit", static=True) for r in steps), steps  # every slot, masked
    del routes[:]
    decode(model, 1, False)
    assert routes[0] == dict(S=5, mask="causal", static=False)  # prefill from 0: is_causal
    assert [r["S"] for r in routes[CONFIG.n_layers::CONFIG.n_layers]] == [6, 7, 8]  # the filled slots only
    assert all(r["mask"] == "unmasked" and not r["static"] for r in routes[CONFIG.n_layers:])


@torch.no_grad()
def test_core_never_asks_torch_whether_it_is_compiling(model, routes, monkeypatch):
    """A torch that claims to be compiling changes neither the route nor the logits: the caller's flag decides."""
    expected = decode(model, 2, False)
    expected_routes = list(routes)
    del routes[:]
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    for got, want in zip(decode(model, 2, False), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert routes == expected_routes


@torch.no_grad()
def test_an_engine_sets_the_flag_with_its_compiled_step_and_its_steps_pass_it_on(model, routes):
    decoder = FastDecoder(model, max_len=16, compile=False)
    eager = decoder.generate([1, 2, 3], 4, temperature=0, stop_ids=()).tokens
    assert not decoder.static and not any(r["static"] for r in routes)
    decoder.static = True  # what a compiled decoder runs, here eagerly
    del routes[:]
    assert decoder.generate([1, 2, 3], 4, temperature=0, stop_ids=()).tokens == eager
    steps = [r for r in routes if r["static"]]
    assert len(steps) == 3 * CONFIG.n_layers and all(r["S"] == 16 and r["mask"] == "explicit" for r in steps)
    assert FastDecoder(model, max_len=16, compile=True).static  # compiled lazily: nothing compiles here
    assert BatchRunner(model, n_slots=2, max_len=16, compile=True).static
    assert FastSpeculator(model, model, k=2, max_len=16, compile=True).static


def test_a_mask_is_a_mask_or_a_bool_tensor_and_nothing_else():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 4, 16, generator=g) for h in (8, 2, 2))
    pos = torch.arange(4)[None]
    tensor = causal_mask(pos, pos)  # [1, 1, 4, 4]
    torch.testing.assert_close(sdpa(q, k, v, tensor), sdpa(q, k, v, CAUSAL))  # a bool tensor is an explicit Mask
    torch.testing.assert_close(sdpa(q, k, v, Mask(tensor)), sdpa(q, k, v, CAUSAL))
    assert not torch.allclose(sdpa(q, k, v, UNMASKED), sdpa(q, k, v, CAUSAL))
    for wrong in ("causal", None, 1):  # the old sentinels
        with pytest.raises(TypeError, match=r"Mask \(UNMASKED, CAUSAL, Mask\(visible\)\) or a bool tensor"):
            sdpa(q, k, v, wrong)
    with pytest.raises(TypeError, match=r"bool tensor \[B, 1, T, S\].*torch.float32"):
        sdpa(q, k, v, tensor.float())  # an additive float mask would silently mean something else
    with pytest.raises(TypeError, match=r"torch.bool \[4, 4\]"):
        Mask(tensor[0, 0])
    with pytest.raises(TypeError, match="causal=True"):
        Mask(tensor, causal=True)


@torch.no_grad()
def test_a_block_takes_the_notebooks_masks(model):
    """The notebooks call a block with CAUSAL and with a bool tensor from causal_mask: both are the causal block."""
    from llmstep.core.rope import rope_cos_sin

    x = torch.randn(1, 5, CONFIG.dim, generator=torch.Generator().manual_seed(1))
    positions = torch.arange(5)[None]
    cos, sin = rope_cos_sin(model.inv_freq, positions, x.dtype)
    block = model.layers[0]
    by_tensor = block(x, cos, sin, positions, causal_mask(positions, positions))
    torch.testing.assert_close(block(x, cos, sin, positions, CAUSAL), by_tensor)
    assert not torch.allclose(block(x, cos, sin, positions, UNMASKED), by_tensor)


@torch.no_grad()
def test_keep_picks_the_logits_and_last_only_is_keep_last(model):
    x = torch.tensor(PROMPT)
    full = model(x)  # [2, 5, V]
    torch.testing.assert_close(model(x, keep=LAST), full[:, -1:])
    torch.testing.assert_close(model(x, last_only=True), full[:, -1:])  # the notebooks' keyword
    torch.testing.assert_close(model(x, keep=torch.tensor([0, 3])), full[:, [0, 3]])
    with pytest.raises(TypeError, match="last_only=True is keep=LAST"):
        model(x, None, None, True)  # the old fourth argument, a bool, is not an index
    with pytest.raises(TypeError, match="with last_only"):
        model(x, keep=torch.tensor([1]), last_only=True)


class Recording(Cache):
    """A cache of the caller's own: the forward asks it only what `Cache` says."""

    def __init__(self, inner: KVCache):
        self.inner, self.batch_size, self.calls = inner, inner.batch_size, []

    def positions(self, T):
        return self.inner.positions(T)

    def mask(self, positions, static=False):
        self.calls.append("mask")
        return self.inner.mask(positions, static)

    def write(self, layer, positions, k, v, kv_len=None):
        self.calls.append("write")
        return self.inner.write(layer, positions, k, v, kv_len)

    def advance(self, positions):
        self.calls.append("advance")
        self.inner.advance(positions)


@torch.no_grad()
def test_both_caches_are_a_cache_and_the_forward_asks_nothing_else(model):
    x = torch.tensor(PROMPT[:1])
    assert isinstance(model.new_cache(1, 16), Cache) and issubclass(PagedKVCache, Cache)
    own = Recording(model.new_cache(1, 16))
    torch.testing.assert_close(model(x, cache=own), model(x, cache=model.new_cache(1, 16)), rtol=0, atol=0)
    assert own.calls == ["mask"] + ["write"] * CONFIG.n_layers + ["advance"]
    paged = PagedKVCache(CONFIG, 4, 4)
    positions = paged.plan([SeqChunk([2, 0], 0, 5)])
    torch.testing.assert_close(model(x, positions, paged), model(x), atol=1e-5, rtol=1e-5)
    with pytest.raises(TypeError, match="cache must be a llmstep KV cache.*got dict"):
        model(x, cache={})


@torch.no_grad()
def test_positions_that_would_read_or_write_the_wrong_slots_are_refused(model):
    """A cached forward's positions run one by one from 0 up (a negative one wrapped round to the last slot, over
    another token's keys); without a cache they rise along each row (the mask is by position: left padding's
    repeated positions let a token see later ones)."""
    cache = model.new_cache(2, 16)
    tokens = torch.tensor([[3, 14], [15, 92]])
    for positions, words in (([[0, 1], [-1, 0]], "row 1's position -1:"), ([[0, 2], [0, 1]], "row 0's position 2 "
                             "after 0:"), ([[0, 1], [1, 0]], "row 1's position 0 after 1:")):
        with pytest.raises(ValueError, match=f"{words} a cached forward's positions must run one by one"):
            model(tokens, torch.tensor(positions), cache)
    assert not cache.k[0].any()  # refused before any layer wrote
    with pytest.raises(ValueError, match="row 0's position 1 after 1: positions must rise along each row without"):
        model(torch.tensor([[3, 14, 15, 92, 65]]), torch.tensor([[1, 1, 0, 1, 2]]))
    rising = model(torch.tensor([[3, 14, 15]]), torch.tensor([[4, 7, 9]]))  # gaps are fine: the mask is causal
    assert rising.shape == (1, 3, CONFIG.vocab_size)


@pytest.mark.parametrize("tokens, words", [
    (torch.tensor([3, 14, 15]), r"got a 1-d int64 tensor \[3\]: one sequence is tokens\[None\]"),
    (torch.tensor([[[3]]]), r"got a 3-d int64 tensor \[1, 1, 1\]$"),
    (torch.ones(1, 3), r"got a 2-d float32 tensor \[1, 3\]"),
    (torch.ones(1, 3, dtype=torch.int16), r"got a 2-d int16 tensor \[1, 3\]"),
    (torch.ones(1, 3, dtype=torch.bool), r"got a 2-d bool tensor \[1, 3\]"),
    ([[3, 14, 15]], r"got list")])
def test_the_forward_names_tokens_that_are_no_batch_of_ids(model, tokens, words):
    with pytest.raises(TypeError, match=r"tokens must be token ids \[batch, seq\] \(an int64 or int32 tensor\), "
                       + words):
        model(tokens)
