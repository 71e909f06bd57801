"""Admission: how many generations run at once, and the bounded FIFO queue of the rest.

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
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

__all__ = ["Admission", "ClientGone", "QueueFull", "QueueTimeout"]


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
