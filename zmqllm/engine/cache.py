"""Per-session key/value caches of one pipeline stage.

A session's cache is allocated once, when it opens, for its whole length
(prompt + max_tokens are both known then), and written in place: the decode
loop never grows a tensor by concatenation. The memory a new session's cache competes
with is measured here too (resident memory, or the cuda allocator's).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch

from zmqllm.config.machine import rss_bytes
from zmqllm.models.model_args import ModelArgs


class CacheFullError(RuntimeError):
    """No room for a new session on this stage (sessions or KV tokens)."""


class KVAllocationFailed(CacheFullError):
    """The device would not give a session's cache its memory: FULL, like any other
    lack of room (the broker tries another replica), never an internal error."""

    def __init__(self, bytes_asked: int, bytes_free: int | None, cause: BaseException) -> None:
        free = "?" if bytes_free is None else f"{bytes_free >> 20} MiB"
        super().__init__(
            f"KV cache of {bytes_asked >> 20} MiB could not be allocated ({free} free): "
            f"{str(cause)[:200]}"
        )
        self.bytes_asked = bytes_asked
        self.bytes_free = bytes_free


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocator saying no (cuda's OutOfMemoryError, or the CPU
    allocator's RuntimeError/MemoryError), not a bug."""
    if isinstance(exc, torch.OutOfMemoryError | MemoryError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and (
        "can't allocate memory" in text or "out of memory" in text.lower()
    )


def bytes_free(device: torch.device | str) -> int | None:
    """Free memory of ``device`` now (cuda: the driver's; cpu: MemAvailable), if known."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return int(torch.cuda.mem_get_info(dev)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class KVCache:
    """Keys and values of one session on one stage.

    ``k`` and ``v`` are [num_layers, num_kv_heads, max_len, head_dim]; positions
    ``[0, length)`` hold valid entries.
    """

    __slots__ = ("k", "length", "max_len", "v")

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        shape = (num_layers, num_kv_heads, max_len, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.length = 0


@dataclass
class CacheStats:
    sessions: int
    tokens_reserved: int
    bytes_reserved: int
    max_sessions: int
    max_tokens: int
    bytes_used: int = 0  # of the reserved, those holding tokens now


class CachePool:
    """The caches of all sessions on one stage, with admission limits."""

    def __init__(
        self,
        args: ModelArgs,
        num_layers: int,
        dtype: torch.dtype,
        device: torch.device | str,
        max_sessions: int = 64,
        max_tokens: int = 1 << 20,
    ) -> None:
        self.args = args
        self.num_layers = num_layers
        self.dtype = dtype
        self.device = device
        self.max_sessions = max_sessions
        self.max_tokens = max_tokens
        self._caches: dict[Hashable, KVCache] = {}
        self._reserved = 0

    def __contains__(self, session: Hashable) -> bool:
        return session in self._caches

    def __len__(self) -> int:
        return len(self._caches)

    def get(self, session: Hashable) -> KVCache:
        return self._caches[session]

    def can_admit(self, max_len: int) -> bool:
        """Room for a session of ``max_len`` tokens (a prefix cache's blocks give way)."""
        return len(self._caches) < self.max_sessions and self._reserved + max_len <= self.max_tokens

    @property
    def reserved(self) -> int:
        return self._reserved

    def allocate(self, session: Hashable, max_len: int) -> KVCache:
        if session in self._caches:
            raise ValueError(f"session {session!r} already has a cache")
        if max_len > self.args.max_position_embeddings:
            raise ValueError(
                f"{max_len} tokens exceed the model's context of "
                f"{self.args.max_position_embeddings}"
            )
        if not self.can_admit(max_len):
            raise CacheFullError(
                f"stage full: {len(self._caches)}/{self.max_sessions} sessions, "
                f"{self._reserved}+{max_len} > {self.max_tokens} KV tokens"
            )
        try:
            cache = KVCache(
                self.num_layers,
                self.args.num_kv_heads,
                max_len,
                self.args.head_dim,
                self.dtype,
                self.device,
            )
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            itemsize = torch.empty((), dtype=self.dtype).element_size()
            asked = max_len * self.args.kv_bytes_per_token(self.num_layers, itemsize)
            raise KVAllocationFailed(asked, bytes_free(self.device), exc) from exc
        self._caches[session] = cache
        self._reserved += max_len
        return cache

    def free(self, session: Hashable) -> bool:
        """Drop a session's cache; False if it had none (closing twice is harmless)."""
        cache = self._caches.pop(session, None)
        if cache is None:
            return False
        self._reserved -= cache.max_len
        return True

    def stats(self) -> CacheStats:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        per_token = self.args.kv_bytes_per_token(self.num_layers, itemsize)
        used = sum(c.length for c in self._caches.values())
        return CacheStats(
            sessions=len(self._caches),
            tokens_reserved=self._reserved,
            bytes_reserved=self._reserved * per_token,
            bytes_used=used * per_token,
            max_sessions=self.max_sessions,
            max_tokens=self.max_tokens,
        )


def memory_in_use(device: torch.device) -> int:
    """What a new session's cache competes with: allocated GPU memory, or RSS on the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    return rss_bytes()


def cuda_memory(device: torch.device) -> dict[str, int]:
    """On cuda, what the caching allocator holds: an out-of-memory shard shows here first."""
    if device.type != "cuda":
        return {}
    free, total = torch.cuda.mem_get_info(device)
    return {
        "cuda_allocated_bytes": int(torch.cuda.memory_allocated(device)),
        "cuda_reserved_bytes": int(torch.cuda.memory_reserved(device)),
        # The whole device as the driver sees it (other processes' memory too).
        "cuda_used_bytes": int(total - free),
        "cuda_total_bytes": int(total),
    }
