"""Remote (text) models with real processes: a cluster served through another one, and a
pipeline model beside a remote one on one broker.

- Two clusters: the first a tiny two-stage pipeline behind its gateway; the second a
  broker, one ``zmqllm worker --remote`` pointing at the first gateway's /v1, and a
  gateway with ``--no-local-model``. Greedy answers through both equal HF's, whole and
  streamed, through /chat and the ``openai`` package; neither process of the second
  cluster maps torch.
- One broker serving the tiny pipeline (the gateway's own model) and a remote model (a
  fake upstream in this process): each answers by its name, an unknown name is a 404,
  /v1/models and ``zmqllm status`` show both.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from testbed.cluster import Cluster
from testbed.fake_upstream import FakeUpstream

pytestmark = [pytest.mark.e2e, pytest.mark.torch]

SERVED = "upstream-tiny"  # the name the second cluster serves the first one's model by
PROMPT = "Tell me about the sea."
TOKENS = 24


@pytest.fixture(scope="module")
def two_clusters(
    tmp_path_factory: pytest.TempPathFactory, e2e_model: Path
) -> Iterator[tuple[Cluster, Cluster]]:
    first = Cluster(tmp_path_factory.mktemp("first"), e2e_model)
    second = Cluster(tmp_path_factory.mktemp("second"), Path("/nonexistent"))
    try:
        first.start_all()
        second.start_broker()
        second.start_remote_worker(first.url + "/v1", "--served-name", SERVED)
        second.start_gateway("--no-local-model")
        second.wait_ready()
        yield first, second
    finally:
        second.stop()
        first.stop()


def chat_body(**fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": TOKENS, **fields}


def test_greedy_chat_through_two_clusters_equals_hf(two_clusters, reference) -> None:
    first, second = two_clusters
    expected = reference(PROMPT, TOKENS)
    assert expected  # a non-empty reference: equality below means something
    r = httpx.post(second.url + "/v1/chat/completions", json=chat_body(model=SERVED), timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == SERVED
    assert body["choices"][0]["message"]["content"] == expected
    # The first gateway's usage came through the remote worker.
    direct = httpx.post(first.url + "/v1/chat/completions", json=chat_body(), timeout=60).json()
    assert body["usage"] == direct["usage"]


def test_streamed_chat_and_plain_chat_through_two_clusters(two_clusters, reference) -> None:
    _, second = two_clusters
    expected = reference(PROMPT, TOKENS)
    pieces = []
    with httpx.stream(
        "POST", second.url + "/v1/chat/completions", json=chat_body(stream=True), timeout=60
    ) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        for choice in json.loads(line[len("data: ") :])["choices"]:
            pieces.append(choice["delta"].get("content") or "")
    assert len([p for p in pieces if p]) > 1  # streamed as it came, not in one piece
    assert "".join(pieces) == expected
    # curl's /chat: the model by name in the query (the default is the only model too).
    r = httpx.post(
        second.url + f"/chat?model={SERVED}&max_tokens={TOKENS}", content=PROMPT, timeout=60
    )
    assert r.status_code == 200 and r.text == expected + "\n"


def test_the_openai_package_through_two_clusters(two_clusters, reference) -> None:
    import openai

    first, second = two_clusters
    client = openai.OpenAI(base_url=second.url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == [SERVED]
    expected = reference(PROMPT, TOKENS)
    messages = [{"role": "user", "content": PROMPT}]
    whole = client.chat.completions.create(model=SERVED, messages=messages, max_tokens=TOKENS)
    assert whole.choices[0].message.content == expected
    stream = client.chat.completions.create(
        model=SERVED, messages=messages, max_tokens=TOKENS, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected
    # Completions too: the same text as the first cluster's own answer.
    prompt = "Once upon a time"
    direct = openai.OpenAI(base_url=first.url + "/v1", api_key="unused", max_retries=0)
    want = direct.completions.create(model="tiny", prompt=prompt, max_tokens=TOKENS)
    got = client.completions.create(model=SERVED, prompt=prompt, max_tokens=TOKENS)
    assert got.choices[0].text == want.choices[0].text and got.choices[0].text
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=messages)


def test_the_second_cluster_never_loads_torch(two_clusters) -> None:
    _, second = two_clusters
    for name in ("gateway", "worker-remote"):
        (proc,) = second.by_name(name)
        maps = Path(f"/proc/{proc.popen.pid}/maps").read_text()
        assert "libtorch" not in maps and "site-packages/torch/" not in maps, name


# -- a pipeline model and a remote model on one broker -------------------------------------


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory, e2e_model: Path) -> Iterator[Any]:
    with FakeUpstream() as up:
        c = Cluster(tmp_path_factory.mktemp("mixed"), e2e_model)
        try:
            c.start_all(("0:2", "2:4"), up.url)
            yield c, up
        finally:
            c.stop()


def test_each_model_of_one_broker_answers_by_its_name(mixed, reference) -> None:
    c, up = mixed
    names = [m["id"] for m in httpx.get(c.url + "/v1/models").json()["data"]]
    assert names == ["tiny", up.model_id]  # the gateway's own model first
    r = httpx.post(c.url + "/v1/chat/completions", json=chat_body(model="tiny"), timeout=60)
    assert r.json()["choices"][0]["message"]["content"] == reference(PROMPT, TOKENS)
    # No model named: the gateway's own.
    r = httpx.post(c.url + "/v1/chat/completions", json=chat_body(), timeout=60)
    assert r.json()["model"] == "tiny"
    r = httpx.post(c.url + "/v1/chat/completions", json=chat_body(model=up.model_id), timeout=60)
    assert r.status_code == 200
    assert r.json()["choices"][0]["message"]["content"] == "echo: " + PROMPT
    r = httpx.post(c.url + f"/chat?model={up.model_id}", content="hello there", timeout=60)
    assert r.text == "echo: hello there\n"
    r = httpx.post(c.url + "/v1/completions", json={"model": "nope", "prompt": "x"}, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(c.url + "/chat?model=nope", content="x", timeout=60)
    assert r.status_code == 404


def test_status_groups_the_workers_by_model(mixed) -> None:
    c, up = mixed
    out = subprocess.run(
        [sys.executable, "-m", "zmqllm.cli", "status", "--broker", c.frontend, "--insecure"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    lines = out.splitlines()
    assert "models 2" in lines[0]
    assert "model tiny  4 layers  complete route: yes" in lines
    assert f"model {up.model_id}  remote (text)  complete route: yes" in lines


def test_a_local_model_whose_name_a_remote_model_took_refuses_to_start(
    tmp_path: Path, e2e_model: Path
) -> None:
    """The broker's only worker is a remote model named "tiny", and the gateway's own
    model is "tiny" too: no worker of layers can join under that name, so waiting would
    be for ever. The gateway exits with status 2 saying what to change."""
    with FakeUpstream() as up:
        c = Cluster(tmp_path / "clash", e2e_model)
        try:
            c.start_broker()
            c.start_remote_worker(up.url, "--served-name", "tiny")
            c.wait_for(lambda: len(c.status().get("workers", [])) == 1, what="the remote worker")
            gateway = c.start_gateway()
            assert gateway.wait(timeout=120) == 2
            log = gateway.text()
            assert "the broker serves model 'tiny' as a remote model" in log
            assert "--model-name" in log and "--served-name" in log
            assert "warm-up generation failed" not in log
        finally:
            c.stop()
