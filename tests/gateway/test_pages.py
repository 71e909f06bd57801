"""The chat and cluster pages (``zmqllm.gateway.pages``) over HTTP, without a browser:
what is served, with which headers, and the JSON the cluster page draws. The pages in a
real browser: tests/e2e/test_pages_browser.py."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from importlib import resources
from typing import Any

import pytest

from tests.fake_broker_client import FakeBrokerClient
from tests.gateway.support import MODEL, TEST_HOSTS, answer_script, make_app, tiny_tokenizer
from zmqllm.config.settings import GatewaySettings
from zmqllm.gateway.api_keys import ApiKeys
from zmqllm.gateway.app import create_app
from zmqllm.gateway.pages import STATIC_FILES
from zmqllm.models.tokenizer import Tokenizer

httpx = pytest.importorskip("httpx")

pytestmark = pytest.mark.anyio

KEY = "sk-pages-7c1e"
WORKER = {
    "id": "w-a",
    "layers": [0, 2],
    "sessions": 1,
    "capacity": 64,
    "kv_tokens_reserved": 100,
    "max_kv_tokens": 65536,
    "load": 0.1,
    "last_heartbeat_s": 0.2,
    "draining": False,
    "info": {"host": "box", "pid": 42, "dtype": "float32", "device": "cpu"},
    "stats": {"busy_s": 1.5, "last_batch": 1, "rss_bytes": 300 << 20, "tokens": 10},
}


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return tiny_tokenizer(tmp_path_factory.mktemp("tiny-tokenizer"))


@pytest.fixture
def fake(tok: Tokenizer) -> FakeBrokerClient:
    fake = FakeBrokerClient(answer_script(tok))
    fake.status_extra = {"workers": [WORKER], "routes": [["0:2"]], "counters": {"tokens": 10}}
    return fake


@pytest.fixture
async def client(fake: FakeBrokerClient, tok: Tokenizer) -> AsyncIterator[Any]:
    app = make_app(fake, tok)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        yield c


@pytest.mark.parametrize(("path", "name"), [("/", "chat.html"), ("/cluster", "cluster.html")])
async def test_the_pages_are_the_packaged_files(client: Any, path: str, name: str) -> None:
    response = await client.get(path)
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/html; charset=utf-8"
    assert (
        response.content == resources.files("zmqllm.gateway").joinpath("static", name).read_bytes()
    )
    # Only the page's own files run: no inline script, nothing from another origin.
    assert "script-src 'self'" in response.headers["content-security-policy"]
    assert response.headers["x-content-type-options"] == "nosniff"
    assert "<script>" not in response.text and "http" not in re.sub(
        r'href="/[^"]*"', "", response.text
    )


async def test_every_file_a_page_names_is_served(client: Any) -> None:
    for page in ("/", "/cluster"):
        html = (await client.get(page)).text
        named = re.findall(r'(?:src|href)="(/static/[^"]+)"', html)
        assert named
        for path in named:
            response = await client.get(path)
            assert response.status_code == 200, path
            assert response.headers["content-type"] == STATIC_FILES[path.rsplit("/", 1)[1]]


@pytest.mark.parametrize(
    "path", ["/static/nope.js", "/static/..%2Fpages.py", "/static/%2e%2e/app.py", "/static/"]
)
async def test_nothing_else_is_served_from_static(client: Any, path: str) -> None:
    response = await client.get(path)
    assert response.status_code == 404
    assert "import" not in response.text  # no source file leaks out


async def test_the_chat_page_has_the_names_people_and_tests_use(client: Any) -> None:
    html = (await client.get("/")).text
    assert '<label for="message" class="sr-only">Message</label>' in html
    assert re.search(r'<button type="submit" id="send">Send</button>', html)
    assert '<button type="button" id="stop" disabled>Stop</button>' in html
    assert "Temperature" in html and "Max tokens" in html


async def test_cluster_status_is_what_the_cluster_page_draws(
    client: Any, fake: FakeBrokerClient
) -> None:
    body = (await client.get("/cluster/status")).json()
    assert body["model"] == MODEL
    assert body["gateway"] == {"in_flight": 0, "queued": 0}
    # Without prefix_stats, the figures a prefix cache hit changes stay out (issue 40, 6).
    shown = {**WORKER, "stats": {"last_batch": 1, "rss_bytes": 300 << 20}}
    assert body["broker"]["workers"] == [shown] and body["broker"]["routes"] == [["0:2"]]
    assert isinstance(body["at"], float)
    again = (await client.get("/cluster/status")).json()
    assert again["at"] == body["at"]  # the same status (reused for a second): the same time
    assert fake.status_calls == 1


async def test_cluster_status_with_the_broker_down(client: Any, fake: FakeBrokerClient) -> None:
    fake.unreachable = True
    response = await client.get("/cluster/status")
    assert response.status_code == 200 and response.json()["broker"] is None


async def test_with_api_keys_the_pages_open_and_their_data_needs_the_key(
    fake: FakeBrokerClient, tok: Tokenizer
) -> None:
    app = create_app(
        fake, GatewaySettings(allowed_hosts=TEST_HOSTS), tok, MODEL, 2048, api_keys=ApiKeys([KEY])
    )
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        for path in ("/", "/cluster", "/static/chat.js", "/static/style.css"):
            assert (await c.get(path)).status_code == 200, path
        assert (await c.get("/cluster/status")).status_code == 401
        assert (await c.get("/static/nope.js")).status_code == 401  # unknown: guarded
        authorized = {"Authorization": f"Bearer {KEY}"}
        assert (await c.get("/cluster/status", headers=authorized)).status_code == 200


def test_every_packaged_file_is_served() -> None:
    folder = resources.files("zmqllm.gateway").joinpath("static")
    assert {entry.name for entry in folder.iterdir()} == set(STATIC_FILES)
