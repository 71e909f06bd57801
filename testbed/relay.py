"""A TCP relay that delays each direction's bytes: a link's latency where the kernel has
no netem (``tc`` answers "unknown qdisc kind").

Every piece read from one side is stamped on arrival and written to the other side
``delay`` seconds later, in order. Pieces are not delayed one after another: ten pieces
that arrive 1 ms apart leave 1 ms apart, ``delay`` after each came, as on a wire of that
latency (``DelayLine`` holds that rule, apart from the sockets). A half-close goes
through once the bytes before it have; a reset closes both sides.

    python -m testbed.relay --listen 198.18.0.1:6002 --to 198.18.0.1:5556 --delay-ms 5

prints ``relay listening on HOST:PORT`` once it accepts, and runs until killed;
``--delay-file FILE`` instead of ``--delay-ms`` takes the delay from a file, again each
time it changes.
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

__all__ = ["Delay", "DelayLine", "main", "serve"]

READ_BYTES = 1 << 16
# Bytes one direction may hold before it stops reading: the sender then meets TCP's
# own back-pressure, as it would on a link whose buffers are full.
MAX_QUEUED_BYTES = 64 << 20
WATCH_S = 0.05  # how often a delay file is looked at


class DelayLine:
    """Pieces of bytes in arrival order, each due ``delay`` seconds after it came."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.pieces: deque[tuple[float, bytes]] = deque()
        self.queued = 0  # bytes held

    def put(self, data: bytes, now: float) -> None:
        self.pieces.append((now + self.delay, data))
        self.queued += len(data)

    def next_due(self) -> float | None:
        """When the oldest piece is due (None: nothing held)."""
        return self.pieces[0][0] if self.pieces else None

    def take_due(self, now: float) -> bytes:
        """Every piece due by ``now``, joined in order (b"" if none is)."""
        out = []
        while self.pieces and self.pieces[0][0] <= now:
            out.append(self.pieces.popleft()[1])
        data = b"".join(out)
        self.queued -= len(data)
        return data


class Delay:
    """The one-way delay in seconds. With a file (milliseconds, as text) it follows the
    file: a benchmark changes the delay between rounds without breaking a connection.
    Each change is printed (``delay 5.0 ms``) once it is in force."""

    def __init__(self, seconds: float, path: Path | None = None) -> None:
        self.seconds = seconds
        self.path = path
        if path is not None:
            self._read_file(None)
            threading.Thread(target=self._watch, daemon=True).start()

    def _read_file(self, seen: tuple[int, int] | None) -> tuple[int, int] | None:
        assert self.path is not None
        try:
            st = self.path.stat()
            key = (st.st_mtime_ns, st.st_size)
            if key != seen:
                self.seconds = float(self.path.read_text()) / 1000.0
                print(f"delay {self.seconds * 1000.0:g} ms", flush=True)
            return key
        except (OSError, ValueError):  # missing or half-written: keep the last value
            return seen

    def _watch(self) -> None:
        seen = None
        while True:
            seen = self._read_file(seen)
            time.sleep(WATCH_S)


class _Direction:
    """One direction of one connection: a reader thread stamps what ``src`` sends, a
    writer thread hands it to ``dst`` when due (time.sleep wakes within ~0.1 ms, where
    an event loop's timers are rounded up to whole milliseconds)."""

    def __init__(self, src: socket.socket, dst: socket.socket, delay: Delay, on_end: Any) -> None:
        self.src, self.dst = src, dst
        self.delay = delay
        self.line = DelayLine(delay.seconds)
        self.cond = threading.Condition()
        self.ended = False  # src said EOF, or failed
        self.failed = False
        self.on_end = on_end
        for target in (self._read, self._write):
            threading.Thread(target=target, daemon=True).start()

    def _read(self) -> None:
        try:
            while data := self.src.recv(READ_BYTES):
                with self.cond:
                    # A changed delay applies from the next piece; one due before an
                    # older piece still leaves after it (take_due keeps the order).
                    self.line.delay = self.delay.seconds
                    self.line.put(data, time.monotonic())
                    self.cond.notify_all()
                    while self.line.queued > MAX_QUEUED_BYTES and not self.failed:
                        self.cond.wait()
        except OSError:
            self.failed = True
        with self.cond:
            self.ended = True
            self.cond.notify_all()

    def _write(self) -> None:
        try:
            while True:
                with self.cond:
                    while self.line.next_due() is None and not self.ended:
                        self.cond.wait()
                    due = self.line.next_due()
                    if due is None or self.failed:
                        break
                # Pieces that arrive meanwhile are due later than this one: sleeping
                # until the oldest is due never holds a younger piece past its time.
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                with self.cond:
                    data = self.line.take_due(time.monotonic())
                    self.cond.notify_all()  # room for the reader
                self.dst.sendall(data)
            if not self.failed:
                self.dst.shutdown(socket.SHUT_WR)  # the half-close, after the bytes
        except OSError:
            self.failed = True
        self.on_end(self)


class _Connection:
    """Both directions; a failure on either (a reset) closes both sockets at once, and
    the sockets are closed when both directions have ended."""

    def __init__(self, down: socket.socket, up: socket.socket, delay: Delay) -> None:
        self.socks = (down, up)
        self.lock = threading.Lock()
        self.open = 2
        for s in self.socks:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _Direction(down, up, delay, self._ended)
        _Direction(up, down, delay, self._ended)

    def _ended(self, direction: _Direction) -> None:
        with self.lock:
            self.open -= 1
            last = self.open == 0
        if direction.failed:
            for s in self.socks:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
        if last or direction.failed:
            with direction.cond:
                direction.cond.notify_all()
        if last:
            for s in self.socks:
                s.close()


def serve(listen: tuple[str, int], target: tuple[str, int], delay: Delay) -> None:
    """Relay every connection to ``listen`` to ``target``, forever."""
    server = socket.create_server(listen, reuse_port=False)
    print(f"relay listening on {listen[0]}:{server.getsockname()[1]}", flush=True)
    while True:
        down, _ = server.accept()
        try:
            up = socket.create_connection(target, timeout=10)
            up.settimeout(None)
        except OSError as exc:
            print(f"relay: cannot reach {target[0]}:{target[1]}: {exc}", file=sys.stderr)
            down.close()
            continue
        _Connection(down, up, delay)


def _endpoint(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: expected HOST:PORT")
    return host, int(port)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--listen", type=_endpoint, required=True, metavar="HOST:PORT")
    ap.add_argument("--to", type=_endpoint, required=True, metavar="HOST:PORT")
    ap.add_argument("--delay-ms", type=float, default=0.0, help="each way (default 0)")
    ap.add_argument(
        "--delay-file",
        type=Path,
        metavar="FILE",
        help="read the delay (ms) from FILE instead, again whenever it changes",
    )
    a = ap.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        serve(a.listen, a.to, Delay(a.delay_ms / 1000.0, a.delay_file))


if __name__ == "__main__":
    main()
