"""Mid-stream failover with real processes: SIGKILL the worker serving a stream, and the
stream goes on from a replica, token for token the same as undisturbed.

Two replicas per stage (layers 0:2 and 2:4 of the tiny model). Each test reads a long
completion until some tokens have arrived, asks the broker which worker of a stage holds
the session, kills it and reads on: greedy text equals HF's, sampled text (temperature
0.8, top_p 0.95, a seed) equals the same request's undisturbed text, and a non-streamed
answer is whole. The killed worker is started again for the next test.
"""

from __future__ import annotations

import http.client
import json
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from testbed.cluster import Cluster
from tests.e2e.expected import sent_text

pytestmark = [pytest.mark.e2e, pytest.mark.torch]

PROMPT = "Once upon a time"
TOKENS = 400  # ignore_eos: long enough to be mid-stream when the kill lands
WHOLE_TOKENS = 900  # a non-streamed answer: long enough to stop its first stage mid-answer
KILL_AFTER = 8  # SSE text events read before the kill
SAMPLED = {"temperature": 0.8, "top_p": 0.95, "seed": 1234}
STAGES = ("0:2", "2:4")


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory, e2e_model: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("replicas"), e2e_model)
    try:
        c.start_broker()
        for layers in STAGES * 2:
            c.start_worker(layers)
        c.start_gateway()
        c.wait_ready()
        c.wait_for(lambda: len(c.status()["workers"]) == 4, timeout=60, what="4 workers")
        yield c
    finally:
        c.stop()


def completion(
    c: Cluster, fields: dict[str, Any], after_tokens: Callable[[], None] | None = None
) -> tuple[str, str | None, str]:
    """Stream a completion; call ``after_tokens`` once KILL_AFTER text events arrived.
    Returns (text, finish_reason, the raw body)."""
    body = {"prompt": PROMPT, "max_tokens": TOKENS, "ignore_eos": True, "stream": True, **fields}
    conn = http.client.HTTPConnection("127.0.0.1", c.http_port, timeout=120)
    try:
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        text, finish, raw, events = [], None, [], 0
        while line := resp.readline():
            raw.append(line.decode())
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[len(b"data: ") :])
            assert "error" not in event, event
            choice = event["choices"][0]
            text.append(choice.get("text") or "")
            finish = choice.get("finish_reason") or finish
            events += 1
            if events == KILL_AFTER and after_tokens is not None:
                after_tokens()
        return "".join(text), finish, "".join(raw)
    finally:
        conn.close()


def serving(c: Cluster, layers: str) -> dict[str, Any] | None:
    """The status entry of the worker of ``layers`` that holds a session, if any."""
    start, end = (int(x) for x in layers.split(":"))
    for w in c.status()["workers"]:
        if w["layers"] == [start, end] and w["sessions"] > 0:
            return w
    return None


def kill_serving(c: Cluster, layers: str) -> dict[str, Any]:
    """SIGKILL the worker of ``layers`` that holds a session; its status entry."""
    victim = c.wait_for(
        lambda: serving(c, layers), timeout=30, what=f"a worker of {layers} with a session"
    )
    (proc,) = [p for p in c.procs if p.alive() and p.popen.pid == victim["info"]["pid"]]
    c.kill(proc, signal.SIGKILL)
    return victim


def wait_idle(c: Cluster) -> None:
    """No session left on any worker: the last test's may still be closing, and a worker
    still holding one would look like the one serving the next request."""
    c.wait_for(
        lambda: all(w["sessions"] == 0 for w in c.status()["workers"]),
        timeout=30,
        what="no sessions left on the workers",
    )


def replace_killed(c: Cluster, layers: str) -> None:
    c.start_worker(layers)
    c.wait_for(lambda: len(c.status()["workers"]) == 4, timeout=60, what="4 workers again")


def failovers(c: Cluster) -> float:
    """Streams the gateway healed after a lost worker (and the pauses, printed)."""
    status, body = c.get("/metrics")
    assert status == 200
    found = {}
    for line in body.decode().splitlines():
        for name in (
            'zmqllm_failovers_total{cause="worker_lost",outcome="recovered"}',
            "zmqllm_failover_pause_seconds_sum",
            "zmqllm_failover_pause_seconds_count",
        ):
            if line.startswith(name + " "):
                found[name] = float(line.split()[1])
    count = found.get("zmqllm_failover_pause_seconds_count", 0.0)
    if count:
        mean = found["zmqllm_failover_pause_seconds_sum"] / count
        print(f"failovers so far {count:g}, mean pause {mean:.3f} s")
    return found.get('zmqllm_failovers_total{cause="worker_lost",outcome="recovered"}', 0.0)


@pytest.mark.parametrize("layers", STAGES)
def test_greedy_stream_survives_its_worker(replicas: Cluster, greedy_ids, layers: str) -> None:
    c = replicas
    tok = c_tokenizer(c)
    expected = sent_text(tok, greedy_ids(tok.encode(PROMPT), TOKENS, stop_at_eos=False))
    wait_idle(c)
    before = failovers(c)
    killed: list[dict[str, Any]] = []
    text, finish, raw = completion(c, {}, lambda: killed.append(kill_serving(c, layers)))
    assert killed, "the stream ended before the kill"
    assert finish == "length" and raw.rstrip().endswith("data: [DONE]")
    assert text == expected
    assert failovers(c) == before + 1
    replace_killed(c, layers)


@pytest.mark.parametrize("layers", STAGES)
def test_sampled_stream_survives_its_worker(replicas: Cluster, layers: str) -> None:
    c = replicas
    undisturbed, _, _ = completion(c, SAMPLED)
    again, _, _ = completion(c, SAMPLED)
    assert again == undisturbed  # seeded: the same request gives the same text
    wait_idle(c)
    before = failovers(c)
    killed: list[dict[str, Any]] = []
    text, finish, _ = completion(c, SAMPLED, lambda: killed.append(kill_serving(c, layers)))
    assert killed and finish == "length"
    assert text == undisturbed
    assert failovers(c) == before + 1
    replace_killed(c, layers)


def test_non_streamed_answer_survives_its_worker(replicas: Cluster, greedy_ids) -> None:
    c = replicas
    tok = c_tokenizer(c)
    prompt_len = len(tok.encode(PROMPT))
    expected = sent_text(tok, greedy_ids(tok.encode(PROMPT), WHOLE_TOKENS, stop_at_eos=False))
    for _ in range(3):  # another try only if the whole answer came before the first stage stopped
        wait_idle(c)
        before = failovers(c)
        out: dict[str, Any] = {}
        t = threading.Thread(target=post_whole, args=(c, out), daemon=True)
        t.start()
        victim = c.wait_for(lambda: serving(c, "2:4"), timeout=30, what="a 2:4 worker serving")
        # Lost before its first token, a request is only queued again by the broker (no
        # failover): the kill waits for the first token.
        c.wait_for(
            lambda t=t: held_tokens(c) > prompt_len or not t.is_alive(),
            timeout=30,
            what="the first token",
        )
        # A whole answer shows no progress: the first stage is frozen, so that no token
        # can be made, and the kill lands mid-answer when the answer has not come.
        first = c.by_name("worker-0-2")
        for p in first:
            p.signal(signal.SIGSTOP)
        # Mid-answer only while the gateway holds fewer tokens than the whole answer: the
        # last tokens may have come just before the stop, the reply still on its way.
        mid = prompt_len < held_tokens(c) < prompt_len + WHOLE_TOKENS
        if mid:
            (proc,) = [p for p in c.procs if p.alive() and p.popen.pid == victim["info"]["pid"]]
            c.kill(proc, signal.SIGKILL)
        for p in first:
            p.signal(signal.SIGCONT)
        t.join(timeout=120)
        assert out["status"] == 200, out
        assert out["body"]["choices"][0]["text"] == expected
        if not mid:
            continue
        assert failovers(c) == before + 1
        replace_killed(c, "2:4")
        return
    pytest.fail("each whole answer came before the first stage could be stopped")


def post_whole(c: Cluster, out: dict[str, Any]) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", c.http_port, timeout=120)
    body = {"prompt": PROMPT, "max_tokens": WHOLE_TOKENS, "ignore_eos": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    out["status"], out["body"] = resp.status, json.loads(resp.read())
    conn.close()


def held_tokens(c: Cluster) -> float:
    """Token ids the gateway holds to replay live streams: a stream's prompt + its tokens."""
    status, body = c.get("/metrics")
    assert status == 200
    for line in body.decode().splitlines():
        if line.startswith("zmqllm_failover_history_tokens "):
            return float(line.split()[1])
    raise AssertionError("no zmqllm_failover_history_tokens in /metrics")


def c_tokenizer(c: Cluster) -> Any:
    from zmqllm.models.tokenizer import Tokenizer

    return Tokenizer.from_dir(c.model_dir)


def test_stream_survives_a_broker_restart(fresh_cluster: Cluster, greedy_ids) -> None:
    """The broker SIGKILLed mid-stream and started again on its ports: the gateway sees
    the silence (or the new boot id), the workers register again, the replay goes on."""
    c = fresh_cluster
    c.start_all()
    tok = c_tokenizer(c)
    expected = sent_text(tok, greedy_ids(tok.encode(PROMPT), TOKENS, stop_at_eos=False))

    def restart_broker() -> None:
        c.kill(c.by_name("broker")[0], signal.SIGKILL)
        c.start_broker()

    text, finish, raw = completion(c, {}, restart_broker)
    assert finish == "length" and raw.rstrip().endswith("data: [DONE]")
    assert text == expected
    _, body = c.get("/metrics")
    assert 'zmqllm_failovers_total{cause="broker_unreachable",outcome="recovered"} 1.0' in (
        body.decode()
    )


def test_no_replica_left_is_a_clear_error_within_the_failover_timeout(
    fresh_cluster: Cluster,
) -> None:
    """The only worker of a stage killed: no route can continue the stream. It ends with
    an error event once failover_timeout has passed, and the gateway holds nothing."""
    c = fresh_cluster
    c.start_broker()
    for layers in STAGES:
        c.start_worker(layers)
    c.start_gateway("--failover-timeout", "3")
    c.wait_ready()
    killed: list[float] = []

    def kill_last_stage() -> None:
        kill_serving(c, "2:4")
        killed.append(time.monotonic())

    body = {"prompt": PROMPT, "max_tokens": TOKENS, "ignore_eos": True, "stream": True}
    conn = http.client.HTTPConnection("127.0.0.1", c.http_port, timeout=120)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    events: list[dict[str, Any]] = []
    while line := resp.readline():
        if line.startswith(b"data: {"):
            events.append(json.loads(line[len(b"data: ") :]))
            if len(events) == KILL_AFTER:
                kill_last_stage()
    ended = time.monotonic()
    conn.close()
    error = events[-1]["error"]
    assert error["code"] in ("worker_lost", "no_capacity"), error
    assert "no other route continued the stream" in error["message"]
    # The failover timeout, plus detection and scheduling slack on 2 shared cores.
    assert ended - killed[0] < 3 + c.heartbeat * c.liveness + 5
    text = c.get("/metrics")[1].decode()
    assert 'zmqllm_failovers_total{cause="worker_lost",outcome="failed"} 1.0' in text
    assert "zmqllm_failover_history_tokens 0.0" in text


def test_a_stream_is_not_continued_on_a_replica_of_another_build(fresh_cluster: Cluster) -> None:
    """Issue 40, item 15: two replicas of stage 0, one sending its activations as
    bfloat16 (another build: a stream continued there would be text of two builds). The
    one serving a stream killed, the other may not continue it: the stream ends with an
    error naming the build it started on once failover_timeout has passed, and nothing
    of the other build reaches the client. (Replicas of one build continue a stream: the
    tests above.)"""
    c = fresh_cluster
    c.start_broker()
    c.start_worker("0:2")
    c.start_worker("0:2", flags=("--wire-dtype", "bfloat16"))
    c.start_worker("2:4")
    c.start_gateway("--failover-timeout", "3")
    c.wait_ready()
    workers = c.wait_for(
        lambda: len(found := c.status()["workers"]) == 3 and found, timeout=60, what="3 workers"
    )
    stage_0 = [w for w in workers if w["layers"] == [0, 2]]
    assert sorted(w["build"]["wire_dtype"] for w in stage_0) == ["auto", "bfloat16"]
    killed: list[tuple[float, dict[str, Any]]] = []

    def kill_stage_0() -> None:
        killed.append((time.monotonic(), kill_serving(c, "0:2")))

    body = {"prompt": PROMPT, "max_tokens": TOKENS, "ignore_eos": True, "stream": True}
    conn = http.client.HTTPConnection("127.0.0.1", c.http_port, timeout=120)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    events: list[dict[str, Any]] = []
    while line := resp.readline():
        if line.startswith(b"data: {"):
            events.append(json.loads(line[len(b"data: ") :]))
            if len(events) == KILL_AFTER:
                kill_stage_0()
    ended = time.monotonic()
    conn.close()
    assert killed, "the stream ended before the kill"
    at, victim = killed[0]
    assert "error" in events[-1], "the stream went on after its stage 0 was killed"
    error = events[-1]["error"]
    assert "no other route continued the stream" in error["message"], error
    assert "only onto a route of the build the stream started on" in error["message"]
    assert f"0:2:{victim['build_key']}" in error["message"]
    assert ended - at < 3 + c.heartbeat * c.liveness + 5
    broker = c.log_lines(c.by_name("broker")[0])
    waits = [x for x in broker if x.get("event", "").startswith("replay waits for a route")]
    assert waits and waits[0]["build"].startswith(f"0:2:{victim['build_key']} "), waits
    # No replay was opened at all: only a worker of the stream's build could have taken it.
    opened = [x for x in broker if x.get("event") == "session opened"]
    assert opened and not any(x["replay_of_build"] for x in opened), opened
    text = c.get("/metrics")[1].decode()
    assert 'zmqllm_failovers_total{cause="worker_lost",outcome="failed"} 1.0' in text
