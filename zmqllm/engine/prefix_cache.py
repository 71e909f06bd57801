"""A stage's prefix cache: KV blocks of recent prompts, keyed by prefix.prefix_chain.

Each block holds the keys and values of PREFIX_BLOCK prompt positions for this stage's
layers, copied out of the session cache that computed them once its prompt had run. A new
session whose chain starts with stored keys gets those blocks copied into its own cache
and computes only the rest of its prompt. Sessions never share a block: dropping one
(least recently used first, when a new session needs the room) cannot touch a live
session.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from zmqllm.bus.prefix import PREFIX_BLOCK
from zmqllm.engine.cache import KVCache

__all__ = ["PrefixStats", "PrefixStore"]


@dataclass
class PrefixStats:
    query_tokens: int = 0  # prompt tokens of the sessions opened
    hit_tokens: int = 0  # of them, taken from the cache instead of computed
    stored_blocks: int = 0
    evicted_blocks: int = 0


class PrefixStore:
    """Blocks by key, least recently used first; ``k`` and ``v`` of a block are
    [num_layers, num_kv_heads, PREFIX_BLOCK, head_dim]."""

    def __init__(self) -> None:
        self._blocks: OrderedDict[int, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self.stats = PrefixStats()

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def tokens(self) -> int:
        return len(self._blocks) * PREFIX_BLOCK

    def held(self, chain: tuple[int, ...]) -> int:
        """Leading blocks of ``chain`` stored here (marked as just used)."""
        n = 0
        for key in chain:
            if key not in self._blocks:
                break
            self._blocks.move_to_end(key)
            n += 1
        return n

    def load(self, chain: tuple[int, ...], blocks: int, cache: KVCache) -> None:
        """Copy the first ``blocks`` blocks of ``chain`` into positions [0, blocks * B) of
        a session's cache (its length is left to the caller)."""
        for i, key in enumerate(chain[:blocks]):
            k, v = self._blocks[key]
            span = slice(i * PREFIX_BLOCK, (i + 1) * PREFIX_BLOCK)
            cache.k[:, :, span].copy_(k)
            cache.v[:, :, span].copy_(v)

    def save(self, chain: tuple[int, ...], cache: KVCache, limit: int) -> int:
        """Store the blocks of ``chain`` that ``cache`` has computed and this store lacks,
        dropping the least recently used others while the store would hold more than
        ``limit`` tokens (the room live sessions leave); returns how many were stored."""
        done = min(len(chain), cache.length // PREFIX_BLOCK)
        missing = []
        for i, key in enumerate(chain[:done]):
            if key in self._blocks:
                self._blocks.move_to_end(key)  # kept last when room is made below
            else:
                missing.append(i)
        capacity = max(limit, 0) // PREFIX_BLOCK
        missing = missing[:capacity]
        excess = len(self._blocks) + len(missing) - capacity
        if excess > 0:
            self.evict(excess * PREFIX_BLOCK)
        for i in missing:
            span = slice(i * PREFIX_BLOCK, (i + 1) * PREFIX_BLOCK)
            self._blocks[chain[i]] = (cache.k[:, :, span].clone(), cache.v[:, :, span].clone())
        self.stats.stored_blocks += len(missing)
        return len(missing)

    def evict(self, tokens: int) -> int:
        """Drop least recently used blocks until ``tokens`` are freed (or none is left);
        returns the tokens freed."""
        freed = 0
        while freed < tokens and self._blocks:
            self._blocks.popitem(last=False)
            freed += PREFIX_BLOCK
            self.stats.evicted_blocks += 1
        return freed

    def clear(self) -> None:
        self.stats.evicted_blocks += len(self._blocks)
        self._blocks.clear()
