"""A remote worker with real processes: broker + `zmqllm worker --remote` + a gateway with
no local model, in front of a fake OpenAI-compatible upstream in this process.

One cluster serves the module; each test switches the fake's ``mode``. The worker's
upstream key comes from a file: the upstream must get it, and no process may log it.
After every fault the worker must still serve (the ``fault`` fixture checks it), so one
bad upstream answer costs one request, never the worker. No model files, no torch.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from testbed.cluster import Cluster
from testbed.fake_upstream import FakeUpstream
from zmqllm.launch.child_process import ChildProcess

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]

KEY = "sk-e2e-SECRET-7f3a9c51"
MODEL = "fake-model"
HELLO = [{"role": "user", "content": "hello there world"}]
ECHO = "echo: hello there world"
USAGE = (3, 4)  # the fake's count: words of the prompt, pieces of the reply
STALL_S = 2.0  # the worker's --remote-stall-timeout
HTTP_TIMEOUT_S = 20.0  # no request here should come near it: a hang fails, not blocks


@pytest.fixture(scope="module")
def up() -> Iterator[FakeUpstream]:
    with FakeUpstream(model_id=MODEL) as fake:
        yield fake


@pytest.fixture(scope="module")
def remote(tmp_path_factory: pytest.TempPathFactory, up: FakeUpstream) -> Iterator[Cluster]:
    base = tmp_path_factory.mktemp("remote")
    # Outside the cluster's root, whose every file the log check reads.
    key_file = base / "upstream.key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    # --no-local-model: the gateway never looks at its model folder.
    c = Cluster(base / "cluster", base / "no-model")
    try:
        c.start_broker()
        c.start_remote_worker(
            up.url,
            "--api-key-file",
            str(key_file),
            "--remote-stall-timeout",
            str(STALL_S),
            "--remote-retries",
            "2",
            name="remote",
        )
        c.start_gateway("--no-local-model")
        c.wait_ready(60)
        c.wait_for(lambda: MODEL in listed_models(c), timeout=30, what="the model listed")
        yield c
    finally:
        c.stop()


def listed_models(c: Cluster) -> list[str]:
    status, raw = c.get("/v1/models")
    return [m["id"] for m in json.loads(raw)["data"]] if status == 200 else []


def worker(c: Cluster) -> ChildProcess:
    (proc,) = [p for p in c.procs if p.name == "worker-remote"]
    return proc


def client(c: Cluster) -> openai.OpenAI:
    # No retries: each test sees the gateway's first answer, and a 429 or 502 is not
    # hidden behind the package's own backoff.
    return openai.OpenAI(base_url=c.url + "/v1", api_key="x", max_retries=0, timeout=HTTP_TIMEOUT_S)


def post(c: Cluster, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(c.url + path, json=body, timeout=HTTP_TIMEOUT_S)


def sse(c: Cluster, path: str, body: dict[str, Any]) -> tuple[int, list[str]]:
    """A streamed request's status and its ``data:`` payloads, read to the end."""
    with httpx.stream(
        "POST", c.url + path, json={**body, "stream": True}, timeout=HTTP_TIMEOUT_S
    ) as r:
        lines = [line.removeprefix("data: ") for line in r.iter_lines() if line]
    return r.status_code, lines


def error_of(r: httpx.Response) -> dict[str, Any]:
    error: dict[str, Any] = r.json()["error"]
    return error


def sessions(c: Cluster) -> list[tuple[int, int]]:
    """Each worker's sessions as the broker counts them and as the worker reports them."""
    return [(w["sessions"], w["stats"].get("sessions", 0)) for w in c.status()["workers"]]


def assert_serving(c: Cluster) -> None:
    """The worker is alive, holds no session, and answers a plain request."""
    assert worker(c).alive(), worker(c).text()[-3000:]
    c.wait_for(lambda: sessions(c) == [(0, 0)], timeout=10, what="no sessions left")
    r = post(c, "/v1/chat/completions", {"model": MODEL, "messages": HELLO})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == ECHO


@pytest.fixture
def fault(up: FakeUpstream, remote: Cluster) -> Iterator[Callable[[str], None]]:
    """Sets the fake's mode for one test; afterwards the worker must still serve."""

    def set_mode(mode: str) -> None:
        up.mode = mode

    try:
        yield set_mode
    finally:
        up.mode = "ok"
    assert_serving(remote)


# -- answers -----------------------------------------------------------------------------
def test_chat_whole_and_streamed(remote: Cluster, up: FakeUpstream) -> None:
    up.mode = "ok"
    api = client(remote)
    whole = api.chat.completions.create(model=MODEL, messages=HELLO)
    assert whole.choices[0].message.content == ECHO
    assert whole.choices[0].finish_reason == "stop"
    assert whole.usage is not None
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == USAGE

    stream = api.chat.completions.create(
        model=MODEL,
        messages=HELLO,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == ECHO
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert [f for f in finishes if f] == ["stop"]
    usage = chunks[-1].usage
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == USAGE

    # What reached the upstream: the key, and the request as the worker rebuilt it.
    assert up.headers[-1].get("authorization") == f"Bearer {KEY}"
    sent = up.requests[-1]
    assert sent["model"] == MODEL and sent["stream"] is True
    assert sent["messages"] == HELLO


def test_completions_and_plain_chat(remote: Cluster, up: FakeUpstream) -> None:
    up.mode = "ok"
    done = client(remote).completions.create(model=MODEL, prompt="one two three")
    assert done.choices[0].text == "echo: one two three"
    assert done.usage is not None
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (3, 4)
    assert up.requests[-1]["prompt"] == "one two three"

    r = httpx.post(remote.url + "/chat", params={"model": MODEL}, content=b"what is up", timeout=20)
    assert r.status_code == 200, r.text
    assert r.text == "echo: what is up\n"


def test_max_tokens_reaches_the_upstream(remote: Cluster, up: FakeUpstream) -> None:
    up.mode = "ok"
    r = post(remote, "/v1/chat/completions", {"model": MODEL, "messages": HELLO, "max_tokens": 2})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert (choice["message"]["content"], choice["finish_reason"]) == ("echo: hello", "length")
    assert up.requests[-1]["max_tokens"] == 2


def test_models_listed_and_an_unknown_one_refused(remote: Cluster) -> None:
    assert listed_models(remote) == [MODEL]
    for path, body in (
        ("/v1/chat/completions", {"model": "nope", "messages": HELLO}),
        ("/v1/completions", {"model": "nope", "prompt": "x"}),
    ):
        r = post(remote, path, body)
        assert r.status_code == 404, r.text
        assert error_of(r)["code"] == "model_not_found"
    r = httpx.post(remote.url + "/chat", params={"model": "nope"}, content=b"hi", timeout=20)
    assert r.status_code == 404, r.text


# -- the upstream refuses ----------------------------------------------------------------
def test_refusals_are_retried(
    fault: Callable[[str], None], remote: Cluster, up: FakeUpstream
) -> None:
    up.refusals = 2
    fault("refuse_then_ok")
    before = len(up.requests)
    r = post(remote, "/v1/chat/completions", {"model": MODEL, "messages": HELLO})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == ECHO
    assert len(up.requests) - before == 3  # two refused, then the answer


def test_persistent_5xx_is_a_prompt_502(
    fault: Callable[[str], None], remote: Cluster, up: FakeUpstream
) -> None:
    fault("status_500")
    before = len(up.requests)
    r = post(remote, "/v1/chat/completions", {"model": MODEL, "messages": HELLO})
    assert r.status_code == 502, r.text
    error = error_of(r)
    assert error["code"] == "upstream_error"
    assert "HTTP 500" in error["message"] and "failed on purpose" in error["message"]
    # Three tries (--remote-retries 2), then the answer: no more.
    assert len(up.requests) - before == 3


def test_400_carries_the_upstreams_words(
    fault: Callable[[str], None], remote: Cluster, up: FakeUpstream
) -> None:
    fault("status_400")
    r = post(remote, "/v1/chat/completions", {"model": MODEL, "messages": HELLO})
    assert r.status_code == 400, r.text
    error = error_of(r)
    assert error["code"] == "bad_request"
    assert "max_tokens is out of range (the fake was told to refuse)" in error["message"]


def test_401_says_the_key_was_refused_without_it(
    fault: Callable[[str], None], remote: Cluster, up: FakeUpstream
) -> None:
    fault("status_401")
    r = post(remote, "/v1/chat/completions", {"model": MODEL, "messages": HELLO})
    assert r.status_code == 502, r.text
    assert "refused the worker's API key" in error_of(r)["message"]
    # The fake echoes the key in its message, as careless servers do.
    assert KEY not in r.text


def test_429_is_a_429(fault: Callable[[str], None], remote: Cluster, up: FakeUpstream) -> None:
    fault("status_429")
    r = post(remote, "/v1/chat/completions", {"model": MODEL, "messages": HELLO})
    assert r.status_code == 429, r.text
    assert error_of(r)["code"] == "busy"


# -- the upstream fails mid-answer --------------------------------------------------------
@pytest.mark.parametrize("mode", ["error_mid_stream", "close_early"])
def test_a_cut_stream_ends_in_an_error_event(
    fault: Callable[[str], None], remote: Cluster, up: FakeUpstream, mode: str
) -> None:
    fault(mode)
    stream = client(remote).chat.completions.create(
        model=MODEL,
        messages=HELLO,
        stream=True,
    )
    text = []
    with pytest.raises(openai.APIError):
        for chunk in stream:
            text.append(chunk.choices[0].delta.content or "" if chunk.choices else "")
    assert "".join(text) == "echo: hello"  # the two deltas before the trouble

    status, lines = sse(remote, "/v1/chat/completions", {"model": MODEL, "messages": HELLO})
    assert status == 200
    assert lines[-1].startswith('{"error"'), lines
    assert json.loads(lines[-1])["error"]["code"] == "upstream_error"
    assert "[DONE]" not in lines

    r = post(remote, "/v1/chat/completions", {"model": MODEL, "messages": HELLO})
    assert r.status_code == 502, r.text
    assert error_of(r)["code"] == "upstream_error"


def test_a_cut_plain_chat_ends_in_an_error_line(
    fault: Callable[[str], None], remote: Cluster, up: FakeUpstream
) -> None:
    fault("close_early")
    got = []
    # /chat then aborts its body (a broken chunked encoding), so that curl exits non-zero.
    with (
        pytest.raises(httpx.RemoteProtocolError),
        httpx.stream(
            "POST", remote.url + "/chat", params={"model": MODEL}, content=b"hi there", timeout=20
        ) as r,
    ):
        assert r.status_code == 200
        got.extend(r.iter_text())
    *answer, last = "".join(got).rstrip("\n").split("\n")
    assert "".join(answer) == "echo: hi"
    assert last.startswith("[error: upstream"), got


def test_a_stall_fails_within_the_stall_timeout(
    fault: Callable[[str], None], remote: Cluster, up: FakeUpstream
) -> None:
    fault("stall")
    # The worker's stall timeout fired, not the fake's own end (60 s) nor the client's
    # (HTTP_TIMEOUT_S, which fails the test).
    status, lines = sse(remote, "/v1/chat/completions", {"model": MODEL, "messages": HELLO})
    assert status == 200
    error = json.loads(lines[-1])["error"]
    assert error["code"] == "timeout", lines
    assert f"sent nothing for {STALL_S:g} s mid-stream" in error["message"], error

    r = post(remote, "/v1/completions", {"model": MODEL, "prompt": "a b c"})
    assert r.status_code == 504, r.text
    assert f"sent nothing for {STALL_S:g} s" in error_of(r)["message"], r.text


# -- the client leaves -------------------------------------------------------------------
def test_a_client_leaving_closes_the_upstream_stream(
    fault: Callable[[str], None], remote: Cluster, up: FakeUpstream
) -> None:
    fault("slow")
    left = up.disconnects
    body = {"model": MODEL, "messages": HELLO, "stream": True}
    with httpx.stream("POST", remote.url + "/v1/chat/completions", json=body, timeout=20) as r:
        assert r.status_code == 200
        texts = 0
        for line in r.iter_lines():
            if line.startswith("data: {") and '"content":" w' in line:
                texts += 1
            if texts == 2:
                break
    # Leaving the block closed the connection mid-answer: the gateway cancels, the broker
    # tells the worker, whose task closes its upstream connection.
    assert up.wait_disconnect(5, count=left + 1)
    remote.wait_for(lambda: sessions(remote) == [(0, 0)], timeout=10, what="the session gone")


# -- the processes -----------------------------------------------------------------------
def test_no_torch_in_the_front_end_and_the_remote_worker() -> None:
    code = "import sys, zmqllm.remote.main, zmqllm.gateway.main; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "False", out.stderr


def test_the_key_is_in_no_log(remote: Cluster, up: FakeUpstream) -> None:
    # Last in the module: the logs then hold every fault above, the 401 among them.
    assert up.headers and all(h.get("authorization") == f"Bearer {KEY}" for h in up.headers), (
        "every upstream request carries the key"
    )
    files = [p for p in Path(remote.root).rglob("*") if p.is_file()]
    assert any(p.name.endswith("worker-remote.log") for p in files), files
    for path in files:
        assert KEY not in path.read_text(errors="replace"), path
    for proc in remote.procs:
        assert KEY not in proc.text(), proc.name
    assert worker(remote).alive()
