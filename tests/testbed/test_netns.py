"""Test hosts from network namespaces (testbed/netns.py): addresses, reachability, link
down and up, shaping, and that closing leaves nothing behind. Needs root; skipped with
the reason otherwise."""

from __future__ import annotations

import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from testbed.netns import Testbed, parse_rate, unusable_reason

PORT = 7000


def test_parse_rate() -> None:
    assert parse_rate("100mbit") == 100_000_000
    assert parse_rate("1gbit") == 10**9
    assert parse_rate("2.5Mbit") == 2_500_000
    assert parse_rate("800kbit") == 800_000
    with pytest.raises(ValueError, match="kbit"):
        parse_rate("100MB/s")


@pytest.fixture
def bed() -> Iterator[Testbed]:
    reason = unusable_reason()
    if reason is not None:
        pytest.skip(reason)
    bed = Testbed(2)
    try:
        bed.up()
        yield bed
    finally:
        bed.close()


def listen_once(bed: Testbed, index: int) -> socket.socket:
    """A server on host ``index``'s address that answers b"hi" to one connection."""
    host = bed.host(index)
    with host.entered():
        server = socket.create_server((host.address, PORT))

    def answer() -> None:
        try:
            conn, _ = server.accept()
        except OSError:  # closed unused
            return
        with conn:
            conn.sendall(b"hi")

    threading.Thread(target=answer, daemon=True).start()
    return server


def reaches(bed: Testbed, src: int, dst: int, timeout: float = 2.0) -> bool:
    try:
        with bed.host(src).connect(bed.host(dst).address, PORT, timeout=timeout) as sock:
            return sock.recv(2) == b"hi"
    except OSError:
        return False


def test_hosts_reach_each_other_and_nothing_else(bed: Testbed) -> None:
    assert [h.address for h in bed.hosts] == ["198.18.0.1", "198.18.0.2"]
    with listen_once(bed, 2):
        assert reaches(bed, 1, 2)
    # A host's only route is the bridge's subnet: nothing it sends can leave the machine.
    # (Never connect to 198.18.0.x from the root namespace: its default route leads out.)
    for h in bed.hosts:
        routes = subprocess.run(
            ["ip", "-n", h.netns, "-4", "route", "show", "table", "all"],
            capture_output=True,
            text=True,
        ).stdout
        assert "default" not in routes
        assert {r.split()[0] for r in routes.splitlines() if "dev " + h.inner in r} <= {
            "198.18.0.0/24",
            "local",
            "broadcast",
        }, routes


def test_a_link_down_cuts_the_host_off_until_it_is_up(bed: Testbed) -> None:
    with listen_once(bed, 2):
        bed.link_down(2)
        assert not reaches(bed, 1, 2, timeout=1.0)
        bed.link_up(2)
        # The bridge port takes a moment to forward again: bounded retries.
        assert any(reaches(bed, 1, 2) for _ in range(10))


def test_a_shaped_link_has_tbf_on_both_ends(bed: Testbed) -> None:
    delay_on_link = bed.shape_link(2, "10mbit", delay_ms=5)
    h = bed.host(2)
    for where in ([], ["-n", h.netns]):
        dev = h.inner if where else h.outer
        shown = subprocess.run(
            ["tc", *where, "qdisc", "show", "dev", dev], capture_output=True, text=True
        ).stdout
        assert "tbf" in shown and "10Mbit" in shown, shown
        # True exactly where the kernel has netem and the delay is on the link.
        assert ("netem" in shown) == delay_on_link, shown
    assert bed.shape_link(2, "10mbit") is True  # no delay asked: nothing left to the caller


def test_close_removes_everything_and_may_run_twice(bed: Testbed) -> None:
    bed.close()
    bed.close()
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    assert bed.tag not in names and bed.tag not in links


def test_what_a_killed_run_left_is_removed_at_start() -> None:
    if (reason := unusable_reason()) is not None:
        pytest.skip(reason)
    gone = subprocess.Popen(["true"])
    gone.wait()
    stale = Testbed(2, tag=f"zqtb{gone.pid}a")
    stale.up()  # as a run that was killed before its clean-up would leave it
    sleeper = stale.host(1).popen(["sleep", "300"], Path("/dev/null"))
    fresh = Testbed(1)
    try:
        fresh.up()  # removes the stale one first
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert stale.tag not in listed and fresh.tag in listed
        links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True)
        assert f"{stale.tag}br" not in links.stdout
        assert sleeper.wait(timeout=10) != 0  # its processes were killed
    finally:
        fresh.close()
        stale.close()
        if sleeper.poll() is None:
            sleeper.kill()
            sleeper.wait()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert fresh.tag not in listed
