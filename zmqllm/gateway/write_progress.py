"""Whether a client reads its response fast enough to keep its connection (and its slots).

A client that stops reading a stream holds its generation's slots for as long as the
server keeps writing into buffers nobody empties. Two ways past a plain "writes paused
too long" deadline, both seen in practice:

- Output that fits the kernel's buffers never pauses the writes: Linux grows a TCP send
  buffer to megabytes, which holds thousands of streamed tokens, so a client that reads
  nothing keeps its slots until its generation ends on its own.
- A client that reads a little now and then (48 KiB every 30 s) resumes the writes each
  time, and a deadline reset on every resume never comes.

So progress is judged by what the client took, not by the transport's state: the bytes
it has left unread (the transport's buffer plus what the kernel still holds, unsent or
unacknowledged) and the bytes delivered (written, less those unread). A connection with
more than ``max_unread`` bytes unread (or whose writes are paused) is *behind*; once it
has been behind for a whole window of ``window`` seconds, the bytes delivered over the
last window must be at least ``max_unread``. That is a floor of ``max_unread / window``
bytes a second (256 KiB per 30 s by default: 8.7 KB/s), asked only of a client that
already leaves more than that unread; one that reads nothing, or trickles, is cut about
one window after it fell behind, whatever it reads in between.

``WriteProgress`` takes the figures and decides; it knows no sockets, so its rules are
tested with plain numbers. The helpers below it are the few socket calls the gateway's
HTTP protocol (``zmqllm.gateway.http_server``) measures and cuts with.
"""

from __future__ import annotations

import contextlib
import fcntl
import socket
import struct
import sys
import termios
from collections import deque
from dataclasses import dataclass
from typing import Any

__all__ = [
    "Stalled",
    "WriteProgress",
    "bound_send_buffer",
    "reset_on_close",
    "unsent_in_kernel",
]

# Linux's SIOCOUTQ (= TIOCOUTQ on a TCP socket): bytes in the send queue, unsent or sent
# and not yet acknowledged. Elsewhere the request means something else or nothing.
_SIOCOUTQ: int | None = getattr(termios, "TIOCOUTQ", None) if sys.platform == "linux" else None


@dataclass(frozen=True)
class Stalled:
    """Why a connection is cut: its figures at the moment."""

    unread: int  # bytes written and not yet taken by the client
    delivered: int  # bytes the client took over the last window
    required: int  # what it had to take over that window
    behind_for: float  # seconds it has been behind


class WriteProgress:
    """One connection's write progress, sampled now and then; says when to cut it."""

    def __init__(self, window: float, max_unread: int) -> None:
        if window <= 0 or max_unread <= 0:
            raise ValueError("window and max_unread must be positive")
        self.window = window
        self.max_unread = max_unread
        self._behind_since: float | None = None
        # (time, bytes delivered in all) while behind, oldest first; the first one is the
        # newest at or before the start of the window, so the window is always covered.
        self._samples: deque[tuple[float, int]] = deque()

    @property
    def behind(self) -> bool:
        return self._behind_since is not None

    def observe(
        self, now: float, delivered: int, unread: int, paused: bool = False
    ) -> Stalled | None:
        """Take one sample (``delivered``: bytes the client took since the connection
        opened; ``unread``: bytes it has not taken yet; ``paused``: the transport refuses
        more); a ``Stalled`` when the connection should be cut, else None."""
        if not paused and unread <= self.max_unread:
            # Caught up (or never behind): the next time it falls behind starts afresh.
            self._behind_since = None
            self._samples.clear()
            return None
        if self._behind_since is None:
            self._behind_since = now
        samples = self._samples
        samples.append((now, delivered))
        start = now - self.window
        while len(samples) > 1 and samples[1][0] <= start:
            samples.popleft()
        behind_for = now - self._behind_since
        if behind_for < self.window:
            return None
        taken = delivered - samples[0][1]
        if taken >= self.max_unread:
            return None
        return Stalled(
            unread=unread, delivered=taken, required=self.max_unread, behind_for=behind_for
        )


def unsent_in_kernel(sock: Any) -> int | None:
    """Bytes the kernel holds for this socket, unsent or unacknowledged; None where the
    kernel cannot say (not Linux, not TCP, a closed socket)."""
    if _SIOCOUTQ is None:
        return None
    try:
        answer = fcntl.ioctl(sock.fileno(), _SIOCOUTQ, b"\0\0\0\0")
    except (OSError, ValueError):
        return None
    count: int = struct.unpack("i", answer)[0]
    return count


def bound_send_buffer(sock: Any, size: int) -> None:
    """Fix the socket's kernel send buffer at ``size`` bytes (Linux doubles it for its
    bookkeeping). Left alone Linux grows it to megabytes, which a client that reads
    nothing fills before the writes would ever pause; fixed, the transport pauses at a
    bounded backlog. A token stream needs far less than this to keep its pace."""
    with contextlib.suppress(OSError, AttributeError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)


def reset_on_close(sock: Any) -> None:
    """Make closing the socket drop what the kernel still holds for the client (a reset)
    instead of delivering it, at the client's pace, after the connection is gone."""
    with contextlib.suppress(OSError, AttributeError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
