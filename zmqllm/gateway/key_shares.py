"""Fair share between API keys: what one key holds of the gateway's generation slots and
of the cluster's KV cache, and the 429 past its share.

Without a limit, one request (``n=8``, ``max_tokens`` near the context, ``ignore_eos``)
or one key sending many of them holds every slot and every KV token while others queue
and time out. Each key may hold at most ``key_max_concurrent`` slots (a choice of ``n``
is one) and ``key_max_kv_tokens`` reserved KV tokens (prompt + ``max_tokens`` per choice);
by default half of ``max_concurrent`` and half of the KV the cluster's workers offer for
the model (its smallest pool's, from the broker's status), so a key can never take more
than half the cluster while others wait. A request past its key's share gets 429 with
``Retry-After`` at once, before it queues. Shares apply when the gateway has two API keys
or more (one key is one tenant; an open gateway has none to tell apart).

Socket-free: the admission gate (``admission.Gate``) claims and gives back, tests drive
it directly.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["KeyShares", "OverShare"]


@dataclass(frozen=True)
class OverShare(Exception):
    """A key asked for more than its share: what, and the figures."""

    what: str  # "slots" or "KV tokens"
    held: int
    asked: int
    limit: int

    def message(self) -> str:
        return (
            f"this API key holds {self.held} {self.what} and asks for {self.asked} more; "
            f"one key may hold at most {self.limit} at once (its share of the cluster); "
            "retry when its other requests have finished"
        )


class KeyShares:
    """Slots and KV tokens held per key (a tenant id, never the key itself)."""

    def __init__(
        self,
        max_slots: int,
        max_kv_tokens: int,
        cluster_kv_tokens: Callable[[], int | None] = lambda: None,
    ) -> None:
        self.max_slots = max_slots
        self.max_kv_tokens = max_kv_tokens  # 0: half of what the cluster offers
        self._cluster_kv = cluster_kv_tokens
        self.slots: Counter[str] = Counter()
        self.kv_tokens: Counter[str] = Counter()

    def kv_limit(self) -> int | None:
        if self.max_kv_tokens:
            return self.max_kv_tokens
        offered = self._cluster_kv()
        return None if not offered else max(1, offered // 2)

    def check(self, tenant: str | None, slots: int, kv_tokens: int) -> None:
        """OverShare if ``tenant`` may not take ``slots`` and ``kv_tokens`` more."""
        if tenant is None:
            return
        if self.slots[tenant] + slots > self.max_slots:
            raise OverShare("generation slots", self.slots[tenant], slots, self.max_slots)
        limit = self.kv_limit()
        if limit is not None and self.kv_tokens[tenant] + kv_tokens > limit:
            raise OverShare("KV tokens", self.kv_tokens[tenant], kv_tokens, limit)

    def take(self, tenant: str | None, kv_tokens: int) -> None:
        """One choice's slot and its KV tokens, held until ``give``."""
        if tenant is not None:
            self.slots[tenant] += 1
            self.kv_tokens[tenant] += kv_tokens

    def give(self, tenant: str | None, kv_tokens: int) -> None:
        if tenant is None:
            return
        self.slots[tenant] -= 1
        self.kv_tokens[tenant] -= kv_tokens
        if self.slots[tenant] <= 0:
            del self.slots[tenant]
            self.kv_tokens.pop(tenant, None)
