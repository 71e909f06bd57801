"""What the gateway needs from the broker client, as Protocols.

The gateway codes against these shapes rather than importing ``zmqllm.client.broker_client``, so its
tests drive it with an in-process fake and the HTTP layer never depends on ZeroMQ
sockets. ``zmqllm.client.broker_client.BrokerClient`` satisfies them; failures are
``messages.SessionError`` (a socket-free module), with an ``ErrorCode``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from types import TracebackType
from typing import Any, Protocol

from zmqllm.bus.messages import AskKind, SessionError
from zmqllm.bus.sampling_params import SamplingParams

__all__ = [
    "BrokerClientLike",
    "TokenEventLike",
    "TokenStreamLike",
    "broker_error_fields",
]


class TokenEventLike(Protocol):
    """One sampled token; ``finish`` is None, "length" or "stop" (a stop/EOS token)."""

    @property
    def token(self) -> int: ...

    @property
    def step(self) -> int: ...

    @property
    def finish(self) -> str | None: ...

    @property
    def logprobs(self) -> tuple[tuple[int, ...], tuple[float, ...]] | None:
        """(ids, log-probabilities), the sampled token's first; None unless asked for."""


class TokenStreamLike(Protocol):
    """One generation session; leaving the context before it finished cancels it."""

    @property
    def session(self) -> str: ...

    @property
    def route(self) -> list[str]: ...

    async def __aenter__(self) -> TokenStreamLike: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None: ...

    def __aiter__(self) -> AsyncIterator[TokenEventLike]: ...

    async def cancel(self) -> None: ...


class BrokerClientLike(Protocol):
    async def start(self) -> None: ...

    async def close(self) -> None: ...

    @property
    def connected(self) -> bool: ...

    @property
    def dropped(self) -> Mapping[str, int]:
        """Messages from the broker the client dropped or failed on, by reason (/metrics)."""
        ...

    def generate(
        self,
        *,
        request_id: str,
        prompt: Sequence[int],
        max_tokens: int,
        sampling: SamplingParams,
        stop_ids: Sequence[int],
        session: str | None = None,
        model: str = "",
    ) -> TokenStreamLike: ...

    def ask(
        self,
        *,
        request_id: str,
        model: str,
        kind: AskKind,
        fields: Mapping[str, Any],
        max_tokens: int,
        session: str | None = None,
    ) -> TokenStreamLike:
        """A text model's answer: its events are client.streams.DeltaEvent."""
        ...

    async def status(self, timeout: float = 2.0) -> dict[str, Any]: ...


def broker_error_fields(exc: BaseException) -> tuple[str, str] | None:
    """``(code, message)`` if ``exc`` is a generation failure the client reported, else None.

    The client raises ``messages.SessionError``, whose code is an ``ErrorCode``; the code
    comes back as its plain string value, the word logs and JSON error bodies carry.
    """
    if isinstance(exc, SessionError):
        return exc.code.value, exc.message
    return None
