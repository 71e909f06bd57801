"""Admission: which generations run, and when.

``Gate`` admits one request's generations: its API key's share (``key_shares``), a live
broker link, then a slot of ``Admission``, the bound on generations running at once and
the bounded FIFO queue of the rest. What it refuses becomes the HTTP answer (429, 503).

Past ``max_concurrent`` running generations a request waits for a slot in arrival order
instead of being refused; only past ``max_queued`` waiting requests is it refused (429),
so a burst larger than the cluster's capacity is served late rather than not at all.
A waiting request leaves the queue when its client disconnects, when it is cancelled,
or when it has waited ``queue_timeout`` seconds: a slot is never held for nobody.

A slot freed while requests wait goes straight to the oldest waiter, so a new request
cannot overtake the queue between a release and the waiter waking up.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio
from starlette.requests import Request

from zmqllm.config.settings import GatewaySettings
from zmqllm.gateway.backend import BrokerClientLike
from zmqllm.gateway.errors import CLIENT_CLOSED, RETRY_AFTER_S, APIError, broker_failure
from zmqllm.gateway.key_shares import Held, KeyShares, OverShare
from zmqllm.gateway.request_context import RequestRecord, client_disconnected

__all__ = ["Admission", "ClientGone", "Gate", "QueueFull", "QueueTimeout", "Release"]

# Seconds a request gives a broker link that looks dead to show it is alive. The link's
# liveness is the time since the broker's last message was read, and while the event loop
# was busy (a burst of requests parsed and tokenized at once) the broker's messages wait
# unread: the link only looks stale until the loop gets to them.
LINK_GRACE_S = 0.5
LINK_POLL_S = 0.01

# Gives an admitted generation's slot and KV share back; calling it again does nothing.
Release = Callable[[], Awaitable[None]]


class QueueFull(Exception):
    """Every slot is taken and ``max_queued`` requests already wait."""


class QueueTimeout(Exception):
    """The request waited ``queue_timeout`` seconds without getting a slot."""


class ClientGone(Exception):
    """The client disconnected while its request waited."""


class _Waiter:
    __slots__ = ("event", "granted")

    def __init__(self) -> None:
        self.event = anyio.Event()
        self.granted = False


class Admission:
    """At most ``max_concurrent`` slots held; at most ``max_queued`` requests waiting."""

    def __init__(self, max_concurrent: int, max_queued: int, queue_timeout: float) -> None:
        self.max_concurrent = max_concurrent
        self.max_queued = max_queued
        self.queue_timeout = queue_timeout
        self.running = 0
        self._waiters: deque[_Waiter] = deque()

    @property
    def queued(self) -> int:
        return len(self._waiters)

    async def acquire(self, disconnected: Callable[[], Awaitable[Any]] | None = None) -> None:
        """Take a slot, waiting in line for one if need be.

        ``disconnected`` returns when the client has gone; it is watched only while the
        request waits. Raises QueueFull at once when the line is full, QueueTimeout or
        ClientGone when the request gives up its place.
        """
        if self.running < self.max_concurrent and not self._waiters:
            self.running += 1
            return
        if len(self._waiters) >= self.max_queued:
            raise QueueFull
        waiter = _Waiter()
        self._waiters.append(waiter)
        gone = False
        try:
            with anyio.fail_after(self.queue_timeout):
                if disconnected is None:
                    await waiter.event.wait()
                else:
                    async with anyio.create_task_group() as tasks:

                        async def watch() -> None:
                            nonlocal gone
                            await disconnected()
                            gone = True
                            tasks.cancel_scope.cancel()

                        tasks.start_soon(watch)
                        await waiter.event.wait()
                        tasks.cancel_scope.cancel()
        except BaseException as exc:
            self._leave(waiter)
            if isinstance(exc, TimeoutError):
                raise QueueTimeout from None
            raise
        if gone:
            # Even if a slot reached it at the same moment: nobody is there to use it.
            self._leave(waiter)
            raise ClientGone

    def release(self) -> None:
        """Give a slot back: to the oldest waiter if there is one."""
        if self._waiters:
            waiter = self._waiters.popleft()
            waiter.granted = True
            waiter.event.set()
        else:
            self.running -= 1

    def _leave(self, waiter: _Waiter) -> None:
        """A waiter gives up: out of the line, or, if a slot reached it meanwhile, that
        slot passed on to the next one."""
        if waiter.granted:
            waiter.granted = False
            self.release()
        else:
            with contextlib.suppress(ValueError):
                self._waiters.remove(waiter)


class Gate:
    """Admits generations: the key's share, the broker link, a slot (``Admission``)."""

    def __init__(
        self,
        settings: GatewaySettings,
        client: BrokerClientLike,
        cluster_kv_tokens: Callable[[], int | None],
    ) -> None:
        self.settings = s = settings
        self.client = client
        self.queue = Admission(s.max_concurrent, s.max_queued, s.queue_timeout)
        self.shares = KeyShares(
            s.key_max_concurrent or max(1, s.max_concurrent // 2),
            s.key_max_kv_tokens,
            cluster_kv_tokens,
        )

    def precheck(self, record: RequestRecord, choices: int) -> None:
        """Before a request's prompt is tokenized (its KV tokens not known yet): 429 at once
        if its key's slots, or the gateway's queue, leave no room for ``choices``
        generations, so a request bound to be refused costs no tokenizing. claim_share
        decides for good once the request is planned."""
        try:
            self.shares.check(record.tenant, choices, 0)
        except OverShare as over:
            raise self._over_share(record, over) from None
        q = self.queue
        if q.running + choices > q.max_concurrent and q.queued >= q.max_queued:
            raise self._queue_full(record)

    def claim_share(self, record: RequestRecord, kv_each: Sequence[int]) -> list[Held]:
        """Take the request's slots (one per choice) and KV tokens from its key's share,
        or 429 at once past it (key_shares). Each part is the admitted generation's to
        give back (``admit``); one never admitted must be given back by its caller."""
        try:
            return self.shares.claim(record.tenant, kv_each)
        except OverShare as over:
            raise self._over_share(record, over) from None

    def _over_share(self, record: RequestRecord, over: OverShare) -> APIError:
        record.error = "key_share_exceeded"
        return APIError(
            429,
            over.message(),
            code="key_share_exceeded",
            type="rate_limit_error",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )

    def _queue_full(self, record: RequestRecord) -> APIError:
        s = self.settings
        record.error = "too_many_requests"
        return APIError(
            429,
            f"the gateway is at its limit of {s.max_concurrent} running and "
            f"{s.max_queued} queued requests; retry shortly",
            code="too_many_requests",
            type="rate_limit_error",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )

    async def admit(self, record: RequestRecord, request: Request | None, held: Held) -> Release:
        """Wait for a slot; errors become APIError. ``held`` (claim_share: counted against
        the request's key from the claim on, queued too, so concurrent requests of one key
        see each other) is given back with the slot by the returned release, or at once
        if no slot is admitted."""
        held.admitted = True
        try:
            # Fail fast: an OPEN sent into a dead link would only time out much later.
            # Checked before queueing (no wait for a dead broker) and again once a slot
            # is free.
            await self._check_broker_link(record)
            await self._admit(record, request)
        except BaseException:
            held.give()
            raise
        try:
            await self._check_broker_link(record)
        except BaseException:
            self.queue.release()
            held.give()
            raise
        released = False

        async def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.queue.release()
                held.give()

        return release

    async def _check_broker_link(self, record: RequestRecord) -> None:
        """503 unless the broker link is alive, or shows it is within LINK_GRACE_S."""
        deadline = time.monotonic() + LINK_GRACE_S
        while not self.client.connected:
            if time.monotonic() >= deadline:
                record.error = "broker_unreachable"
                raise broker_failure(
                    "broker_unreachable",
                    f"the gateway has no connection to the broker at {self.settings.broker}; "
                    "retry shortly",
                )
            await anyio.sleep(LINK_POLL_S)

    async def _admit(self, record: RequestRecord, request: Request | None) -> None:
        """Take a generation slot, waiting in the queue if all are taken."""
        s = self.settings
        disconnected = None if request is None else (lambda: client_disconnected(request))
        try:
            await self.queue.acquire(disconnected)
        except QueueFull:
            raise self._queue_full(record) from None
        except QueueTimeout:
            record.error = "queue_timeout"
            raise APIError(
                503,
                f"no generation slot became free within the queue timeout of "
                f"{s.queue_timeout:g} s; retry shortly",
                code="queue_timeout",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            ) from None
        except ClientGone:
            record.error = record.finish_reason = "cancelled"
            raise APIError(
                CLIENT_CLOSED, "the client closed the request while it was queued"
            ) from None
