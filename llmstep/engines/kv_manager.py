"""The KV-cache manager: which blocks of the pool hold which request's tokens. Pure Python, no tensors.

vLLM v1's split: the scheduler decides who computes how many tokens; this manager finds blocks for them; the block
pool (`llmstep.core.paged_kv.BlockPool`) hands blocks out, counts their holders, keeps the prefix cache, and knows
nothing of requests. block table[p // block_size] holds position p. A request's prefix keys chain its full blocks
(`core.paged_kv.block_key`): the key of block i hashes the key of block i-1 and block i's tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..core.paged_kv import BlockPool, block_key, blocks_for

__all__ = ["KVCacheManager", "Prefix", "check_fits", "pool_tokens"]


def pool_tokens(n_blocks: int, block_size: int) -> int:
    """The most tokens, prompt and new, one request the whole pool holds may have: the last token made is never
    written (no step reads its K and V)."""
    return n_blocks * block_size + 1


def check_fits(n_prompt: int, n_new: int, n_blocks: int, block_size: int, index: int | None = None) -> None:
    """Refuse a request that the whole pool could not hold (`pool_tokens`); index: the request's, for the message."""
    if n_new and n_prompt + n_new > pool_tokens(n_blocks, block_size):
        need = blocks_for(n_prompt + n_new - 1, block_size)
        where = "" if index is None else f"request {index}: "
        raise ValueError(f"{where}its prompt ({n_prompt} tokens) and {n_new} new tokens need {need} blocks of "
                         f"{block_size} positions, the whole pool has {n_blocks}")


@dataclass(frozen=True)
class Prefix:
    """Cached full blocks a new request can start from: its first n_tokens are already computed in them."""

    blocks: tuple[int, ...] = ()
    n_tokens: int = 0


class KVCacheManager:
    """Block tables for requests over a pool of n_blocks blocks of block_size positions (prefix_caching: as
    `PagedBatcher`'s)."""

    def __init__(self, n_blocks: int, block_size: int, prefix_caching: bool = False):
        self.pool = BlockPool(n_blocks, block_size, prefix_caching)
        self.n_blocks, self.block_size = self.pool.n_blocks, self.pool.block_size
        self.tables: dict[int, list[int]] = {}  # request id -> its block table
        self._keys: dict[int, list[bytes]] = {}  # request id -> its full blocks' prefix keys, as far as asked

    def _chain(self, rid: int, tokens: Sequence[int], n_full: int) -> list[bytes]:
        """The prefix keys of the first n_full blocks of `tokens` (request rid's, from position 0): its chain,
        extended as far as needed (none without prefix caching: nothing would read them)."""
        if not self.pool.prefix_caching:
            return []
        keys, bs = self._keys.setdefault(rid, []), self.block_size
        while len(keys) < n_full:
            keys.append(block_key(keys[-1] if keys else None, tokens[len(keys) * bs:(len(keys) + 1) * bs]))
        return keys[:n_full]

    def cached_prefix(self, rid: int, tokens: Sequence[int]) -> Prefix:
        """The longest run of cached full blocks that begins a new request's `tokens`, leaving at least its last
        token to compute (that token's logits give the next one). Nothing is held until `allocate`."""
        blocks = self.pool.cached_prefix(self._chain(rid, tokens, (len(tokens) - 1) // self.block_size))
        return Prefix(tuple(blocks), len(blocks) * self.block_size)

    def allocate(self, rid: int, n_tokens: int, prefix: Prefix = Prefix()) -> list[int] | None:
        """Blocks for request rid's first n_tokens: its block table; or None when the pool cannot give them,
        and then nothing has changed. A request holding no blocks yet starts with `prefix`'s."""
        table = self.tables.get(rid)
        held = () if table is not None else prefix.blocks
        need = max(0, blocks_for(n_tokens, self.block_size) - len(held if table is None else table))
        if not self.pool.can_allocate(need, holding=held):
            return None
        if table is None:
            self.pool.hold(held)
            table = self.tables[rid] = list(held)
        table += [self.pool.allocate() for _ in range(need)]
        return table

    def table(self, rid: int) -> list[int]:
        """Request rid's block table (it must hold blocks)."""
        return self.tables[rid]

    def cache_blocks(self, rid: int, tokens: Sequence[int], start: int, stop: int) -> None:
        """The forward wrote request rid's positions start..stop-1 (`tokens`: all it knows): the full blocks
        they completed join the prefix cache under their keys (with prefix caching)."""
        bs, table = self.block_size, self.tables[rid]
        for b, key in enumerate(self._chain(rid, tokens, stop // bs)[start // bs:], start=start // bs):
            self.pool.register(table[b], key)

    def free(self, rid: int) -> None:
        """Request rid leaves (finished, preempted or cancelled): its blocks go back to the pool, the cached
        ones still findable by the next request with the same prefix. Unknown ids are ignored."""
        self.pool.release(self.tables.pop(rid, []))
        self._keys.pop(rid, None)
