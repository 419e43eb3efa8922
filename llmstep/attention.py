"""Grouped-query attention (Ainslie et al. 2023) and the KV cache it reads.

n_heads query heads share n_kv_heads key/value heads, n_rep = n_heads // n_kv_heads queries per group:
n_rep = 1 is multi-head attention, n_kv_heads = 1 is multi-query attention. Llama 3 8B uses 32 query
heads over 8 KV heads, so its cache is 4x smaller than MHA's.

The cache is preallocated and written at explicit positions. Attention masks keys by position (a query
at position p sees keys at positions <= p), so anything in the cache beyond the current length is
never read: rolling back after a rejected speculative token is just moving `lengths` back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import LlamaConfig
from .rope import apply_rope

__all__ = ["KVCache", "Attention", "attention", "causal_mask"]


class KVCache:
    """Preallocated keys and values, one buffer per layer.

    k[i], v[i]: [batch, n_kv_heads, max_len, head_dim] - layer i's keys and values (lists of n_layers tensors:
        separate buffers, so a compiled step writes one token in place instead of copying a shared one)
    lengths: [batch] - tokens written so far for each sequence (the next position to write)
    """

    def __init__(self, config: LlamaConfig, batch_size: int, max_len: int, device=None, dtype=torch.float32):
        if max_len <= 0 or batch_size <= 0:
            raise ValueError(f"KVCache needs a positive batch_size and max_len, got {batch_size}, {max_len}")
        if max_len > config.max_seq_len:
            raise ValueError(f"KVCache max_len {max_len} exceeds the model's context ({config.max_seq_len})")
        shape = (batch_size, config.n_kv_heads, max_len, config.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layers)]
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]

    @property
    def batch_size(self) -> int:
        return self.k[0].shape[0]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k + self.v)

    @property
    def buffers(self) -> tuple[torch.Tensor, ...]:
        """Every tensor the model writes: what a compiled step must keep at fixed addresses."""
        return (*self.k, *self.v, self.lengths)

    def write(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_len: int | None = None):
        """Store k, v [B, n_kv, T, hd] at positions [B, T]; return this layer's cache up to kv_len [B, n_kv, S, hd]."""
        k_cache, v_cache = self.k[layer], self.v[layer]  # [B, n_kv, max_len, hd]
        if k.shape[0] == 1:  # one sequence: a plain copy into slots positions[0]
            k_cache.index_copy_(2, positions[0], k)
            v_cache.index_copy_(2, positions[0], v)
        else:  # each row at its own positions; advanced indices on dims 0 and 2 address [B, T, n_kv, hd]
            rows = torch.arange(k.shape[0], device=k.device)[:, None]  # [B, 1]
            k_cache[rows, :, positions] = k.transpose(1, 2)
            v_cache[rows, :, positions] = v.transpose(1, 2)
        return k_cache[:, :, :kv_len], v_cache[:, :, :kv_len]

    def slot(self, i: int) -> KVCache:
        """Row i as a cache of batch 1 that shares this cache's memory: what is written to it lands in row i.

        Continuous batching prefills each newcomer alone into its own row (`llmstep.batching`)."""
        if not 0 <= i < self.batch_size:
            raise IndexError(f"KV cache slot {i} does not exist: the cache has {self.batch_size} "
                             f"(0..{self.batch_size - 1})")
        view = object.__new__(KVCache)
        view.k, view.v = [t[i:i + 1] for t in self.k], [t[i:i + 1] for t in self.v]
        view.lengths = self.lengths[i:i + 1]
        return view

    def rollback(self, lengths: torch.Tensor | int):
        """Forget everything from position `lengths` on (per sequence, or one int for all)."""
        self.lengths.copy_(torch.as_tensor(lengths, device=self.lengths.device).expand_as(self.lengths))

    def reset(self):
        self.lengths.zero_()


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
