"""Who holds what in tensor parallelism (llmstep.core.parallel): one rule, used by `shard` (slicing tensors in
memory) and by the loader (slicing files: llmstep.core.parallel.RankSlicer).

Rank r of N holds query heads r*n_heads/N .. (r+1)*n_heads/N of wq (rows) and wo (columns), the KV heads those
read of wk and wv (rows; with fewer KV heads than ranks, the one its query heads read, replicated), SwiGLU units
r*hidden/N .. of w1, w3 (rows) and w2 (columns), and vocabulary rows r*ceil(V/N) .. of the embedding and the LM
head, the last rank's padded with zero rows. The norms are replicated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .checks import is_int
from .config import LlamaConfig
from .process_group import ParallelError

__all__ = ["Split", "check_split", "split", "rank_slices", "pad_rows", "VOCAB_ROWS"]

VOCAB_ROWS = ("tok_embeddings.weight", "output.weight")  # split by vocabulary rows, padded to Split.vocab_rows


@dataclass(frozen=True)
class Split:
    """What rank `rank` of `world` holds."""

    rank: int
    world: int
    heads: int  # query heads per rank: n_heads / world
    kv_heads: int  # KV heads this rank holds: n_kv_heads / world, or 1 when there are fewer KV heads than ranks
    kv_start: int  # its first KV head
    hidden: int  # SwiGLU units per rank: hidden_dim / world
    vocab_rows: int  # embedding / LM head rows per rank: ceil(vocab / world), the last rank's padded with zeros


def check_split(config: LlamaConfig, world_size: int) -> None:
    """Refuse a world size that cannot split the heads, the KV heads or the feed-forward: before any loading."""
    if not is_int(world_size) or world_size < 1:
        raise ParallelError(f"the world size must be a positive integer, got {world_size!r}")
    problem = _split_problem(config, world_size)
    if problem:
        sizes = [n for n in range(2, config.n_heads + 1) if config.n_heads % n == 0 and not _split_problem(config, n)]
        raise ParallelError(f"{problem} (world sizes that split this model: {', '.join(map(str, sizes)) or 'none'})")


def _split_problem(c: LlamaConfig, N: int) -> str | None:
    """Why N ranks cannot split config `c` (its query heads, KV heads or feed-forward), or None."""
    if c.n_heads % N:
        return f"cannot split {c.n_heads} query heads over {N} ranks: the world size must divide n_heads"
    if c.n_kv_heads % N and N % c.n_kv_heads:
        return (f"cannot split {c.n_kv_heads} KV heads over {N} ranks: the world size must divide n_kv_heads, or "
                "n_kv_heads divide the world size (then each KV head is replicated)")
    if c.hidden_dim % N:
        return (f"cannot split the feed-forward's {c.hidden_dim} units over {N} ranks: the world size must divide "
                "hidden_dim")
    return None


def split(config: LlamaConfig, rank: int, world_size: int) -> Split:
    check_split(config, world_size)
    if not 0 <= rank < world_size:
        raise ParallelError(f"rank {rank} is outside the world of {world_size} ranks")
    heads = config.n_heads // world_size
    if config.n_kv_heads % world_size == 0:
        kv_heads = config.n_kv_heads // world_size
        kv_start = rank * kv_heads
    else:  # fewer KV heads than ranks: this rank's query heads all read one KV head (n_rep >= heads)
        kv_heads, kv_start = 1, rank * heads // (config.n_heads // config.n_kv_heads)
    return Split(rank, world_size, heads, kv_heads, kv_start, config.hidden_dim // world_size,
                 -(-config.vocab_size // world_size))


def rank_slices(config: LlamaConfig, s: Split) -> dict[str, tuple[int, int, int]]:
    """llmstep state name -> (dim, start, stop): the rows (dim 0) or columns (dim 1) of the full tensor this
    rank holds. Names not listed (the norms) are replicated whole."""
    hd, r = config.head_dim, s.rank
    q = (r * s.heads * hd, (r + 1) * s.heads * hd)
    kv = (s.kv_start * hd, (s.kv_start + s.kv_heads) * hd)
    h = (r * s.hidden, (r + 1) * s.hidden)
    # the last ranks' rows run past the vocabulary when N is large beside it: empty slices, padded to vocab_rows
    vocab = (0, min(r * s.vocab_rows, config.vocab_size), min((r + 1) * s.vocab_rows, config.vocab_size))
    out = {"tok_embeddings.weight": vocab}
    if not config.tie_embeddings:
        out["output.weight"] = vocab
    for i in range(config.n_layers):
        p = f"layers.{i}."
        out |= {p + "attention.wq.weight": (0, *q), p + "attention.wk.weight": (0, *kv),
                p + "attention.wv.weight": (0, *kv), p + "attention.wo.weight": (1, *q),
                p + "feed_forward.w1.weight": (0, *h), p + "feed_forward.w3.weight": (0, *h),
                p + "feed_forward.w2.weight": (1, *h)}
    return out


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """A vocabulary slice [n, dim] padded with zero rows to [rows, dim] (the last rank's, when N does not divide)."""
    return t if t.shape[0] == rows else torch.cat([t, t.new_zeros(rows - t.shape[0], t.shape[1])])
