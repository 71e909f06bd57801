"""Hostile peers on a bus: blasting without ever blocking, status polling with deadlines.

No torch here. The victim streams need a broker with workers: tests/e2e/test_fuzz_live.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import zmq

from testbed.fuzz_peers import StatusPoller, blast
from zmqllm.bus.messages import Status, StatusReply
from zmqllm.bus.protocol import decode, encode

SESSIONS = ["victim-1", "victim_2"]


@pytest.fixture
def routers() -> Iterator[tuple[zmq.Socket[bytes], zmq.Socket[bytes]]]:
    """Two ROUTER sockets standing in for a broker's frontend and backend."""
    ctx = zmq.Context()
    socks = []
    for _ in range(2):
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        sock.bind("tcp://127.0.0.1:*")
        socks.append(sock)
    try:
        yield socks[0], socks[1]
    finally:
        for sock in socks:
            sock.close(linger=0)
        ctx.term()


def _endpoint(sock: zmq.Socket[bytes]) -> str:
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def _drain(sock: zmq.Socket[bytes], most: int) -> list[list[bytes]]:
    got: list[list[bytes]] = []
    while len(got) < most and sock.poll(1000):
        got.append(sock.recv_multipart())
    return got


def test_blast_reaches_both_sockets_from_many_peers(
    routers: tuple[zmq.Socket[bytes], zmq.Socket[bytes]],
) -> None:
    front, back = routers
    ctx = zmq.Context()
    try:
        stats = blast(
            ctx, _endpoint(front), _endpoint(back), messages=600, sessions=SESSIONS, seed=1
        )
    finally:
        ctx.term()
    received = {}
    for side, sock in (("frontend", front), ("backend", back)):
        s = stats[side]
        assert s.sent + s.dropped == 600
        assert s.new_peers == 600 // 256
        got = _drain(sock, s.sent)
        # Each arrives whole, behind the routing id of the peer that sent it.
        assert all(len(frames) >= 2 for frames in got)
        received[side] = (len(got), len({frames[0] for frames in got}))
    # Frontend peers have ids of their own: everything arrives, from the first peers
    # and the ones that replaced them.
    assert received["frontend"] == (stats["frontend"].sent, 8 + stats["frontend"].new_peers)
    # Backend peers share ids: a peer connecting with a live peer's id takes its place
    # (ROUTER_HANDOVER), and what the old connection still carried is lost.
    assert 0 < received["backend"][0] <= stats["backend"].sent
    assert received["backend"][1] < 8 + stats["backend"].new_peers


def test_blast_never_waits_for_a_peer_that_does_not_read() -> None:
    ctx = zmq.Context()
    sink = ctx.socket(zmq.ROUTER)
    sink.setsockopt(zmq.LINGER, 0)
    sink.setsockopt(zmq.RCVHWM, 1)
    sink.bind("tcp://127.0.0.1:*")
    try:
        # Nothing reads `sink`; nobody listens on the second address, where a blocking
        # send would wait forever once the high-water mark is reached.
        stats = blast(ctx, _endpoint(sink), "tcp://127.0.0.1:1", messages=3000, sessions=[], seed=2)
    finally:
        sink.close(linger=0)
        ctx.term()
    assert stats["frontend"].sent + stats["frontend"].dropped == 3000
    backend = stats["backend"]
    assert backend.sent + backend.dropped == 3000
    assert backend.sent <= (8 + backend.new_peers) * 64  # each peer's queue, then drops
    assert backend.dropped > 0


def test_status_poller_times_each_answer(
    routers: tuple[zmq.Socket[bytes], zmq.Socket[bytes]],
) -> None:
    broker, _ = routers
    stop = threading.Event()

    def answer() -> None:
        while not stop.is_set():
            if broker.poll(50):
                identity, *frames = broker.recv_multipart()
                request = decode(frames)
                assert isinstance(request, Status)
                reply = StatusReply.of({"sessions": 0}, request_id=request.request_id)
                broker.send_multipart([identity, *encode(reply)])

    thread = threading.Thread(target=answer)
    thread.start()
    poller = StatusPoller(_endpoint(broker), deadline=5.0, interval=0.01)
    poller.start()
    try:
        while len(poller.latencies) < 5 and not poller.failures:
            stop.wait(0.05)
    finally:
        poller.stop()
        stop.set()
        thread.join()
    assert poller.failures == []
    assert len(poller.latencies) >= 5
    assert poller.last == {"sessions": 0}


def test_status_poller_counts_a_missed_deadline() -> None:
    # Nobody listens: every poll runs into its deadline and is counted as failed.
    poller = StatusPoller("tcp://127.0.0.1:1", deadline=0.2, interval=0.01)
    poller.start()
    try:
        while not poller.failures:
            threading.Event().wait(0.05)
    finally:
        poller.stop()
    assert poller.latencies == []
    assert "TimeoutError" in poller.failures[0]
