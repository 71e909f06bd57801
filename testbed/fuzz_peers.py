"""Hostile peers on a live bus: what the live fuzz test and ``benchmarks/fuzz_bus.py`` run
against a broker (the messages themselves come from ``testbed.fuzz``).

- ``blast`` sends hostile messages to a broker's two ROUTER sockets from DEALER peers
  with random routing ids, churning peers (backend peers often reuse an earlier id, so
  ROUTER_HANDOVER moves it), reading the replies on half of the peers and never on the
  others (slow readers), and never blocking: each send is non-blocking under a small
  high-water mark and dropped on EAGAIN.
- ``VictimStreams`` runs greedy streams one after another through the real broker
  client, each with a session id the fuzzer is told, so foreign CANCELs name it.
- ``ChatStreams`` does the same through the gateway's ``POST /chat`` (session ids unknown).
- ``StatusPoller`` asks the broker for its status the whole time, each with a deadline.
"""

from __future__ import annotations

import asyncio
import http.client
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from testbed.fuzz import hostile_messages
from zmqllm.bus.messages import SessionError
from zmqllm.bus.sampling_params import SamplingParams
from zmqllm.client.broker_client import BrokerClient
from zmqllm.client.request import GenerateRequest
from zmqllm.client.status import fetch_status

__all__ = [
    "BlastStats",
    "ChatResult",
    "ChatStreams",
    "HostilePeers",
    "StatusPoller",
    "VictimResult",
    "VictimStreams",
    "blast",
]

Rng = np.random.Generator

# close() never waits: ZeroMQ's I/O thread flushes what a closed peer still holds for
# this long, and only Context.term() waits for it. Counted as sent, a message should go.
LINGER_MS = 1000


@dataclass
class BlastStats:
    """What one socket's peers did."""

    sent: int = 0
    dropped: int = 0  # EAGAIN at the send high-water mark: dropped, never waited for
    replies: int = 0  # messages the broker sent back, read and thrown away
    new_peers: int = 0  # peers closed and replaced (with a new or a reused routing id)
    seconds: float = 0.0


class HostilePeers:
    """DEALER peers of one ROUTER address sending hostile messages without blocking."""

    def __init__(
        self,
        ctx: zmq.Context[Any],
        address: str,
        rng: Rng,
        *,
        peers: int = 8,
        reuse_ids: float = 0.0,
        hwm: int = 64,
        churn_every: int = 256,
        known_ids: tuple[bytes, ...] = (),
    ) -> None:
        self.ctx, self.address, self.rng = ctx, address, rng
        self.reuse_ids, self.hwm, self.churn_every = reuse_ids, hwm, churn_every
        self.stats = BlastStats()
        # Ids to take as their own (with reuse_ids): e.g. the real workers'.
        self._used_ids: list[bytes] = list(known_ids)
        self._peers = [self._peer() for _ in range(peers)]

    def _peer(self) -> zmq.Socket[Any]:
        if self._used_ids and self.rng.random() < self.reuse_ids:
            # ROUTER_HANDOVER gives the id to the newest connection.
            identity = self._used_ids[int(self.rng.integers(len(self._used_ids)))]
        else:
            # A routing id starting with a zero byte is reserved by ZeroMQ.
            identity = bytes([int(self.rng.integers(1, 256))]) + self.rng.bytes(
                int(self.rng.integers(0, 32))
            )
            self._used_ids.append(identity)
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, self.hwm)
        sock.setsockopt(zmq.RCVHWM, self.hwm)
        sock.setsockopt(zmq.IDENTITY, identity)
        sock.connect(self.address)
        return sock

    def send(self, frames: list[bytes]) -> None:
        i = int(self.rng.integers(len(self._peers)))
        try:
            self._peers[i].send_multipart(frames, flags=zmq.NOBLOCK)
            self.stats.sent += 1
        except zmq.Again:
            self.stats.dropped += 1
        n = self.stats.sent + self.stats.dropped
        if n % self.churn_every == 0:
            self._peers[i].close(linger=LINGER_MS)
            self._peers[i] = self._peer()
            self.stats.new_peers += 1
        if n % 64 == 0:
            self._read_replies()

    def _read_replies(self) -> None:
        # The first half reads what the broker sends; the others never do.
        for sock in self._peers[: len(self._peers) // 2]:
            for _ in range(256):
                try:
                    sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self.stats.replies += 1

    def close(self) -> None:
        for sock in self._peers:
            sock.close(linger=LINGER_MS)
        self._peers = []


def blast(
    ctx: zmq.Context[Any],
    frontend: str,
    backend: str,
    *,
    messages: int,
    sessions: list[str],
    seed: int = 0,
    peers: int = 8,
    more: dict[str, tuple[str, tuple[bytes, ...]]] | None = None,
) -> dict[str, BlastStats]:
    """Send ``messages`` hostile messages (sent or dropped) to each of a broker's
    sockets, alternating. ``sessions`` may grow meanwhile: new ids are named from then
    on. Frontend peers get fresh random ids; backend peers often reuse earlier ones.
    ``more``: other sockets by name (workers' peer links), each with routing ids its
    peers often take (the real workers')."""
    extra = more or {}
    seeds = np.random.SeedSequence(seed).spawn(4 + 2 * len(extra))
    sides = {
        "frontend": (
            HostilePeers(ctx, frontend, np.random.default_rng(seeds[0]), peers=peers),
            hostile_messages(np.random.default_rng(seeds[1]), sessions=sessions),
        ),
        "backend": (
            HostilePeers(ctx, backend, np.random.default_rng(seeds[2]), peers=peers, reuse_ids=0.5),
            hostile_messages(np.random.default_rng(seeds[3]), sessions=sessions),
        ),
    }
    for i, (side, (address, ids)) in enumerate(extra.items()):
        rng = np.random.default_rng(seeds[4 + 2 * i])
        sides[side] = (
            HostilePeers(ctx, address, rng, peers=peers, reuse_ids=0.5, known_ids=ids),
            hostile_messages(np.random.default_rng(seeds[5 + 2 * i]), sessions=sessions),
        )
    started = time.monotonic()
    try:
        for _ in range(messages):
            for sender, gen in sides.values():
                sender.send(next(gen))
    finally:
        for sender, _ in sides.values():
            sender.stats.seconds = time.monotonic() - started
            sender.close()
    return {side: sender.stats for side, (sender, _) in sides.items()}


@dataclass
class VictimResult:
    session: str
    prompt: list[int]
    tokens: list[int]
    error: str | None  # "code: message" of a failed stream
    started: float  # time.monotonic()
    ended: float


class VictimStreams:
    """Greedy streams, one after another until stopped, through a ``BrokerClient`` of
    their own. Each session id is appended to ``sessions`` before its OPEN is sent: a
    fuzzer given the same list names it from then on."""

    def __init__(
        self,
        address: str,
        prompts: Sequence[Sequence[int]],
        *,
        max_tokens: int,
        stop_ids: Sequence[int],
        sessions: list[str],
        connect_timeout: float = 30.0,
        heartbeat: float = 1.0,
        model: str = "",
    ) -> None:
        self.address = address
        self.model = model  # "": the broker's only model
        self.prompts = [list(p) for p in prompts]
        self.max_tokens = max_tokens
        self.stop_ids = list(stop_ids)
        self.sessions = sessions
        self.connect_timeout = connect_timeout
        self.heartbeat = heartbeat
        self.results: list[VictimResult] = []
        self.crashed: BaseException | None = None  # the thread's own failure, if any
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="victim-streams", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wait_for(self, count: int, timeout: float) -> bool:
        """Until ``count`` streams have ended (True) or ``timeout`` passed (False)."""
        deadline = time.monotonic() + timeout
        while len(self.results) < count and time.monotonic() < deadline:
            if not self._thread.is_alive():
                break
            time.sleep(0.05)
        return len(self.results) >= count

    def stop(self, timeout: float) -> None:
        """Let the stream under way finish, then stop (at most ``timeout`` seconds)."""
        self._stop.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # reported by the test, not lost in a thread
            self.crashed = exc

    async def _main(self) -> None:
        client = BrokerClient(self.address, heartbeat_interval=self.heartbeat)
        await client.start()
        try:
            deadline = time.monotonic() + self.connect_timeout
            while not client.connected:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no broker at {self.address}")
                await asyncio.sleep(0.05)
            i = 0
            while not self._stop.is_set():
                await self._one(client, i)
                i += 1
        finally:
            await client.close()

    async def _one(self, client: BrokerClient, i: int) -> None:
        prompt = self.prompts[i % len(self.prompts)]
        session = f"victim-{uuid.uuid4().hex[:12]}-{i}"
        self.sessions.append(session)
        tokens: list[int] = []
        error = None
        started = time.monotonic()
        try:
            request = GenerateRequest(
                request_id=session,
                prompt=tuple(prompt),
                max_tokens=self.max_tokens,
                sampling=SamplingParams(),
                stop_ids=tuple(self.stop_ids),
                session=session,
                model=self.model,
            )
            stream = client.generate(request)
            async with stream:
                async for event in stream:
                    tokens.append(event.token)
        except SessionError as exc:
            error = f"{exc.code.value}: {exc.message}"
        end = time.monotonic()
        self.results.append(VictimResult(session, prompt, tokens, error, started, end))


@dataclass
class ChatResult:
    prompt: str
    status: int  # the HTTP status, -1 when the connection failed
    text: str
    started: float
    ended: float


class ChatStreams:
    """``POST /chat`` requests to a gateway, one after another until stopped, each read
    to its end (the text streams as it is made)."""

    def __init__(self, port: int, prompts: Sequence[str], *, max_tokens: int) -> None:
        self.port = port
        self.prompts = list(prompts)
        self.max_tokens = max_tokens
        self.results: list[ChatResult] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chat-streams", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wait_for(self, count: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while len(self.results) < count and time.monotonic() < deadline:
            time.sleep(0.05)
        return len(self.results) >= count

    def stop(self, timeout: float) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            prompt = self.prompts[i % len(self.prompts)]
            started = time.monotonic()
            try:
                status, text = self._chat(prompt)
            except OSError as exc:  # recorded: a result that is not 200
                status, text = -1, repr(exc)
            self.results.append(ChatResult(prompt, status, text, started, time.monotonic()))
            i += 1

    def _chat(self, prompt: str) -> tuple[int, str]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            headers = {"Content-Type": "application/x-www-form-urlencoded"}
            path = f"/chat?max_tokens={self.max_tokens}"
            conn.request("POST", path, body=prompt.encode(), headers=headers)
            resp = conn.getresponse()
            try:
                body = resp.read()
            except http.client.IncompleteRead as exc:
                # A stream cut by an error ends without its last chunk (the gateway does
                # that on purpose): a result to report, with what came.
                body = exc.partial + b"\n[stream cut]"
            return resp.status, body.decode(errors="replace")
        finally:
            conn.close()


@dataclass
class StatusPoller:
    """STATUS round trips to a broker, one after another until stopped, each with a
    deadline; what each took, and what failed."""

    address: str
    deadline: float = 10.0
    interval: float = 0.2
    latencies: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    last: dict[str, Any] = field(default_factory=dict)
    # The longest a worker went unheard, as the broker saw it (seconds, by worker id).
    heartbeat_ages: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="status-poller", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(self.deadline + 5)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.last = fetch_status(self.address, timeout=self.deadline)
                self.latencies.append(time.monotonic() - started)
                self._note_heartbeats(self.last)
            except Exception as exc:  # a missed deadline or a bad answer: counted
                self.failures.append(f"{type(exc).__name__}: {str(exc)[:200]}")
            self._stop.wait(self.interval)

    def _note_heartbeats(self, status: dict[str, Any]) -> None:
        for w in status.get("workers", []):
            if isinstance(w, dict) and isinstance(w.get("last_heartbeat_s"), int | float):
                wid = str(w.get("id"))
                age = float(w["last_heartbeat_s"])
                self.heartbeat_ages[wid] = max(age, self.heartbeat_ages.get(wid, 0.0))
