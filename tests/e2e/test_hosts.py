"""Many hosts: the cluster across three network namespaces, as a user would spread it.

Host 1 runs the broker and the gateway, hosts 2 and 3 one stage each (layers 0:2 and
2:4 of the tiny model), every process started with `zmqllm ROLE ...` through `ip netns
exec`, on a bridge with addresses from 198.18.0.0/24. The broker binds host 1's address,
so the bus has CURVE keys (made with `zmqllm keys init`, a worker key issued per host and
copied to it). Every link is limited to 100 Mbit/s with tbf; each worker host's link
delays 5 ms each way (netem where the kernel has it, else the test's relay).

Proven: greedy text equals HF's across the hosts; host 3 cut off for 6 s (its link down)
comes back: the same worker process registers again and new requests are exact; a stream
in flight during the cut either completes exactly (failover) or ends with a clear error
event, never silently short. Everything the test makes is removed whatever happens, and
a testbed a killed earlier run left behind is removed at the start (tests/testbed/test_netns.py).
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from testbed.hosts import HostCluster
from testbed.netns import Testbed, unusable_reason
from tests.e2e.expected import sent_text

pytestmark = [pytest.mark.e2e, pytest.mark.torch]

DELAY_MS = 5.0
RATE = "100mbit"
CUT_S = 6.0
PROMPTS = ["Why is the sky blue?", "Tell me a story about a robot.", "Count to five."]
LONG_PROMPT = "Once upon a time"
LONG_TOKENS = 900  # outlasts the cut at this model's speed across the links


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory, e2e_model: Path) -> Iterator[HostCluster]:
    reason = unusable_reason()
    if reason is not None:
        pytest.skip(reason)
    bed = Testbed(3)
    cluster = HostCluster(
        bed,
        tmp_path_factory.mktemp("hosts"),
        e2e_model,
        {"0:2": 2, "2:4": 3},
        delay_ms=DELAY_MS,
        rate=RATE,
    )
    try:
        bed.up()
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        bed.close()


def chat(c: HostCluster, prompt: str, max_tokens: int) -> str:
    conn = c.http()
    try:
        conn.request("POST", f"/chat?max_tokens={max_tokens}", prompt.encode())
        resp = conn.getresponse()
        assert resp.status == 200
        return resp.read().decode()
    finally:
        conn.close()


def link_bytes(c: HostCluster, index: int) -> int:
    """Bytes the tbf on the bridge's end of host ``index``'s link has sent to it."""
    outer = c.bed.host(index).outer
    out = subprocess.run(
        ["tc", "-s", "-j", "qdisc", "show", "dev", outer], capture_output=True, text=True
    ).stdout
    return sum(int(q.get("bytes", 0)) for q in json.loads(out or "[]") if q.get("kind") == "tbf")


def test_greedy_text_is_exact_across_hosts(hosts: HostCluster, reference: Any) -> None:
    before = {i: link_bytes(hosts, i) for i in (2, 3)}
    relayed = 0
    for i, prompt in enumerate(PROMPTS):
        assert chat(hosts, prompt, 24) == reference.body(prompt, 24), prompt
        if i == 0:  # the peer links are made by now
            relayed = hosts.status()["counters"]["relayed"]
    # The activations and tokens did cross the shaped links.
    assert all(link_bytes(hosts, i) > before[i] for i in (2, 3))
    st = hosts.status()
    assert st["curve"] is True and st["complete_route"] is True
    # A worker's id starts with its --name.
    assert sorted(w["id"].split("-")[2] for w in st["workers"]) == ["2", "3"]
    # Each worker's peer link is on its own host's address (the one that reaches the
    # broker), and the activations and steps went from host to host over them.
    peers = {w["id"].split("-")[2]: w["peer"] for w in st["workers"]}
    assert all(peers[i].startswith(f"tcp://198.18.0.{i}:") for i in ("2", "3")), peers
    assert st["counters"]["relayed"] == relayed


class SseStream:
    """A streamed completion read in a thread: the text so far, how it ended."""

    def __init__(self, c: HostCluster) -> None:
        self.text = ""
        self.tokens = 0
        self.error: dict[str, Any] | None = None
        self.done = False  # saw data: [DONE]
        self.exc: BaseException | None = None
        self.conn = c.http(timeout=120)
        body = {
            "prompt": LONG_PROMPT,
            "max_tokens": LONG_TOKENS,
            "stream": True,
            "ignore_eos": True,
            "temperature": 0,
        }
        self.thread = threading.Thread(target=self._read, args=(body,), daemon=True)
        self.thread.start()

    def _read(self, body: dict[str, Any]) -> None:
        try:
            self.conn.request(
                "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
            )
            resp = self.conn.getresponse()
            assert resp.status == 200
            for raw in resp:
                line = raw.decode().strip()
                if line == "data: [DONE]":
                    self.done = True
                elif line.startswith("data: "):
                    event = json.loads(line[6:])
                    if "error" in event:
                        self.error = event["error"]
                    elif event.get("choices"):
                        self.text += event["choices"][0]["text"]
                        self.tokens += 1
        except BaseException as exc:  # surfaced by the test
            self.exc = exc
        finally:
            self.conn.close()


def worker_entry(c: HostCluster, name: str) -> dict[str, Any] | None:
    try:
        st = c.status()
    except RuntimeError:  # the broker did not answer in time: ask again
        return None
    return next((w for w in st["workers"] if w["id"].startswith(f"w-{name}-")), None)


def test_a_host_cut_off_for_six_seconds_comes_back(
    hosts: HostCluster, reference: Any, greedy_ids: Any
) -> None:
    (third,) = hosts.by_name("worker-2-4")
    assert worker_entry(hosts, "host-3") is not None
    stream = SseStream(hosts)
    hosts.wait_for(lambda: stream.tokens >= 5 or not stream.thread.is_alive(), 60, "tokens")
    assert stream.exc is None and stream.tokens >= 5
    hosts.bed.link_down(3)
    try:
        time.sleep(CUT_S)
    finally:
        hosts.bed.link_up(3)
    link_back = time.monotonic()
    stream.thread.join(timeout=180)
    assert not stream.thread.is_alive(), "the stream neither finished nor failed"
    assert stream.exc is None, stream.exc
    print(f"stream: {stream.tokens} tokens, error {stream.error}, [DONE] {stream.done}")
    tok = reference.tokenizer
    if stream.error is None:
        # Failed over (replayed on a fresh route): the whole answer, exact.
        assert stream.done
        want = greedy_ids(tok.encode(LONG_PROMPT), LONG_TOKENS, stop_at_eos=False)
        assert stream.text == sent_text(tok, want)
    else:
        # Or a clear error: an error event with a message and a code, and no [DONE].
        assert not stream.done and stream.error.get("message") and stream.error.get("code")
        assert stream.tokens < LONG_TOKENS

    # The same worker process on host 3 registers again by itself.
    def back() -> bool:
        w = worker_entry(hosts, "host-3")
        return w is not None and w.get("info", {}).get("pid") == third.popen.pid

    hosts.wait_for(back, 90, "host 3's worker to register again", pause=1.0)
    print(f"host 3's worker registered again {time.monotonic() - link_back:.1f} s after its link")
    assert third.popen.poll() is None
    hosts.wait_ready(60)
    for prompt in PROMPTS:
        assert chat(hosts, prompt, 24) == reference.body(prompt, 24), prompt
