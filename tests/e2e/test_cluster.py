"""The product as users meet it: curl and the openai package against a real cluster.

Broker, two workers (layers 0:2 and 2:4 of the tiny sliding-window model) and
the gateway run as separate processes on 127.0.0.1; answers must equal HF
greedy generate on the same weights.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from testbed.cluster import Cluster

pytestmark = [pytest.mark.e2e, pytest.mark.torch]

PROMPTS = [
    "Hello there!",
    "What is the capital of France?",
    "Tell me a story about a robot.",
    "Écris un poème sur la mer. 海",
    "List three colours.",
    "Why is the sky blue?",
    "Count to five.",
    "Say something nice 😀",
]


def post_chat(c: Cluster, prompt: str, query: str = "max_tokens=40", headers=None):
    """POST /chat like curl -d does; returns (status, chunks with arrival times, headers)."""
    conn = http.client.HTTPConnection("127.0.0.1", c.http_port, timeout=60)
    hdrs = {"Content-Type": "application/x-www-form-urlencoded", **(headers or {})}
    conn.request("POST", f"/chat?{query}", body=prompt.encode(), headers=hdrs)
    resp = conn.getresponse()
    chunks: list[tuple[float, bytes]] = []
    while True:
        piece = resp.read1(65536) if hasattr(resp, "read1") else resp.read(1)
        if not piece:
            break
        chunks.append((time.monotonic(), piece))
    conn.close()
    return resp.status, chunks, dict(resp.getheaders())


def open_long_stream(
    c: Cluster, timeout: float, model: str | None = "tiny"
) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """Start a streamed completion of 900 tokens (it outlasts the test's checks)."""
    conn = http.client.HTTPConnection("127.0.0.1", c.http_port, timeout=timeout)
    fields = {"prompt": "Once upon a time", "max_tokens": 900, "stream": True, "ignore_eos": True}
    if model is not None:
        fields = {"model": model, **fields}
    conn.request(
        "POST",
        "/v1/completions",
        body=json.dumps(fields),
        headers={"Content-Type": "application/json"},
    )
    return conn, conn.getresponse()


def test_chat_equals_hf_greedy_and_streams(cluster: Cluster, reference) -> None:
    status, chunks, headers = post_chat(cluster, "Tell me a story about a robot.")
    assert status == 200, chunks
    text = b"".join(p for _, p in chunks).decode()
    assert text == reference.body("Tell me a story about a robot.", 40)
    assert len(chunks) > 3  # streamed as tokens are made, not one buffered body
    assert chunks[0][0] < chunks[-1][0]
    assert headers.get("x-request-id") or headers.get("X-Request-ID")


def test_eight_concurrent_requests_are_each_exact(cluster: Cluster, reference) -> None:
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda p: post_chat(cluster, p, "max_tokens=32"), PROMPTS))
    for prompt, (status, chunks, _) in zip(PROMPTS, results, strict=True):
        assert status == 200
        assert b"".join(p for _, p in chunks).decode() == reference.body(prompt, 32), prompt


def test_activations_and_steps_go_over_peer_links(cluster: Cluster, reference) -> None:
    st = cluster.status()
    peers = [w["peer"] for w in st["workers"]]
    assert len(peers) == 2 and all(p.startswith("tcp://127.0.0.1:") for p in peers), peers
    before = st["counters"]
    status, chunks, _ = post_chat(cluster, "Why is the sky blue?", "max_tokens=24")
    assert status == 200
    assert b"".join(p for _, p in chunks).decode() == reference.body("Why is the sky blue?", 24)
    after = cluster.status()["counters"]
    # The broker passed on the tokens, but no activation and no step: those went from
    # worker to worker. (A session whose first result is ready before its link's
    # handshake is done goes through the broker: this module's first ones may have.)
    assert after["tokens"] > before["tokens"]
    assert after["relayed"] == before["relayed"]


def test_a_worker_without_peer_link_is_served_through_the_broker(
    fresh_cluster: Cluster, reference
) -> None:
    c = fresh_cluster
    c.start_broker()
    c.start_worker("0:2", flags=("--peer", "off"))
    c.start_worker("2:4")
    c.start_gateway()
    c.wait_ready()
    assert sorted(bool(w["peer"]) for w in c.status()["workers"]) == [False, True]
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda p: post_chat(c, p, "max_tokens=24"), PROMPTS[:3]))
    for prompt, (status, chunks, _) in zip(PROMPTS[:3], results, strict=True):
        assert status == 200
        assert b"".join(p for _, p in chunks).decode() == reference.body(prompt, 24), prompt
    assert c.status()["counters"]["relayed"] > 0


def test_openai_package_chat_and_completions(cluster: Cluster, reference) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused")
    models = client.models.list()
    name = models.data[0].id
    want = reference("Why is the sky blue?", 24)
    msgs = [{"role": "user", "content": "Why is the sky blue?"}]
    full = client.chat.completions.create(model=name, messages=msgs, max_tokens=24)
    assert full.choices[0].message.content == want
    assert full.usage.completion_tokens > 0
    stream = client.chat.completions.create(model=name, messages=msgs, max_tokens=24, stream=True)
    streamed = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert streamed == want
    want_raw = reference.raw("The quick brown fox", 24)
    comp = client.completions.create(model=name, prompt="The quick brown fox", max_tokens=24)
    assert comp.choices[0].text == want_raw
    stream = client.completions.create(
        model=name, prompt="The quick brown fox", max_tokens=24, stream=True
    )
    assert "".join(ch.choices[0].text for ch in stream if ch.choices) == want_raw


def test_n_choices_through_the_openai_package(cluster: Cluster, reference) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused")
    msgs = [{"role": "user", "content": "Why is the sky blue?"}]
    sampled = client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=16, n=3, temperature=1.0, seed=5
    )
    texts = [c.message.content for c in sampled.choices]
    assert [c.index for c in sampled.choices] == [0, 1, 2]
    assert len(set(texts)) == 3, texts  # each choice samples with a seed of its own
    again = client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=16, n=3, temperature=1.0, seed=5
    )
    assert [c.message.content for c in again.choices] == texts  # seeded: reproducible
    greedy = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=16, n=2)
    want = reference("Why is the sky blue?", 16)
    assert [c.message.content for c in greedy.choices] == [want, want]
    stream = client.completions.create(
        model="tiny", prompt="The quick brown fox", max_tokens=16, n=2, stream=True
    )
    parts = {0: "", 1: ""}
    for chunk in stream:
        for choice in chunk.choices:
            parts[choice.index] += choice.text
    want_raw = reference.raw("The quick brown fox", 16)
    assert parts == {0: want_raw, 1: want_raw}
    cluster.wait_for(lambda: cluster.status()["sessions"] == 0, timeout=10, what="sessions end")


def test_logprobs_are_hf_log_softmax(cluster: Cluster, reference, e2e_model: Path) -> None:
    """Greedy replies' log-probabilities through the openai package against HF float32's
    log-softmax on the same weights, within 2e-3; top ones sorted, the chosen first."""
    openai = pytest.importorskip("openai")
    torch = pytest.importorskip("torch")
    from transformers import MistralForCausalLM

    tok = reference.tokenizer
    model = MistralForCausalLM.from_pretrained(e2e_model).eval()
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused")
    msgs = [{"role": "user", "content": "Why is the sky blue?"}]
    chat = client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=12, logprobs=True, top_logprobs=3
    )
    comp = client.completions.create(model="tiny", prompt="The quick", max_tokens=12, logprobs=3)
    cases = [
        (
            tok.encode_chat(msgs),
            [
                (c.logprob, [t.logprob for t in c.top_logprobs])
                for c in chat.choices[0].logprobs.content
            ],
        ),
        (
            tok.encode("The quick"),
            [
                (lp, sorted(top.values(), reverse=True))
                for lp, top in zip(
                    comp.choices[0].logprobs.token_logprobs,
                    comp.choices[0].logprobs.top_logprobs,
                    strict=True,
                )
            ],
        ),
    ]
    for prompt, got in cases:
        x = torch.tensor([prompt])
        with torch.no_grad():
            new = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=12,
                do_sample=False,
                eos_token_id=sorted(tok.eos_token_ids),
                pad_token_id=0,
            )[0, len(prompt) :].tolist()
            full = torch.tensor([prompt + new])
            want = torch.log_softmax(model(full).logits[0].double(), -1)
        shown = [t for t in new if t not in tok.eos_token_ids]
        assert len(got) == len(shown) and got
        for k, (chosen, tops) in enumerate(got):
            row = want[len(prompt) + k - 1]
            assert abs(chosen - row[new[k]].item()) < 2e-3, k
            assert tops == sorted(tops, reverse=True) and 1 <= len(tops) <= 3
            best = torch.topk(row, 3).values.tolist()
            # Completions key top_logprobs by text: tokens that decode alike share one key.
            assert all(min(abs(a - b) for b in best) < 2e-3 for a in tops), k
            if len(tops) == 3:
                assert max(abs(a - b) for a, b in zip(tops, best, strict=True)) < 2e-3, k
            assert abs(tops[0] - chosen) < 2e-3  # greedy: the chosen one is the most likely


def test_bad_inputs_get_4xx_and_the_server_keeps_serving(cluster: Cluster, reference) -> None:
    def post(path: str, body: bytes, ctype: str = "application/json") -> tuple[int, dict]:
        req = urllib.request.Request(
            cluster.url + path, data=body, headers={"Content-Type": ctype}, method="POST"
        )
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, {}
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    cases = [
        ("/v1/chat/completions", b"{not json", 400),
        ("/chat", b"\xff\xfe\xfa", 400),
        ("/chat", b"   ", 400),
        ("/chat?max_tokens=0", b"hi", 400),
        ("/chat?max_tokens=100000", b"hi", 400),
        ("/chat", "word ".join([""] * 3000).encode() + b"x" * 5000, 400),
        (
            "/v1/chat/completions",
            json.dumps({"model": "nope", "messages": [{"role": "user", "content": "hi"}]}).encode(),
            404,
        ),
        ("/v1/chat/completions", json.dumps({"messages": "hi"}).encode(), 400),
        ("/v1/completions", json.dumps({"prompt": "hi", "max_tokens": "many"}).encode(), 400),
    ]
    for path, body, want in cases:
        status, err = post(path, body)
        assert status == want, (path, body[:40], err)
        assert "error" in err and err["error"]["message"], err
    # Over the body limit: announced by Content-Length, answered before the body is read
    # (sending all of it would race the server closing the connection).
    conn = http.client.HTTPConnection("127.0.0.1", cluster.http_port, timeout=30)
    conn.putrequest("POST", "/chat")
    conn.putheader("Content-Length", "2000000")
    conn.endheaders(b"x" * 1000)
    resp = conn.getresponse()
    assert resp.status == 413
    assert json.loads(resp.read())["error"]["message"]
    conn.close()
    status, chunks, _ = post_chat(cluster, "Hello there!", "max_tokens=16")
    assert status == 200
    assert b"".join(p for _, p in chunks).decode() == reference.body("Hello there!", 16)


def test_request_id_on_every_process_log(cluster: Cluster) -> None:
    rid = "e2e-trace-0123456789"
    status, _, headers = post_chat(cluster, "Count to five.", headers={"X-Request-ID": rid})
    assert status == 200
    assert rid in (headers.get("x-request-id"), headers.get("X-Request-ID"))

    def seen() -> list[str]:
        return [
            p.name
            for p in cluster.procs
            if any(line.get("request_id") == rid for line in cluster.log_lines(p))
        ]

    names = cluster.wait_for(lambda: len(seen()) == 4 and seen(), what="request id in 4 logs")
    assert {"broker", "gateway"} <= set(names)
    assert sum(n.startswith("worker") for n in names) == 2
    gw = [
        x
        for x in cluster.log_lines(cluster.by_name("gateway")[0])
        if x.get("request_id") == rid and x.get("event") == "request finished"
    ]
    assert gw and gw[0]["generated_tokens"] > 0 and "ttft_ms" in gw[0]


def test_client_disconnect_frees_the_session_on_every_stage(cluster: Cluster) -> None:
    conn, resp = open_long_stream(cluster, timeout=30)
    assert resp.status == 200
    resp.read1(100)
    cluster.wait_for(lambda: cluster.status()["sessions"] == 1, what="session open")
    conn.sock.close()  # the client goes away mid-stream
    conn.close()

    def all_free() -> bool:
        st = cluster.status()
        return st["sessions"] == 0 and all(
            w["sessions"] == 0 and w["stats"].get("sessions", 0) == 0 for w in st["workers"]
        )

    cluster.wait_for(all_free, timeout=10, what="caches freed on every stage")


def test_status_command_prints_tables(cluster: Cluster) -> None:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "zmqllm.cli", "status", "--broker", cluster.frontend],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    assert "0:2" in out.stdout and "2:4" in out.stdout and "complete route: yes" in out.stdout
    assert "0:2 -> 2:4" in out.stdout  # the route, as a chain of pools
    js = subprocess.run(
        [sys.executable, "-m", "zmqllm.cli", "status", "--broker", cluster.frontend, "--json"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    st = json.loads(js.stdout)
    assert len(st["workers"]) == 2 and st["complete_route"] is True


def _stream_in_thread(c: Cluster, out: dict) -> threading.Thread:
    def run() -> None:
        try:
            _, resp = open_long_stream(c, timeout=60)
            data = b""
            while True:
                piece = resp.read1(65536)
                if not piece:
                    break
                data += piece
                out.setdefault("first", time.monotonic())
            out["body"] = data.decode(errors="replace")
            out["end"] = time.monotonic()
        except Exception as exc:  # recorded for the assertion
            out["exc"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t
