"""What the broker's session table holds, without sockets: a request waiting for a route
(``Pending``), one routed attempt of it (``Session``), a message to send (``Out``) and
the counters."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from zmqllm.broker.route_build import RouteBuild
from zmqllm.bus.messages import MAX_GENERATED, Ask, Message, Open
from zmqllm.bus.prefix import prefix_chain

__all__ = ["Key", "Out", "Pending", "Session", "SessionStats"]

Key = tuple[bytes, str]  # (client routing id, client's session id)


@dataclass(frozen=True, slots=True)
class Out:
    """One message to send: to a worker (by routing id) or a client; ``frames`` are
    pre-encoded frames forwarded as received (activations). Made by ``to_worker`` or
    ``to_client``, which name the socket it leaves on."""

    for_worker: bool  # True: the backend socket; False: the frontend
    identity: bytes
    msg: Message | None = None
    frames: Sequence[Any] | None = None

    @classmethod
    def to_worker(
        cls, identity: bytes, msg: Message | None = None, *, frames: Sequence[Any] | None = None
    ) -> Out:
        return cls(True, identity, msg, frames)

    @classmethod
    def to_client(cls, identity: bytes, msg: Message) -> Out:
        return cls(False, identity, msg)


@dataclass
class Pending:
    """A request waiting for a route: its client and OPEN (the prompt a view of the
    received frame, forwarded to stage 0 without a copy), or ASK for a text model."""

    client: bytes
    open: Open | Ask
    enqueued: float
    attempts: int = 0
    # A replay's: only workers of its stream's build may route it (route_build.py).
    build: RouteBuild | None = None
    # It was logged once as waiting for its build while routes of another had room.
    waiting_noted: bool = False
    _chain: tuple[int, ...] | None = None

    @property
    def key(self) -> Key:
        return (self.client, self.open.session)

    @property
    def generated(self) -> tuple[int, ...]:
        """A replay's tokens so far (the end of its prompt), when the last stage needs
        them to sample (penalties, a grammar): at most MAX_GENERATED, the latest."""
        if not isinstance(self.open, Open):
            return ()
        sampling, tokens = self.open.sampling, self.open.tokens
        done = min(sampling.first_step, MAX_GENERATED, self.open.prompt_len)
        if not done or not sampling.needs_history or tokens is None:
            return ()
        return tuple(int(t) for t in tokens.array[-done:])

    @property
    def chain(self) -> tuple[int, ...]:
        """The prompt's prefix keys (prefix.prefix_chain), computed once."""
        if self._chain is None:
            tokens = self.open.tokens if isinstance(self.open, Open) else None
            self._chain = prefix_chain(tokens.array) if tokens is not None else ()
        return self._chain

    @property
    def max_len(self) -> int:
        if isinstance(self.open, Ask):
            return self.open.max_tokens  # a remote model's: reserved only to count load
        return self.open.prompt_len + self.open.max_tokens


@dataclass
class Session:
    request: Pending
    wire: str  # the id workers know it by
    route: list[str]  # worker ids, stage order
    last_active: float  # any message about it from its route (inactivity deadline)
    next_step: int = 0  # the step of the TOKEN expected next
    build: tuple[str, ...] = ()  # the route's build (route_build.py), for the first TOKEN

    @property
    def key(self) -> Key:
        return self.request.key

    @property
    def attempt(self) -> int:
        return self.request.attempts

    @property
    def request_id(self) -> str:
        return self.request.open.request_id

    @property
    def streamed(self) -> bool:
        """A token reached the client: the request can no longer start over unseen."""
        return self.next_step > 0


@dataclass
class SessionStats:
    opened: int = 0
    finished: int = 0
    failed: int = 0
    tokens: int = 0
    # Work the broker passed from stage to stage itself (activations, next steps): none
    # on routes whose workers have peer links.
    relayed: int = 0
