"""Grouped-query attention (Ainslie et al. 2023), reading and writing the KV cache (`kv_cache.py`).

n_heads query heads share n_kv_heads key/value heads, n_rep = n_heads // n_kv_heads queries per group:
n_rep = 1 is multi-head attention, n_kv_heads = 1 is multi-query attention. Llama 3 8B uses 32 query
heads over 8 KV heads, so its cache is 4x smaller than MHA's.

Keys are masked by position (a query at position p sees keys at positions <= p): what the cache holds
beyond a sequence's length is never read.

The mask is the slow part on a GPU: PyTorch's flash kernel takes no mask, and the kernels that take one
do not broadcast KV heads (`enable_gqa`), so a mask with GQA falls to the math path, which expands K/V to
every query head and builds the scores in float32. So the model says a mask (`Mask`) as cheaply as it can:
CAUSAL (no tensor: `is_causal`) when the keys are exactly the T queries' own tokens from position 0,
UNMASKED when every key is visible (one token decoding over its filled cache), and an explicit boolean
one otherwise, with each KV head's n_rep query heads folded into its rows so that no K/V is expanded.
`sdpa` is the one place that picks the attention path, from the mask and the caller's `static` flag.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from . import attention_backend
from .config import LlamaConfig
from .linear import Linear
from .rope import apply_rope

__all__ = ["Attention", "attention", "causal_mask", "sdpa", "flex_decode", "FLEX_BLOCK", "Mask", "CAUSAL", "UNMASKED"]


@dataclass(frozen=True)
class Mask:
    """Which keys each query sees: UNMASKED (every key), CAUSAL (query i sees keys 0..i, the keys being these T
    tokens at positions 0..T-1) or explicit, Mask(visible) with visible [B or 1, 1, T, S] bool, True where a key
    is visible (`causal_mask` makes one). The two named ones need no tensor (`sdpa` gives SDPA no mask)."""

    visible: torch.Tensor | None = None  # [B or 1, 1, T, S] bool; None: UNMASKED or CAUSAL
    causal: bool = False
    last: torch.Tensor | None = None  # [B]: with one query a row, the visible keys are exactly slots 0..last[b]

    def __post_init__(self):
        if self.last is not None and (self.visible is None or self.visible.shape[2] != 1):
            raise TypeError("Mask(last=...) says which prefix of the slots one query a row sees: it needs the explicit "
                            "mask [B, 1, 1, S] it summarises")
        v = self.visible
        if v is not None and (self.causal or not isinstance(v, torch.Tensor) or v.dtype != torch.bool or v.dim() != 4):
            raise TypeError(f"Mask(visible) takes a bool tensor [B, 1, T, S], True where a key is visible, and no "
                            f"causal flag; got {getattr(v, 'dtype', type(v))} {list(getattr(v, 'shape', []))}, "
                            f"causal={self.causal}")


UNMASKED, CAUSAL = Mask(), Mask(causal=True)


def as_mask(mask: Mask | torch.Tensor) -> Mask:
    """A Mask as it is; a bool tensor [B, 1, T, S] as the explicit Mask it is. Anything else is refused."""
    if not isinstance(mask, (Mask, torch.Tensor)):
        raise TypeError(f"an attention mask is a Mask (UNMASKED, CAUSAL, Mask(visible)) or a bool tensor "
                        f"[B, 1, T, S]; got {type(mask).__name__} {mask!r}")
    return mask if isinstance(mask, Mask) else Mask(mask)


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


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask | torch.Tensor,
         static: bool = False) -> torch.Tensor:
    """`attention` by PyTorch's fused kernels: the one place that picks the attention path.

    q [B, n_heads, T, hd], k/v [B, n_kv, S, hd], mask a Mask or a bool tensor [B, 1, T, S] -> [B, n_heads, T, hd].
    - UNMASKED, CAUSAL: SDPA with no mask tensor (flash on CUDA), the KV heads broadcast by `enable_gqa`;
    - explicit, one query head per KV head: SDPA with the mask;
    - explicit with GQA: the n_rep query heads that share a KV head stacked as n_rep * T rows of that head (they
      see the same keys), so SDPA needs neither GQA broadcast nor expanded K/V; in a static step (traced for
      torch.compile, `Llama.forward`'s flag) of one sequence on a CPU, the same call to llmstep's CPU kernel
      where one is installed (`attention_backend.cpu_step_kernel`: it reads the cache where it lies, skipping
      the masked slots), and for a decode step (`Mask.last` set) its form that takes the last slot a row sees
      instead of a mask: inductor would otherwise make the stacked mask again in every layer's kernel;
    - a static decode step (one query a row, `Mask.last` set) where `attention_backend.flex_decode` says so, and the
      cache is whole FLEX_BLOCKs: FlexAttention over the filled blocks only (`flex_decode`).
    """
    mask = as_mask(mask)
    gqa = q.shape[1] != k.shape[1]
    if mask.visible is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=mask.causal, enable_gqa=gqa)
    if mask.last is not None and static and k.shape[2] % FLEX_BLOCK == 0 and attention_backend.flex_decode(q.device):
        return flex_decode(q, k, v, mask.last)
    if not gqa:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.visible)
    B, H, T, hd = q.shape
    n_kv, S = k.shape[1], k.shape[2]
    q = q.reshape(B, n_kv, (H // n_kv) * T, hd)  # [B, n_kv, n_rep*T, hd]: head h = g*n_rep + r, row r*T + t
    kernel = attention_backend.cpu_step_kernel(q) if static and B == 1 else None
    prefix = attention_backend.cpu_step_prefix_kernel(q) if kernel is not None and mask.last is not None else None
    if prefix is not None:  # a decode step: slots 0..last, no mask tensor (a compiled step would make one a layer)
        return prefix(q, k, v, mask.last.long()).view(B, H, T, hd)
    rows = mask.visible.expand(B, 1, T, S).repeat(1, 1, H // n_kv, 1)  # [B, 1, n_rep*T, S], row r*T + t = mask[t]
    if kernel is not None:
        out = kernel(q, k, v, rows)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=rows)  # [B, n_kv, n_rep*T, hd]
    return out.view(B, H, T, hd)


FLEX_BLOCK = 128  # slots per block of FlexAttention's block mask (its default block size)


def flex_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """One query a row over the filled slots only: q [B, n_heads, 1, hd], k/v [B, n_kv, S, hd] (S a multiple of
    FLEX_BLOCK), last [B] the last filled slot of each row -> [B, n_heads, 1, hd], the same as SDPA with the
    mask slots <= last. The block mask is made here from `last` (no host sync, fixed shapes: a compiled step and
    a CUDA graph take it): the blocks before last's are fully visible, last's block is masked by position, and
    FlexAttention never visits the blocks after it, so a step reads the tokens a row holds, not the cache."""
    B, S = q.shape[0], k.shape[2]
    n = S // FLEX_BLOCK
    full = (last // FLEX_BLOCK).to(torch.int32).view(B, 1, 1)  # [B, 1, 1]: whole blocks before last's
    blocks = torch.arange(n, dtype=torch.int32, device=q.device).view(1, 1, 1, n).expand(B, 1, 1, n)  # [B, 1, 1, n]
    partial = (blocks + full.view(B, 1, 1, 1)) % n  # [B, 1, 1, n]: last's block first (only it is read)

    def visible(b, h, q_idx, kv_idx):
        return kv_idx <= last[b]

    block_mask = BlockMask.from_kv_blocks(torch.ones_like(full), partial.contiguous(), full, blocks.contiguous(),
                                          BLOCK_SIZE=FLEX_BLOCK, mask_mod=visible, seq_lengths=(1, S))
    return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1])


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        self.wq = Linear(config.dim, config.n_heads * config.head_dim, bias=False)  # HF: q_proj
        self.wk = Linear(config.dim, config.n_kv_heads * config.head_dim, bias=False)  # HF: k_proj
        self.wv = Linear(config.dim, config.n_kv_heads * config.head_dim, bias=False)  # HF: v_proj
        self.wo = Linear(config.n_heads * config.head_dim, config.dim, bias=False)  # HF: o_proj
        self.wqkv: nn.Module | None = None  # wq|wk|wv stacked as one matmul, set by llmstep.core.fuse

    def forward(self, x, cos, sin, positions, mask: Mask | torch.Tensor, cache=None, layer: int = 0,
                kv_len: int | None = None, static: bool = False):
        """x [B, T, dim] -> [B, T, dim]. With a cache (kv_cache.Cache), this step's keys and values are stored at
        `positions` and the queries attend over what the cache hands back (the contiguous one: its first kv_len
        slots), the mask hiding what is not theirs to see. static: the step is traced for a compiler (`sdpa`)."""
        B, T, _ = x.shape
        if self.wqkv is None:
            q, k, v = self.wq(x), self.wk(x), self.wv(x)  # [B, T, n_heads*hd], [B, T, n_kv*hd] twice
        else:  # one matmul, split back into the same three
            kv = self.n_kv_heads * self.head_dim
            q, k, v = self.wqkv(x).split([self.n_heads * self.head_dim, kv, kv], dim=-1)
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # [B, n_heads, T, hd]
        k = k.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # [B, n_kv, T, hd]
        v = v.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # [B, n_kv, T, hd]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.write(layer, positions, k, v, kv_len)  # [B, n_kv, S, hd]
        with attention_backend.kernels():  # the kernel asked for (attention_backend.py); none named: PyTorch's
            out = sdpa(q, k, v, mask, static)  # [B, n_heads, T, hd]
        return self.wo(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))
