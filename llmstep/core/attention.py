"""Grouped-query attention (Ainslie et al. 2023), reading and writing the KV cache (`kv_cache.py`).

n_heads query heads share n_kv_heads key/value heads, n_rep = n_heads // n_kv_heads queries per group:
n_rep = 1 is multi-head attention, n_kv_heads = 1 is multi-query attention. Llama 3 8B uses 32 query
heads over 8 KV heads, so its cache is 4x smaller than MHA's.

Keys are masked by position (a query at position p sees keys at positions <= p): what the cache holds
beyond a sequence's length is never read.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import LlamaConfig
from .kv_cache import KVCache
from .rope import apply_rope

__all__ = ["Attention", "attention", "causal_mask"]


def causal_mask(query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
    """query_positions [B, T], key_positions [B, S] or [S] -> mask [B, 1, T, S], True where a key is visible."""
    if key_positions.dim() == 1:
        key_positions = key_positions[None]
    return (key_positions[:, None, :] <= query_positions[:, :, None])[:, None]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The textbook formula: softmax(q k^T / sqrt(head_dim) + mask) v, with KV heads shared by groups.

    q [B, n_heads, T, hd], k/v [B, n_kv, S, hd], mask [B, 1, T, S] -> [B, n_heads, T, hd].
    The model uses PyTorch's fused `scaled_dot_product_attention`, the same function; tests hold them equal.
    """
    n_rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(n_rep, dim=1)  # [B, n_heads, S, hd]: query head h reads KV head h // n_rep
    v = v.repeat_interleave(n_rep, dim=1)
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5  # [B, n_heads, T, S]
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        self.wq = nn.Linear(config.dim, config.n_heads * config.head_dim, bias=False)  # HF: q_proj
        self.wk = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=False)  # HF: k_proj
        self.wv = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=False)  # HF: v_proj
        self.wo = nn.Linear(config.n_heads * config.head_dim, config.dim, bias=False)  # HF: o_proj

    def forward(self, x, cos, sin, positions, mask, cache: KVCache | None = None, layer: int = 0,
                kv_len: int | None = None):
        """x [B, T, dim] -> [B, T, dim]. With a cache, this step's keys and values are stored at
        `positions` and the queries attend over the cache's first kv_len slots (the mask hides what
        is not theirs to see; None means every slot is visible)."""
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # [B, n_heads, T, hd]
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # [B, n_kv, T, hd]
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # [B, n_kv, T, hd]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.write(layer, positions, k, v, kv_len)  # [B, n_kv, S, hd]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.n_heads != self.n_kv_heads)
        return self.wo(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))
