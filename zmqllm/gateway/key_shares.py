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

A request's whole claim (every choice of it) is checked and taken in one step, with no
await between: a check that a later take follows lets concurrent requests of one key
each pass the check before any of them takes (8 requests of ``n=4`` against a share of
4 slots held 20). Each choice's part is then given back once, when its generation ends
or fails to start.

Socket-free: the admission gate (``admission.Gate``) claims and gives back, tests drive
it directly.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

import anyio

__all__ = ["TOKENIZING_PER_KEY", "Held", "KeyShares", "OverShare", "TokenizingTurns"]


# Prompts one key may have tokenizing at once; its others wait their turn. Tokenizing a
# body near max_body_bytes costs a core most of a second: 16 at once from one key held
# every tokenizer thread while other keys' small prompts waited behind them.
TOKENIZING_PER_KEY = 2


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

    def claim(self, tenant: str | None, kv_each: Sequence[int]) -> list[Held]:
        """Check and take a slot and its KV tokens for each choice, atomically; OverShare
        (nothing taken) past the share."""
        self.check(tenant, len(kv_each), sum(kv_each))
        held = []
        for kv in kv_each:
            self.take(tenant, kv)
            held.append(Held(self, tenant, kv))
        return held

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


class Held:
    """One choice's slot and KV tokens of its key's share; ``give`` returns them once,
    however many of the paths that end a generation call it."""

    __slots__ = ("_shares", "admitted", "given", "kv_tokens", "tenant")

    def __init__(self, shares: KeyShares, tenant: str | None, kv_tokens: int) -> None:
        self._shares = shares
        self.tenant = tenant
        self.kv_tokens = kv_tokens
        self.admitted = False  # its generation's admission gives it back from then on
        self.given = False

    def give(self) -> None:
        if not self.given:
            self.given = True
            self._shares.give(self.tenant, self.kv_tokens)


class TokenizingTurns:
    """At most TOKENIZING_PER_KEY prompts of one key tokenizing at once (a request with
    no tenant, on a gateway of one tenant, is not held back)."""

    def __init__(self, per_key: int = TOKENIZING_PER_KEY) -> None:
        self.per_key = per_key
        self._turns: dict[str, anyio.Semaphore] = {}
        self._users: Counter[str] = Counter()

    @property
    def keys(self) -> int:
        """Keys with a prompt tokenizing or waiting to (a semaphore is kept per key only
        while it is in use)."""
        return len(self._turns)

    @asynccontextmanager
    async def turn(self, tenant: str | None) -> AsyncIterator[None]:
        if tenant is None:
            yield
            return
        turns = self._turns.setdefault(tenant, anyio.Semaphore(self.per_key))
        self._users[tenant] += 1
        try:
            async with turns:
                yield
        finally:
            self._users[tenant] -= 1
            if self._users[tenant] <= 0:
                del self._users[tenant]
                del self._turns[tenant]
