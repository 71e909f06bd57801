"""Prefix keys shared by the broker and the stages, without torch.

A prompt's prefix is keyed block by block: PREFIX_BLOCK tokens per block, each block's key
a hash of the previous key and its own token ids, so one key names the whole prefix up to
the end of its block. The broker computes the chain from the prompt it was given and
sends it to every stage of the route; a stage's prefix cache (engine/prefix_cache.py)
stores KV blocks under these keys. The prompt's last token is never in a block: its
logits have to be computed.

:class:`PrefixIndex` is the broker's guess of what each worker holds (the chains it sent
there, least recently used forgotten first), used to steer a session to the route that
holds the longest part of its prefix. A wrong guess costs only speed: each stage says
what it really holds before stage 0 starts the prompt.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

__all__ = [
    "INDEX_BLOCKS",
    "MAX_PREFIX_BLOCKS",
    "MAX_PREFIX_KEY",
    "PREFIX_BLOCK",
    "PrefixIndex",
    "prefix_blocks",
    "prefix_chain",
]

PREFIX_BLOCK = 16  # tokens per cached block: vLLM's default block size
# Keys travel in the OPEN header (at most 9 bytes each): a prompt's first 65,536 tokens
# can be reused, no more.
MAX_PREFIX_BLOCKS = 4096
MAX_PREFIX_KEY = (1 << 63) - 1
INDEX_BLOCKS = 1 << 16  # keys the broker remembers per worker


def prefix_blocks(prompt_len: int) -> int:
    """Whole blocks a prompt of ``prompt_len`` tokens can reuse (its last token excluded)."""
    return min(max(prompt_len - 1, 0) // PREFIX_BLOCK, MAX_PREFIX_BLOCKS)


def prefix_chain(tokens: np.ndarray) -> tuple[int, ...]:
    """The key of each whole block of ``tokens`` (token ids, [n]) but the last token:
    prefix_blocks(n) keys; key i covers tokens [0, (i + 1) * PREFIX_BLOCK)."""
    n = prefix_blocks(len(tokens))
    # Only the blocks' tokens are read: a prompt may be far longer than what is keyed.
    raw = np.ascontiguousarray(tokens[: n * PREFIX_BLOCK], dtype="<i4").tobytes()
    step = PREFIX_BLOCK * 4
    keys = []
    prev = b""
    for i in range(n):
        prev = hashlib.blake2b(prev + raw[i * step : (i + 1) * step], digest_size=8).digest()
        keys.append(int.from_bytes(prev, "little") & MAX_PREFIX_KEY)
    return tuple(keys)


class PrefixIndex:
    """Per worker, the prefix keys of the sessions the broker sent there (LRU)."""

    def __init__(self, max_keys: int = INDEX_BLOCKS) -> None:
        self.max_keys = max_keys
        self._keys: dict[str, OrderedDict[int, None]] = {}

    def held(self, worker: str, chain: tuple[int, ...]) -> int:
        """How many leading blocks of ``chain`` the worker is thought to hold."""
        keys = self._keys.get(worker)
        if not keys:
            return 0
        n = 0
        for k in chain:
            if k not in keys:
                break
            n += 1
        return n

    def note(self, worker: str, chain: tuple[int, ...]) -> None:
        """The worker was sent ``chain``: it will hold it once the prompt has run."""
        if not chain:
            return
        keys = self._keys.setdefault(worker, OrderedDict())
        for k in chain:
            keys[k] = None
            keys.move_to_end(k)
        while len(keys) > self.max_keys:
            keys.popitem(last=False)

    def forget(self, worker: str) -> None:
        self._keys.pop(worker, None)
