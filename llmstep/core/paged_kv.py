"""The paged KV cache (Kwon et al. 2023, "PagedAttention", vLLM): the cache as a pool of fixed-size blocks.

A contiguous cache (`kv_cache.py`) gives every sequence a row of max_len slots, reserved whole for its
whole life, so memory holds as many sequences as there are rows whatever they really use. A paged cache
cuts the memory into blocks of `block_size` token slots; a sequence holds a *block table*, the list of
the blocks its positions live in (position p is slot p % block_size of block table[p // block_size]), and
takes one more block only when it fills the last. Nothing is reserved ahead; the waste is at most one
partly filled block per sequence.

Two parts here, as vLLM separates them (which request holds which blocks is the KV-cache manager's,
llmstep/engines/kv_manager.py):
- `BlockPool` (pure Python, no tensors, no requests): the free blocks, reference counts, and prefix caching.
  A full block is keyed by the hash of its tokens and of every token before it (a chain: the key of block i
  hashes the key of block i-1 and block i's tokens), so two prompts that share their first 256 tokens
  share those blocks. Blocks of finished sequences stay cached, with reference count 0, until the pool
  needs them; the least recently used is evicted first. Only full blocks are shared, and a full block is
  never written again, so no copy-on-write is needed.
- `PagedKVCache` (the tensors): the blocks of every layer, and the forward's view of them. The model's one
  forward takes a flattened ("varlen") batch: every scheduled token of every sequence in one row [1, N],
  each with its position and its sequence (a prompt's chunk and other sequences' decode tokens together).
  `plan` sets that layout for one forward; `write` stores each token's key and value in its own block
  slot and gathers, for each sequence, its keys through its block table, one after another [1, n_kv, S, hd];
  `mask` hides every key that is another sequence's or later than the query (same sequence and key
  position <= query position). That is one index_copy, one index_select and one masked attention per layer:
  exact, but it scores each query against every gathered key (N x S) and keeps only its own sequence's.
  A paged-attention kernel (vLLM's, FlashAttention's varlen) reads the blocks in place and skips the rest.

`gather_blocks` and `attend_by_hand` are the same attention written out one sequence at a time, for
teaching and as the tests' reference.
"""

from __future__ import annotations

import hashlib
import operator
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .attention import Mask, attention
from .config import LlamaConfig
from .cost import check_fits, kv_cache_bytes
from .kv_cache import Cache

__all__ = ["BlockPool", "BlockManager", "PagedKVCache", "SeqChunk", "blocks_for", "block_key", "check_block_size",
           "check_pool", "gather_blocks", "attend_by_hand"]

# What BlockPool keeps per block, in Python objects: a `ref` list slot (8 bytes), a `free` deque slot (8) and
# one int object (28), rounded up. Counted with the tensors so that the bookkeeping is never built unchecked.
BOOKKEEPING_BYTES_PER_BLOCK = 64


def blocks_for(n_tokens: int, block_size: int) -> int:
    """Blocks that hold n_tokens token slots: the last one may be partly filled."""
    return -(-n_tokens // block_size)


def block_key(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """A full block's prefix-cache key: sha256 of the previous block's key and this block's tokens, so equal
    keys mean equal tokens from position 0 to the block's end (a 256-bit digest: no collision in practice)."""
    h = hashlib.sha256(parent or b"")
    h.update(b",".join(str(int(t)).encode() for t in tokens))
    return h.digest()


def _check_sizes(n_blocks, block_size) -> None:
    for name, value in (("kv_blocks", n_blocks), ("block_size", block_size)):
        if not hasattr(value, "__index__") or isinstance(value, bool) or operator.index(value) <= 0:
            raise ValueError(f"a paged KV cache needs a positive integer {name}, got {value!r}")


def check_block_size(block_size: int, context: int, name: str = "block_size") -> None:
    """The one rule on a block's length: at most the model's context (a block holds one sequence's positions, so
    no sequence could fill a longer one). name: what the caller calls it (the CLI's --block-size)."""
    if block_size > context:
        raise ValueError(f"{name} {block_size} is longer than the model's context ({context} positions): no "
                         f"sequence could fill one block; choose at most {context}")


def check_pool(config: LlamaConfig, n_blocks: int, block_size: int, device, dtype: torch.dtype) -> None:
    """Refuse a pool before anything of it is built (its bookkeeping included): sizes that are not positive
    integers, a block longer than the model's context, or a pool that the device's free memory cannot hold."""
    _check_sizes(n_blocks, block_size)
    check_block_size(block_size, config.max_seq_len)
    check_fits(kv_cache_bytes(config, n_blocks, block_size, dtype) + n_blocks * BOOKKEEPING_BYTES_PER_BLOCK,
               device, f"a paged KV cache of {n_blocks:,} blocks x {block_size} positions ({dtype})")


class BlockPool:
    """The blocks' bookkeeping: which block is free, how many hold it, and which full blocks are cached.

    ref[b]: how many live sequences hold block b. A block with ref 0 is either free or, with prefix caching,
    cached (its key in `cached`, its place in the LRU order `evictable`) until the pool needs it back.
    """

    def __init__(self, n_blocks: int, block_size: int, prefix_caching: bool = False):
        _check_sizes(n_blocks, block_size)  # the pool's memory: check_pool, before this is built
        self.n_blocks, self.block_size, self.prefix_caching = int(n_blocks), int(block_size), prefix_caching
        self.ref = [0] * self.n_blocks
        self.free: deque[int] = deque(range(self.n_blocks))  # never used, or evicted: no key
        self.cached: dict[bytes, int] = {}  # key -> block, for full blocks (held or not)
        self.key_of: dict[int, bytes] = {}  # block -> its key
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks with ref 0, oldest first
        self.peak_used = 0

    @property
    def n_free(self) -> int:
        """Blocks that can be handed out now: free ones and cached ones nobody holds."""
        return len(self.free) + len(self.evictable)

    @property
    def n_used(self) -> int:
        return self.n_blocks - self.n_free

    def can_allocate(self, n: int, holding: Sequence[int] = ()) -> bool:
        """Whether n blocks can be handed out once the cached blocks `holding` are held (one nobody holds yet
        counts as free until then)."""
        return n <= self.n_free - sum(b in self.evictable for b in holding)

    def allocate(self) -> int:
        """One block for a sequence to write: a free one, else the least recently used cached one (evicted)."""
        if self.free:
            block = self.free.popleft()
        elif self.evictable:
            block, _ = self.evictable.popitem(last=False)
            del self.cached[self.key_of.pop(block)]
        else:
            raise RuntimeError("the KV block pool is empty: check can_allocate first")
        self.ref[block] = 1
        self.peak_used = max(self.peak_used, self.n_used)
        return block

    def cached_prefix(self, keys: Sequence[bytes]) -> list[int]:
        """The cached blocks for the longest prefix of `keys` (a sequence's full blocks' keys), not yet held."""
        blocks = []
        for key in keys if self.prefix_caching else ():
            if key not in self.cached:
                break
            blocks.append(self.cached[key])
        return blocks

    def hold(self, blocks: Sequence[int]) -> None:
        """A sequence takes cached blocks (its prefix hit): one more holder each, none evictable now."""
        for block in blocks:
            self.ref[block] += 1
            self.evictable.pop(block, None)
        self.peak_used = max(self.peak_used, self.n_used)

    def register(self, block: int, key: bytes) -> None:
        """A block just filled: cache it under its key (if an equal block is already cached, keep that one)."""
        if self.prefix_caching and key not in self.cached and block not in self.key_of:
            self.cached[key], self.key_of[block] = block, key

    def forget_cached(self) -> None:
        """No block is found by a prefix any more: the held ones stay with their holders, the others are free. For
        blocks a forward may have filled with NaN (a step whose logits broke) before it registered them."""
        self.free.extend(self.evictable)
        self.evictable.clear()
        self.cached.clear()
        self.key_of.clear()

    def release(self, blocks: Sequence[int]) -> None:
        """A sequence gives its blocks back (finished or preempted). Cached ones stay cached, the tail's first
        in the LRU order (a prefix's later blocks are the least likely to be shared); others are free."""
        for block in reversed(blocks):
            self.ref[block] -= 1
            if self.ref[block] == 0:
                if block in self.key_of:
                    self.evictable[block] = None
                else:
                    self.free.append(block)


BlockManager = BlockPool  # its former name


@dataclass
class SeqChunk:
    """One sequence's share of a forward: its tokens at positions start..start+len(tokens)-1, and its blocks
    (enough for every one of those positions)."""

    table: list[int]
    start: int
    n_tokens: int


class PagedKVCache(Cache):
    """Keys and values in blocks: k[i], v[i] [n_blocks * block_size, n_kv_heads, head_dim] - layer i's token
    slots, slot b * block_size + j being slot j of block b. One flattened row [1, N] per forward (`plan`).

    Every sequence of a forward attends over the same gathered keys, the others' masked, and a masked key weighs
    exactly 0, but 0 * inf is NaN: a sequence whose keys or values overflowed would make every other one's output
    NaN. So a key or value that is not finite is stored as 0 and its slot flagged (`nonfinite`, any layer's), and
    the forward's tokens that saw a flagged slot (`nonfinite_rows`) come out NaN (`mark_lost`), as their own
    computation would have; the others' are what they are alone."""

    def __init__(self, config: LlamaConfig, n_blocks: int, block_size: int = 16, device=None, dtype=torch.float32):
        dtype = torch.get_default_dtype() if dtype is None else dtype
        device = torch.get_default_device() if device is None else device
        check_pool(config, n_blocks, block_size, device, dtype)
        self.block_size, self.n_blocks = block_size, n_blocks
        self.n_rep = config.n_heads // config.n_kv_heads
        shape = (n_blocks * block_size, config.n_kv_heads, config.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layers)]
        self.nonfinite = torch.zeros(shape[0], dtype=torch.bool, device=device)  # [slots]: a layer's k or v was
        self.batch_size = 1  # the forward's one flattened row
        self._plan = None

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k + self.v)

    def plan(self, chunks: Sequence[SeqChunk]) -> torch.Tensor:
        """Lay out one forward over `chunks` (in order) -> positions [1, N]; `mask` and `write` then serve it.
        Built with a few tensor operations for all chunks at once: a Python loop over every context slot took tens
        of milliseconds a step at 32 sequences of 2,000 tokens, and a few operations per chunk as long for
        hundreds of short ones."""
        if not chunks:
            raise ValueError("a forward needs at least one chunk to plan")
        bs = self.block_size
        for s, c in enumerate(chunks):
            stop = c.start + c.n_tokens
            if c.start < 0:
                raise ValueError(f"chunk {s}: starts at position {c.start}; positions start at 0")
            if c.table and not 0 <= min(c.table) <= max(c.table) < self.n_blocks:
                bad = next(b for b in c.table if not 0 <= b < self.n_blocks)
                raise ValueError(f"chunk {s}: its table names block {bad}; this pool's blocks are "
                                 f"0..{self.n_blocks - 1}")
            if c.n_tokens < 1 or len(c.table) < blocks_for(stop, bs):
                raise ValueError(f"chunk {s}: {c.n_tokens} tokens from position {c.start} need "
                                 f"{blocks_for(stop, bs)} blocks, its table has {len(c.table)}")
        self._check_scratch(sum(c.n_tokens for c in chunks), sum(c.start + c.n_tokens for c in chunks))
        # every chunk at once: a few tensor operations a step, whatever the number of sequences or their lengths
        n = torch.tensor([c.n_tokens for c in chunks])  # [C]: tokens each computes
        length = torch.tensor([c.start + c.n_tokens for c in chunks])  # [C]: keys each attends
        blocks = (length + bs - 1) // bs  # [C]: blocks each uses
        tables = torch.tensor([b for c in chunks for b in c.table[:blocks_for(c.start + c.n_tokens, bs)]])
        seq = torch.arange(len(chunks))
        ks = seq.repeat_interleave(length)  # [S]: each key's sequence
        kp = torch.arange(len(ks)) - (length.cumsum(0) - length)[ks]  # [S]: each key's position in its sequence
        read = tables[(blocks.cumsum(0) - blocks)[ks] + kp // bs] * bs + kp % bs  # [S]: its slot
        qs = seq.repeat_interleave(n)  # [N]: each query's sequence
        pos = torch.arange(len(qs)) - (n.cumsum(0) - n)[qs] + torch.tensor([c.start for c in chunks])[qs]  # [N]
        write = read[(length.cumsum(0) - length)[qs] + pos]  # [N]: the slots of the positions computed
        device = self.k[0].device
        pos, qs, ks, kp = pos.to(device), qs.to(device), ks.to(device), kp.to(device)
        # [1, 1, N, S]: a query sees its own sequence's keys at positions <= its own
        mask = ((ks[None, :] == qs[:, None]) & (kp[None, :] <= pos[:, None]))[None, None]
        self._plan = (write.to(device), read.to(device), mask)
        return pos[None]

    def _check_scratch(self, N: int, S: int) -> None:
        """A forward of N tokens over S gathered keys scores every query against every key: its mask [N, S], the
        mask's rows for each query head of a KV head, and their copy as an additive mask in the cache's dtype that
        SDPA takes (measured on the CPU: 267 MB at N = S = 4,096, n_rep = 4, float32), checked before any of it is
        allocated. A long prompt in one piece grows them as its square (30,000 tokens: 7.2 GB in one layer):
        prefill_chunk computes it in parts. Asked only of steps that large."""
        if N * S >= 2**24:
            check_fits(N * S * (1 + self.n_rep * (1 + self.k[0].element_size())), self.k[0].device,
                       f"the attention of a paged forward of {N:,} tokens over {S:,} keys (its mask; "
                       "prefill_chunk computes a long prompt in parts)")

    def positions(self, T: int) -> torch.Tensor:
        raise ValueError("a paged KV cache serves the layout `plan` made: pass the positions plan returned")

    def mask(self, positions: torch.Tensor, static: bool = False) -> tuple[Mask, None]:
        """The planned forward's mask [1, 1, N, S] and no kv_len (the keys are the gathered ones), static or not."""
        if self._plan is None or positions.shape != (1, self._plan[0].shape[0]):
            raise ValueError(f"positions {list(positions.shape)} are not the planned layout: call plan() first "
                             "and pass the positions it returns")
        return Mask(self._plan[2]), None

    def write(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_len: None = None):
        """Store k, v [1, n_kv, N, hd] in the planned slots; return every planned sequence's context, gathered
        through its block table [1, n_kv, S, hd]."""
        write_slots, read_slots, _ = self._plan
        k, v = k[0].transpose(0, 1), v[0].transpose(0, 1)  # [N, n_kv, hd]
        bad = ~(torch.isfinite(k).flatten(1).all(1) & torch.isfinite(v).flatten(1).all(1))  # [N]
        if layer:  # a slot is flagged where any layer's k or v was not finite; the first layer's write resets it
            bad = bad | self.nonfinite.index_select(0, write_slots)
        self.nonfinite.index_copy_(0, write_slots, bad)
        self.k[layer].index_copy_(0, write_slots, torch.where(bad[:, None, None], 0, k))  # into their slots
        self.v[layer].index_copy_(0, write_slots, torch.where(bad[:, None, None], 0, v))
        k_all = self.k[layer].index_select(0, read_slots)  # [S, n_kv, hd]
        v_all = self.v[layer].index_select(0, read_slots)
        return k_all.transpose(0, 1)[None], v_all.transpose(0, 1)[None]  # [1, n_kv, S, hd]

    def advance(self, positions: torch.Tensor) -> None:
        """Nothing to move: the block manager knows what each sequence holds."""

    def nonfinite_rows(self) -> torch.Tensor:
        """After the planned forward: [N] True for each token that saw a slot whose key or value was not finite
        (stored as 0, so that the other sequences' masked sums stay finite): its output is not to be trusted."""
        _, read_slots, mask = self._plan
        return (mask[0, 0] & self.nonfinite.index_select(0, read_slots)).any(-1)  # [N, S] & [S] -> [N]

    def mark_lost(self, x: torch.Tensor) -> torch.Tensor:
        """x [1, N, dim] -> NaN in the rows `nonfinite_rows` names. With tensor parallelism a rank flags what its
        own heads lost: the LM head's all-gather then gives every rank those rows' NaN."""
        return x.masked_fill(self.nonfinite_rows()[None, :, None], float("nan"))


# ---- by hand: one sequence at a time, the textbook way -----------------------------------------------

def gather_blocks(pool: torch.Tensor, table: Sequence[int], length: int, block_size: int) -> torch.Tensor:
    """A sequence's first `length` keys (or values) from a layer's pool [n_blocks * block_size, n_kv, hd],
    block by block through its table -> [n_kv, length, hd]."""
    pieces = [pool[b * block_size:(b + 1) * block_size] for b in table[:blocks_for(length, block_size)]]
    return torch.cat(pieces)[:length].transpose(0, 1)  # [n_kv, length, hd]


def attend_by_hand(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: Sequence[int],
                   positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """One sequence's queries q [n_heads, T, hd] at positions [T] over its keys gathered through its block
    table (each query sees positions <= its own) -> [n_heads, T, hd], with the textbook attention."""
    length = int(positions.max()) + 1
    k = gather_blocks(k_pool, table, length, block_size)  # [n_kv, length, hd]
    v = gather_blocks(v_pool, table, length, block_size)
    mask = (torch.arange(length, device=q.device)[None, :] <= positions[:, None])[None, None]  # [1, 1, T, length]
    return attention(q[None], k[None], v[None], mask)[0]
