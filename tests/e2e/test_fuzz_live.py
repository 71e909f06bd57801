"""Live fuzz: hostile messages on both broker sockets while real streams run.

Broker, two tiny-model workers (layers 0:2 and 2:4) and the gateway run as real
processes on 127.0.0.1. While /chat streams (gateway) and greedy client streams (whose
session ids the fuzzer is told, so foreign CANCELs, CLOSEs, STEPs and TOKENs name them)
run one after another, DEALER peers send at least 10**4 hostile messages from
``testbed.fuzz`` to each broker socket and to each worker's peer link (often under the
real workers' routing ids). Afterwards the same processes are alive, every
stream's text equals HF greedy, and STATUS answered within its deadline throughout.
"""

from __future__ import annotations

import functools
import json
import time

import pytest
import zmq

from testbed.cluster import Cluster
from testbed.fuzz_peers import ChatStreams, StatusPoller, VictimStreams, blast
from tests.e2e.expected import sent_text
from tests.e2e.test_cluster import PROMPTS

pytestmark = [pytest.mark.e2e, pytest.mark.torch]

MESSAGES = 10_000  # per broker socket
SEED = 9
MAX_TOKENS = 24
STATUS_DEADLINE = 10.0  # seconds: generous on 2 shared cores, but every poll has one


def _during(spans: list[tuple[float, float]], start: float, end: float) -> int:
    """How many of the (started, ended) spans overlap the fuzz."""
    return sum(1 for s, e in spans if s < end and e > start)


def _errors_logged(c: Cluster) -> dict[str, list[str]]:
    """Unexpected exceptions the processes caught and logged (each is a finding)."""
    out: dict[str, list[str]] = {}
    for p in c.procs:
        found = [
            json.dumps({k: line.get(k) for k in ("event", "where", "error", "detail")})
            for line in c.log_lines(p)
            if line.get("level") in ("error", "critical")
        ]
        if found:
            out[p.name] = found[:20]
    return out


def test_hostile_messages_on_both_sockets_while_streams_run(
    fresh_cluster: Cluster, reference
) -> None:
    c = fresh_cluster
    t0 = time.monotonic()
    c.start_all()
    print(f"\ncluster up in {time.monotonic() - t0:.1f}s")
    tok = reference.tokenizer
    pids = {p.name: p.popen.pid for p in c.procs}
    workers_before = sorted(w["id"] for w in c.status()["workers"])
    assert len(workers_before) == 2

    sessions: list[str] = []  # the victims' session ids, named by the fuzzer
    victims = VictimStreams(
        c.frontend,
        [tok.encode(p) for p in PROMPTS],
        max_tokens=MAX_TOKENS,
        stop_ids=sorted(tok.eos_token_ids),
        sessions=sessions,
    )
    chats = ChatStreams(c.http_port, PROMPTS, max_tokens=MAX_TOKENS)
    poller = StatusPoller(c.frontend, deadline=STATUS_DEADLINE)
    victims.start()
    chats.start()
    poller.start()
    ctx = zmq.Context()
    try:
        # Streams under way before the first hostile message.
        assert victims.wait_for(1, timeout=60), victims.crashed
        assert chats.wait_for(1, timeout=60)
        fuzz_start = time.monotonic()
        # Each worker's peer link too, from peers often taking the real workers' ids,
        # naming the wire ids the broker gives sessions as well (its boot id, a count).
        st = c.status()
        boot, relayed = st["boot"], st["counters"]["relayed"]
        sessions += [f"{boot}-{i:x}" for i in range(1, 200)]
        ids = tuple(w.encode() for w in workers_before)
        more = {f"peer:{w['id']}": (w["peer"], ids) for w in c.status()["workers"]}
        stats = blast(
            ctx, c.frontend, c.backend, messages=MESSAGES, sessions=sessions, seed=SEED, more=more
        )
        fuzz_end = time.monotonic()
        # One more of each, begun after the fuzz ended: the cluster still serves.
        done = len(victims.results), len(chats.results)
        assert victims.wait_for(done[0] + 2, timeout=60), victims.crashed
        assert chats.wait_for(done[1] + 2, timeout=60)
    finally:
        victims.stop(60)
        chats.stop(60)
        poller.stop()
        ctx.term()

    print(f"fuzz started {fuzz_start - t0:.1f}s, streams done {time.monotonic() - t0:.1f}s")
    print(f"{len(victims.results)} client streams, {len(chats.results)} /chat")
    sent = json.dumps({side: vars(st) for side, st in stats.items()})
    print(f"\nfuzz: {fuzz_end - fuzz_start:.1f}s {sent}")
    print(f"status: {len(poller.latencies)} polls, max {max(poller.latencies, default=0):.3f}s")
    print("longest unheard (s):", json.dumps(poller.heartbeat_ages, sort_keys=True))
    print("broker drops:", json.dumps(poller.last.get("dropped", {}), sort_keys=True))
    print("errors logged:", json.dumps(_errors_logged(c), indent=1))

    # Every socket got its share, without the fuzzer ever waiting.
    assert len(stats) == 4
    for side in stats:
        assert stats[side].sent + stats[side].dropped == MESSAGES
        assert stats[side].sent >= MESSAGES * 0.9, (side, stats[side])

    # The same processes, alive; the real workers still registered.
    for p in c.procs:
        assert p.alive(), f"{p.name} exited:\n{p.text()[-3000:]}"
        assert p.popen.pid == pids[p.name]
    after = c.status()
    assert sorted(w["id"] for w in after["workers"]) == workers_before
    # The streams still went from worker to worker.
    assert after["counters"]["relayed"] == relayed

    # STATUS answered throughout, each within its deadline.
    assert poller.failures == []
    assert len(poller.latencies) >= 5

    # Every stream, during the fuzz and after it, is exact.
    assert victims.crashed is None
    spans = [(r.started, r.ended) for r in victims.results]
    assert _during(spans, fuzz_start, fuzz_end) >= 1
    prompts = {tuple(tok.encode(p)): p for p in PROMPTS}
    raw_greedy = functools.cache(lambda prompt: reference.raw(prompt, MAX_TOKENS))
    chat_greedy = functools.cache(lambda prompt: reference.body(prompt, MAX_TOKENS))
    for r in victims.results:
        assert r.error is None, (r.session, r.error)
        assert sent_text(tok, r.tokens) == raw_greedy(prompts[tuple(r.prompt)]), r.session
    assert _during([(r.started, r.ended) for r in chats.results], fuzz_start, fuzz_end) >= 1
    for chat in chats.results:
        assert chat.status == 200, chat
        assert chat.text == chat_greedy(chat.prompt), chat.prompt
