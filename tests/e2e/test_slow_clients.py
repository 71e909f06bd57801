"""Issue 40, items 1 and 2, end to end: clients that leave their streams unread, or read
a trickle, against a live cluster (broker, workers for layers 0:2 and 2:4 of the tiny
model, gateway) with a short ``write_timeout``.

Item 1: eight streams of n=8 take all 64 generation slots and their clients (2 KiB
receive buffers) read nothing. Without logprobs each stream is ~1.4 MB, which the buffers
Linux gives a connection absorb whole: the writes never paused, the stalled streams ran
to their 900 tokens a choice holding every slot, and a normal /chat waited for them all.
Item 2: a client that takes a little every half second was, at best, cut where the app
could see it while the kernel went on delivering megabytes to it.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import ConfiguredCluster
from tests.e2e.stalled_readers import ended_by_server, non_reader
from tests.e2e.test_cluster import post_chat
from tests.e2e.test_hardening import leftovers

pytestmark = [pytest.mark.e2e, pytest.mark.torch]

WRITE_TIMEOUT = 3.0
MAX_TOKENS = 900
# How long past a deadline a test waits to see its effect: generous, the machine is shared.
SLACK = 30.0
KIB = 1024
CUT_EVENTS = (
    "client read nothing for write_timeout: connection aborted",
    "client read too slowly for write_timeout: connection aborted",
)


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, e2e_model: Path
) -> Iterator[ConfiguredCluster]:
    config = (
        "[gateway]\n"
        f"write_timeout = {WRITE_TIMEOUT}\n"
        # Longer than the test waits: a request held in the queue shows as a failure, not 503.
        "queue_timeout = 120\n"
    )
    c = ConfiguredCluster(tmp_path_factory.mktemp("slow-clients"), e2e_model, config=config)
    try:
        c.start_all()
        yield c
    finally:
        c.stop()


def in_flight(c: ConfiguredCluster) -> int:
    with urllib.request.urlopen(f"{c.url}/cluster/status", timeout=10) as resp:
        count: int = json.loads(resp.read())["gateway"]["in_flight"]
        return count


def wait_clean(c: ConfiguredCluster, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        st = c.status()
        if not leftovers(st) or time.monotonic() > deadline:
            return st
        time.sleep(0.2)


def stream_request(port: int, request_id: str, logprobs: bool) -> socket.socket:
    """A streamed n=8 chat request from a client with a 2 KiB receive buffer (set before
    connecting, so the window it offers stays small); nothing of the answer is read."""
    body: dict[str, Any] = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "n": 8,
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "stream": True,
    }
    if logprobs:
        body |= {"logprobs": True, "top_logprobs": 20}
    return non_reader(port, body, rcvbuf=2048, request_id=request_id)


def gateway_log(c: ConfiguredCluster, request_ids: set[str]) -> dict[str, list[dict[str, Any]]]:
    """The gateway's cut and "request finished" lines for these requests."""
    (path,) = c.root.glob("*-gateway.log")
    found: dict[str, list[dict[str, Any]]] = {"cut": [], "finished": []}
    for text in path.read_text().splitlines():
        line = json.loads(text) if text.startswith("{") else {}
        if line.get("request_id") not in request_ids:
            continue
        if line.get("event") in CUT_EVENTS:
            found["cut"].append(line)
        elif line.get("event") == "request finished":
            found["finished"].append(line)
    return found


@pytest.mark.parametrize("logprobs", [False, True], ids=["plain", "logprobs"])
def test_streams_nobody_reads_free_their_slots(
    cluster: ConfiguredCluster, reference: Any, logprobs: bool
) -> None:
    """All 64 slots held by streams nobody reads: each is cut about write_timeout after its
    unread output passed max_unread_bytes, its sessions cancelled, and a normal /chat is
    served meanwhile."""
    tag = "lp" if logprobs else "plain"
    ids = {f"stalled-{tag}-{i}" for i in range(8)}
    stalled = [stream_request(cluster.http_port, rid, logprobs) for rid in sorted(ids)]
    try:
        # Every slot taken before the normal request comes (else it would simply go first).
        deadline = time.monotonic() + SLACK
        while in_flight(cluster) < 64:
            assert time.monotonic() < deadline, in_flight(cluster)
            time.sleep(0.1)
        status, chunks, _ = post_chat(cluster, "Why is the sky blue?", "max_tokens=24")
        assert status == 200
        assert b"".join(c for _, c in chunks).decode() == reference.body("Why is the sky blue?", 24)
        # Every slot freed before the stalled sockets are read: the normal request goes
        # as soon as the first stream is cut, and reading a stream not yet cut would make
        # its client a reader that keeps up (it would then run to its end, never cut).
        deadline = time.monotonic() + SLACK
        while in_flight(cluster):
            assert time.monotonic() < deadline, in_flight(cluster)
            time.sleep(0.1)
        for sock in stalled:
            assert ended_by_server(sock, SLACK), "a stalled stream's connection stayed open"
        st = wait_clean(cluster, SLACK)
        assert leftovers(st) == {}
    finally:
        for sock in stalled:
            with contextlib.suppress(OSError):
                sock.close()
    found = gateway_log(cluster, ids)
    uncut = ids - {line["request_id"] for line in found["cut"]}
    assert not uncut, [line for line in found["finished"] if line["request_id"] in uncut]
    assert all(line["unread_bytes"] > line["required_bytes"] for line in found["cut"])
    assert len(found["finished"]) == 8
    for line in found["finished"]:
        assert line["error"] == "write_timeout" and line["status"] == 200
        # Cut, not run to the end: fewer than every choice's max_tokens were made.
        assert line["generated_tokens"] < 8 * MAX_TOKENS


def test_a_reader_that_trickles_is_cut(cluster: ConfiguredCluster) -> None:
    """16 KiB every half second (96 KiB a window of 3 s, less than the 256 KiB the window
    asks of a client that far behind): cut with what it took reported, and the connection
    reset, not left to deliver what the kernel held at the client's pace."""
    sock = stream_request(cluster.http_port, "trickles", logprobs=True)
    taken, outcome = 0, "alive"
    deadline = time.monotonic() + 3 * WRITE_TIMEOUT + SLACK
    sock.settimeout(SLACK)
    try:
        while outcome == "alive" and time.monotonic() < deadline:
            want = 16 * KIB
            while want > 0:
                piece = sock.recv(want)
                if not piece:
                    outcome = "closed"
                    break
                if b"data: [DONE]" in piece:
                    outcome = "finished"
                taken, want = taken + len(piece), want - len(piece)
            time.sleep(0.5)
    except ConnectionResetError:
        outcome = "reset"
    finally:
        sock.close()
    assert outcome == "reset", f"{outcome} after taking {taken} bytes"
    st = wait_clean(cluster, SLACK)
    assert leftovers(st) == {}
    found = gateway_log(cluster, {"trickles"})
    (cut,) = found["cut"]
    assert cut["event"] == CUT_EVENTS[1]
    assert 0 < cut["delivered_bytes"] < cut["required_bytes"]
    (finished,) = found["finished"]
    assert finished["error"] == "write_timeout"
