"""The broker's session lifecycle, without sockets (see SessionTable)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from zmqllm.protocol import Header

@dataclass
class Pending:
    """A request waiting for a route: the client, its OPEN header, the prompt frame."""

    client: bytes
    header: Header
    tokens: Any  # the received zmq.Frame, forwarded untouched to stage 0
    max_len: int
    enqueued: float = field(default_factory=time.monotonic)
    attempts: int = 0  # routes tried (a stage that turns out full sends it back)

    @property
    def session(self) -> str:
        return self.header.session


@dataclass
class Session:
    id: str
    client: bytes
    request_id: str
    route: list[str]  # worker ids, stage order
    max_len: int
    max_tokens: int
    step: int = 0
    # Kept until the first token reaches the client: a request refused by a full stage or
    # whose worker is lost before then is queued again (the client has lost nothing).
    pending: Pending | None = None
    opened: float = field(default_factory=time.monotonic)
    # The id the workers know this attempt by (the session id, then "<session>.<attempt>"
    # after a requeue): messages of an earlier attempt, still in flight, match nothing.
    wire: str = ""


