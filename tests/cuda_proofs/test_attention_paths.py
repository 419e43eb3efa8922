"""Which arguments each path hands scaled_dot_product_attention (issue 12, item 3).

On CUDA, SDPA picks its kernel from the arguments: flash takes no mask, the memory-efficient and cuDNN
kernels take a mask but no GQA broadcast, and a mask with `enable_gqa` falls back to the math path
(K/V expanded to every query head, scores in float32). So: no mask where none is needed (is_causal for a
prefill from position 0, nothing for one decoding token), and never a mask together with enable_gqa,
nor K/V with more heads than the cache holds."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmstep.core import attention_backend
from llmstep.core.attention import attention, causal_mask, sdpa
from llmstep.core.config import LlamaConfig
from llmstep.core.model import Llama
from llmstep.engines.fast import FastDecoder
from llmstep.lab.hardware import random_model

GREEDY = dict(temperature=0, stop_ids=())  # greedy, never stopping early: what these runs compare

CONFIG = LlamaConfig(dim=64, n_layers=2, n_heads=8, n_kv_heads=2, hidden_dim=128, vocab_size=97, max_seq_len=64)


def random_llama(config: LlamaConfig = CONFIG) -> Llama:
    return random_model(config, device="cpu", dtype=torch.float32, std=0.1)


@pytest.fixture
def calls(monkeypatch):
    """Every SDPA call's arguments: (mask is given, is_causal, enable_gqa, query heads, key heads)."""
    recorded, real = [], F.scaled_dot_product_attention

    def recording(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        recorded.append(dict(mask=attn_mask is not None, is_causal=is_causal, gqa=enable_gqa,
                             q_heads=q.shape[1], kv_heads=k.shape[1]))
        return real(q, k, v, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=enable_gqa)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    return recorded


def fast_kernel_args(call: dict) -> bool:
    """Arguments some fused CUDA kernel takes: no mask with GQA broadcast, K/V never expanded."""
    return not (call["mask"] and call["gqa"]) and call["kv_heads"] == CONFIG.n_kv_heads


@torch.no_grad()
def test_prefill_into_an_empty_cache_and_a_plain_forward_are_causal_without_a_mask(calls):
    model = random_llama()
    model(torch.tensor([[1, 2, 3, 4, 5]]))
    cache = model.new_cache(1, 32)
    model(torch.tensor([[1, 2, 3, 4, 5]]), cache=cache)
    assert len(calls) == 2 * CONFIG.n_layers
    assert all(c["is_causal"] and not c["mask"] and c["gqa"] for c in calls), calls


@torch.no_grad()
def test_one_sequence_decoding_one_token_uses_no_mask(calls):
    model = random_llama()
    cache = model.new_cache(1, 32)
    model(torch.tensor([[1, 2, 3]]), cache=cache)
    del calls[:]
    model(torch.tensor([[4]]), cache=cache)
    assert calls and all(not c["mask"] and not c["is_causal"] and c["gqa"] for c in calls), calls


@torch.no_grad()
def test_masked_paths_fold_the_query_heads_instead_of_expanding_kv(calls, monkeypatch):
    model = random_llama()
    cache = model.new_cache(2, 32)
    model(torch.tensor([[1, 2, 3], [4, 5, 6]]), torch.tensor([[0, 1, 2], [0, 1, 2]]), cache)  # batch: masked
    eager = FastDecoder(model, max_len=16, compile=False).generate([1, 2, 3], 4, **GREEDY).tokens
    # the path a compiled step traces, as on CUDA (SDPA, not the CPU kernel an earlier test may have registered)
    monkeypatch.setattr(attention_backend, "_cpu_step", None)
    decoder = FastDecoder(model, max_len=16, compile=False)
    decoder.static = True
    traced = decoder.generate([1, 2, 3], 4, **GREEDY).tokens  # every slot, masked
    assert traced == eager
    assert calls and all(fast_kernel_args(c) for c in calls), calls
    assert sum(c["mask"] for c in calls) >= 2 * CONFIG.n_layers


@pytest.mark.parametrize("T,S", [(1, 9), (3, 9), (4, 4)])
def test_sdpa_with_a_mask_equals_the_textbook_formula(T, S):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, n, 16, generator=g) for h, n in ((8, T), (2, S), (2, S)))
    positions = torch.tensor([[S - T + i for i in range(T)], [i for i in range(T)]])  # [2, T]
    mask = causal_mask(positions, torch.arange(S))
    torch.testing.assert_close(sdpa(q, k, v, mask), attention(q, k, v, mask), atol=1e-5, rtol=1e-5)
