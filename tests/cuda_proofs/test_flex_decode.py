"""Issue 25, item 4: a compiled decode step attends over the filled cache only (FlexAttention with a block mask made
from the positions in the step), exactly as the masked SDPA over every slot does, and never reads the blocks past
the filled ones: proven on the CPU, where FlexAttention compiles too (inductor's C++ template honours the block
mask as the CUDA kernel does). On CUDA it is the default ("auto"); here it is asked for ("flex")."""

from __future__ import annotations

import warnings

import pytest
import torch

from llmstep.core import attention
from llmstep.core.attention import FLEX_BLOCK, Mask, causal_mask, flex_decode, sdpa
from llmstep.core.attention_backend import attention_backend, describe
from llmstep.core.attention_backend import flex_decode as flex_wanted
from llmstep.core.config import LlamaConfig
from llmstep.engines.fast import FastDecoder
from llmstep.lab.hardware import random_model

S = 4 * FLEX_BLOCK  # a static cache of four blocks


def qkv(B: int, n_heads: int, n_kv: int, hd: int = 32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, n_heads, 1, hd, generator=g), torch.randn(B, n_kv, S, hd, generator=g),
            torch.randn(B, n_kv, S, hd, generator=g))


def masked(last: torch.Tensor) -> Mask:
    """The static step's mask for one query a row at positions `last` [B]: every slot, the unfilled ones hidden."""
    return Mask(causal_mask(last[:, None], torch.arange(S)), last=last)


@pytest.fixture(scope="module")
def compiled_flex():
    return torch.compile(flex_decode, fullgraph=True, dynamic=False)  # one graph: no break, no host sync


@pytest.mark.parametrize("heads", [(8, 2), (4, 4), (8, 1)], ids=["GQA", "MHA", "MQA"])
def test_flex_decode_equals_the_masked_attention_over_every_slot(compiled_flex, heads):
    q, k, v = qkv(3, *heads)
    for last in ([0, 127, 128], [255, 256, S - 1], [5, 300, 511]):  # block edges and inside blocks, rows apart
        last = torch.tensor(last)
        ref = sdpa(q, k, v, Mask(masked(last).visible))  # today's path: SDPA with the mask
        torch.testing.assert_close(compiled_flex(q, k, v, last), ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(attention.attention(q, k, v, masked(last).visible), ref, rtol=1e-5, atol=1e-5)


def test_flex_decode_never_reads_the_blocks_past_the_filled_ones(compiled_flex):
    """NaN in every block after a row's last filled one: the masked SDPA reads those slots (0 * NaN is NaN in its
    weighted sum), FlexAttention never visits them, so its output is the clean cache's."""
    q, k, v = qkv(2, 8, 2)
    last = torch.tensor([130, 7])  # row 0 fills blocks 0-1, row 1 block 0
    dirty_k, dirty_v = k.clone(), v.clone()
    for b, end in enumerate((2 * FLEX_BLOCK, FLEX_BLOCK)):
        dirty_k[b, :, end:] = float("nan")
        dirty_v[b, :, end:] = float("nan")
    clean = compiled_flex(q, k, v, last)
    assert sdpa(q, dirty_k, dirty_v, Mask(masked(last).visible)).isnan().all()  # what reading every slot costs
    torch.testing.assert_close(compiled_flex(q, dirty_k, dirty_v, last), clean, rtol=0, atol=0)


def test_a_static_decode_step_takes_flex_on_cuda_by_default_and_on_a_cpu_when_asked(monkeypatch):
    assert flex_wanted(torch.device("cuda")) and not flex_wanted(torch.device("cpu"))
    with attention_backend("flex"):
        assert flex_wanted(torch.device("cpu")) and describe("cpu")["decode_step"] == "flex"
    with attention_backend("math"):  # naming an SDPA kernel: SDPA everywhere
        assert not flex_wanted(torch.device("cuda")) and describe("cuda")["decode_step"] == "sdpa"
    calls = []
    monkeypatch.setattr(attention, "flex_decode", lambda q, k, v, last: calls.append(last.tolist()) or
                        torch.zeros_like(q))
    q, k, v = qkv(1, 8, 2)
    last = torch.tensor([40])
    with attention_backend("flex"):
        sdpa(q, k, v, masked(last), static=True)
        sdpa(q, k, v, masked(last), static=False)  # an eager step reads the filled slots only already
        sdpa(q, k[:, :, :200], v[:, :, :200], Mask(masked(last).visible[..., :200], last=last), static=True)
    sdpa(q, k, v, masked(last), static=True)  # auto on a CPU: the plain-op path
    assert calls == [[40]]  # only the static step over whole blocks


def test_the_model_decodes_the_same_logits_and_tokens_through_flex():
    config = LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=128, vocab_size=300,
                         max_seq_len=256)
    model = random_model(config, device="cpu", dtype=torch.float32, std=0.5)  # sharp logits: greedy is stable
    prompt = [5, 17, 101, 42, 7]
    eager = FastDecoder(model, max_len=256, compile=False).generate(prompt, 20, temperature=0, stop_ids=[])
    decoder = FastDecoder(model, max_len=256, compile=False)
    decoder.static = True  # the compiled loop's forward, run eagerly: FlexAttention's reference implementation
    calls = []
    original = attention.flex_decode
    with warnings.catch_warnings(), attention_backend("flex"):
        warnings.simplefilter("ignore")  # FlexAttention warns that it runs unfused outside torch.compile
        attention.flex_decode = lambda *a: calls.append(1) or original(*a)
        try:
            out = decoder.generate(prompt, 20, temperature=0, stop_ids=[])
        finally:
            attention.flex_decode = original
    assert out.tokens == eager.tokens, (out.tokens, eager.tokens)
    assert len(calls) >= 19 * 2 and len(calls) % 2 == 0, len(calls)  # every decode step (and warm-up), every layer


@pytest.mark.skipif(not __import__("os").environ.get("LLMSTEP_SLOW_TESTS"),
                    reason="torch.compile on the CPU takes ~40 s; set LLMSTEP_SLOW_TESTS=1")
def test_the_compiled_decode_step_with_flex_traces_whole_and_keeps_the_tokens_as_its_cache_grows():
    """FastDecoder compiles its step with fullgraph=True: a graph break in the FlexAttention path would raise. The
    second request outgrows the first cache (256 -> 512 slots): the block mask follows the new size."""
    config = LlamaConfig(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, hidden_dim=128, vocab_size=300,
                         max_seq_len=512)
    model = random_model(config, device="cpu", dtype=torch.float32, std=0.5)  # one layer: a short compile
    short, long = list(range(1, 40)), [t % 300 for t in range(3, 300)]
    refs = [FastDecoder(model, compile=False).generate(p, n, temperature=0, stop_ids=[]).tokens
            for p, n in ((short, 20), (long, 20))]
    with attention_backend("flex"):
        decoder = FastDecoder(model, compile=True)
        assert decoder.generate(short, 20, temperature=0, stop_ids=[]).tokens == refs[0]
        assert decoder.generate(long, 20, temperature=0, stop_ids=[]).tokens == refs[1] and decoder.max_len == 512
