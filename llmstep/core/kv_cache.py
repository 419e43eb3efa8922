"""The KV cache: every layer's keys and values, preallocated and written at explicit positions.

Attention masks keys by position (a query at position p sees keys at positions <= p), so anything in
the cache beyond a sequence's length is never read (at the positions the cache gives, `positions`; a caller that
gives its own answers for them): rolling back after a rejected speculative token
is just moving `lengths` back, and a batch slot is reused by writing over it.

The cache also says what a forward attends over (`mask`): the model's one forward asks its cache, so the
contiguous cache here and the paged one (`paged_kv.py`) are both a `Cache`, the calls the forward makes.
"""

from __future__ import annotations

import operator
from abc import ABC, abstractmethod

import torch

from .attention import CAUSAL, UNMASKED, Mask, causal_mask
from .checks import is_int
from .config import LlamaConfig
from .cost import check_fits, kv_cache_bytes

__all__ = ["Cache", "KVCache"]


class Cache(ABC):
    """What `Llama.forward` and `Attention` ask of a KV cache, in the order they ask it."""

    batch_size: int  # the rows of tokens [B, T] one forward takes

    @abstractmethod
    def positions(self, T: int) -> torch.Tensor:
        """Where the next T tokens of every row go when the caller gives no positions -> [B, T]."""

    @abstractmethod
    def mask(self, positions: torch.Tensor, static: bool = False) -> tuple[Mask, int | None]:
        """What queries at positions [B, T] attend over: (mask, kv_len), kv_len the slots `write` hands back
        (None: all). static: a step traced for a compiler, fixed shapes and nothing read back to the host."""

    @abstractmethod
    def write(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              kv_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Store layer's k, v [B, n_kv, T, hd] at positions [B, T] -> the keys and values to attend [B, n_kv, S, hd]."""

    @abstractmethod
    def advance(self, positions: torch.Tensor) -> None:
        """After every layer has written: these positions [B, T] now hold tokens."""

    def mark_lost(self, x: torch.Tensor) -> torch.Tensor:
        """The last layer's output x [B, T, dim] -> x, NaN in the rows that read a key or value this cache could not
        hold (a paged cache stores a non-finite one as 0, so that its other sequences stay finite); here none."""
        return x


class KVCache(Cache):
    """Preallocated keys and values, one buffer per layer.

    k[i], v[i]: [batch, n_kv_heads, max_len, head_dim] - layer i's keys and values (lists of n_layers tensors:
        separate buffers, so a compiled step writes one token in place instead of copying a shared one)
    lengths: [batch] - tokens written so far for each sequence (the next position to write)
    """

    def __init__(self, config: LlamaConfig, batch_size: int, max_len: int, device=None, dtype=torch.float32):
        for name, value in (("batch_size", batch_size), ("max_len", max_len)):
            if not hasattr(value, "__index__") or isinstance(value, bool) or operator.index(value) <= 0:
                raise ValueError(f"KVCache needs a positive integer {name}, got {value!r}")
        batch_size, max_len = operator.index(batch_size), operator.index(max_len)
        if max_len > config.max_seq_len:
            raise ValueError(f"KVCache max_len {max_len} exceeds the model's context ({config.max_seq_len})")
        dtype = torch.get_default_dtype() if dtype is None else dtype
        device = torch.get_default_device() if device is None else device
        check_fits(kv_cache_bytes(config, batch_size, max_len, dtype), device,
                   f"a KV cache of {batch_size} x {max_len:,} positions ({dtype})")  # before any zeros
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

    def positions(self, T: int) -> torch.Tensor:
        """Where the next T tokens go by default: after each sequence's length -> [B, T]."""
        return self.lengths[:, None] + torch.arange(T, device=self.lengths.device)

    def mask(self, positions: torch.Tensor, static: bool = False) -> tuple[Mask, int | None]:
        """What queries at positions [B, T] attend over: (mask, kv_len), the mask as cheap as it can be
        (`attention.sdpa`), kv_len the slots to read (None: all of them).

        Static: every slot, the mask hiding the unwritten ones (with one query a row, also the last slot it
        sees: FlexAttention's decode reads only the blocks up to it, `attention_backend`). Otherwise the filled
        slots only; one sequence
        decoding one token sees all of them (UNMASKED), one sequence's prefill into an empty cache sees exactly
        its own tokens (CAUSAL), anything else gets an explicit mask [B, 1, T, kv_len]."""
        B, T = positions.shape
        if static:  # one query a row sees slots 0..its position: `last` lets attention skip the rest (sdpa)
            visible = causal_mask(positions, torch.arange(self.max_len, device=positions.device))
            return Mask(visible, last=positions[:, 0] if T == 1 else None), None
        # one read back: the last slot, the first, and whether each row's positions run one by one (a negative
        # position would wrap round to the last slot; a gap would leave slots unwritten between them)
        gap = (positions[:, 1:] - positions[:, :-1] != 1).any()
        top, low, gap = torch.stack([positions.max(), positions.min(), gap.long()]).tolist()
        kv_len = top + 1
        if kv_len > self.max_len:
            raise ValueError(f"position {kv_len - 1} is past the KV cache's {self.max_len} slots")
        if low < 0 or gap:
            row, i = (positions < 0).nonzero()[0].tolist() if low < 0 else \
                (positions[:, 1:] - positions[:, :-1] != 1).nonzero()[0].tolist()
            after = f" after {int(positions[row, i])}" if low >= 0 else ""
            raise ValueError(f"row {row}'s position {int(positions[row, i + (low >= 0)])}{after}: a cached forward's "
                             "positions must run one by one along each row, from 0 up")
        if B == 1 and T == 1:
            return UNMASKED, kv_len
        if B == 1 and kv_len == T and bool((positions[0] == torch.arange(T, device=positions.device)).all()):
            return CAUSAL, kv_len
        return Mask(causal_mask(positions, torch.arange(kv_len, device=positions.device))), kv_len

    def check_static(self, positions: torch.Tensor) -> None:
        """A static step's positions [B, T], which `mask` does not read back: each must name a slot, 0..max_len-1 (a
        negative one would wrap round to the last slot; one past the end, write out of bounds). Checked where they
        can be read for free, on a CPU; on a GPU the step's caller answers for them, as the engines' loops do."""
        if positions.device.type == "cpu" and positions.numel():
            low, top = torch.aminmax(positions)
            if low < 0 or top >= self.max_len:
                raise ValueError(f"position {int(low if low < 0 else top)} names no slot of the KV cache's "
                                 f"{self.max_len} (0..{self.max_len - 1})")

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

    def advance(self, positions: torch.Tensor) -> None:
        """After a forward: each sequence's length is one past its last position [B, T]."""
        self.lengths.copy_(positions[:, -1] + 1)

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
        """Forget everything from position `lengths` on (per sequence, or one int for all), each in 0 .. max_len
        and none past what its sequence holds (slots never written would count as keys); refused, with nothing
        changed, otherwise. One read back of the lengths (a sync on a GPU)."""
        if is_int(lengths):  # one length for all
            low = high = int(lengths)
            new, past = None, low > int(self.lengths.min())
        else:
            new = torch.as_tensor(lengths, device=self.lengths.device)
            if new.is_floating_point() or new.is_complex() or new.dtype == torch.bool:
                raise ValueError(f"rollback takes whole-number lengths, got {new.dtype}")
            new = new.expand_as(self.lengths)  # a RuntimeError naming the shapes where they do not fit
            low, high, past = torch.stack([new.min(), new.max(), (new > self.lengths).any().long()]).tolist()
        if low < 0 or high > self.max_len:
            raise ValueError(f"rollback lengths must be in 0 .. {self.max_len} (the cache's slots), got "
                             f"{low if low < 0 else high}")
        if past:
            held = self.lengths.tolist()
            i, asked = next((i, n) for i, n in enumerate([low] * len(held) if new is None else new.tolist())
                            if n > held[i])
            raise ValueError(f"rollback moves a cache back, never on: sequence {i} holds {held[i]} positions, "
                             f"asked for {asked} (slots never written would count as keys)")
        if new is None:
            self.lengths.fill_(low)
        else:
            self.lengths.copy_(new)

    def reset(self):
        self.lengths.zero_()
