"""Speculative decoding by prompt lookup across test hosts: broker and gateway on host 1,
a stage of the tiny model on each of hosts 2 and 3 (``--speculative lookup``), links
delayed 5 ms each way (netem, or the testbed's relays). The proposals, their rows and the
accepted tokens cross real links here, so a token dropped or doubled on the way would
show: the greedy text must be HF's, and the same with ``"speculative": false``, for a
prompt that repeats itself and one that does not; the last stage's figures show that
proposals were made and accepted.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from testbed.hosts import HostCluster
from testbed.netns import Testbed, unusable_reason
from tests.e2e.expected import sent_text
from tests.e2e.test_speculative import ECHOED, echo

pytestmark = [pytest.mark.e2e, pytest.mark.torch]

DELAY_MS = 5.0
TOKENS = 40
PLAIN = "Why is the sky blue?"


@pytest.fixture(scope="module")
def spec_hosts(tmp_path_factory: pytest.TempPathFactory, e2e_model: Path) -> Iterator[HostCluster]:
    reason = unusable_reason()
    if reason is not None:
        pytest.skip(reason)
    bed = Testbed(3)
    c = HostCluster(
        bed,
        tmp_path_factory.mktemp("spec-hosts"),
        e2e_model,
        {"0:2": 2, "2:4": 3},
        delay_ms=DELAY_MS,
        # Only the last stage proposes; stage 0 ignores the flag, so both may have it.
        worker_flags=("--speculative", "lookup", "--max-draft-tokens", "6"),
    )
    try:
        bed.up()
        c.start()
        yield c
    finally:
        c.stop()
        bed.close()


def complete(c: HostCluster, prompt: str, **fields: Any) -> str:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": TOKENS, "ignore_eos": True}
    conn: http.client.HTTPConnection = c.http(timeout=120)
    try:
        conn.request(
            "POST",
            "/v1/completions",
            json.dumps({**body, **fields}),
            {"Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        data = json.loads(resp.read())
        assert resp.status == 200, data
        assert data["choices"][0]["finish_reason"] == "length"
        text: str = data["choices"][0]["text"]
        return text
    finally:
        conn.close()


def last_stage_stats(c: HostCluster) -> dict[str, Any]:
    (w,) = [w for w in c.status()["workers"] if w["layers"][1] == 4]
    return w.get("stats") or {}


def test_greedy_text_is_hf_with_and_without_speculation_across_hosts(
    spec_hosts: HostCluster, reference: Any, greedy_ids: Callable[..., list[int]]
) -> None:
    tok = reference.tokenizer
    repeating = echo(ECHOED[0], tok, greedy_ids)
    for prompt in (repeating, PLAIN):
        want = sent_text(tok, greedy_ids(tok.encode(prompt), TOKENS, stop_at_eos=False))
        assert complete(spec_hosts, prompt) == want, prompt
        assert complete(spec_hosts, prompt, speculative=False) == want, prompt
    # The figures travel with the heartbeats (1 s apart here): wait for the passes.
    stats = spec_hosts.wait_for(
        lambda: (s := last_stage_stats(spec_hosts)).get("spec_accepted") and s,
        30,
        "accepted proposals in the last stage's figures",
        pause=0.5,
    )
    assert stats["spec_proposed"] >= stats["spec_accepted"] > 0
    assert stats["spec_tokens_per_pass"] > 1.0
