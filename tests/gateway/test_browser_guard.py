"""DNS rebinding and cross-site requests (issue 29, item 6): a Host the gateway is not
served as gets 400, a cross-origin request 403 unless `cors_origins` names its origin, a
JSON route a body not labelled JSON 415; none of them starts a generation."""

from __future__ import annotations

import io
from typing import Any

import pytest

from tests.fake_broker_client import FakeBrokerClient
from tests.gateway.support import CHAT_ANSWER, answer_script, make_app, tiny_tokenizer
from zmqllm.gateway.browser_guard import HostRule, OriginRule, host_name
from zmqllm.log import configure_logging
from zmqllm.models.tokenizer import Tokenizer

httpx = pytest.importorskip("httpx")

pytestmark = pytest.mark.anyio

CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
# What a rebinding page reads: every path (with the body each takes).
READABLE: list[tuple[str, str, dict[str, Any]]] = [
    ("POST", "/chat", {"content": b"Hi"}),
    ("POST", "/v1/chat/completions", {"json": CHAT}),
    ("GET", "/v1/models", {}),
    ("GET", "/cluster/status", {}),
    ("GET", "/metrics", {}),
    ("GET", "/health", {}),
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return tiny_tokenizer(tmp_path_factory.mktemp("tiny-tokenizer"))


def client(app: Any, host: str = "127.0.0.1:8080") -> Any:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=f"http://{host}")


def default_app(tok: Tokenizer, **settings: Any) -> tuple[Any, FakeBrokerClient]:
    fake = FakeBrokerClient(answer_script(tok))
    # The gateway's own defaults: allowed_hosts empty, bound to 127.0.0.1.
    settings.setdefault("allowed_hosts", "")
    return make_app(fake, tok, **settings), fake


def test_host_names_are_read_without_port_or_brackets() -> None:
    assert host_name("LocalHost:8080") == "localhost"
    assert host_name("[::1]:8080") == "::1"
    assert host_name("::1") == "::1"
    assert host_name("gw.example.com.") == "gw.example.com"


def test_default_hosts_follow_the_bind_address() -> None:
    local = HostRule("", "127.0.0.1")
    assert all(local.allows(h) for h in ("127.0.0.1", "localhost", "::1"))
    assert not local.allows("attacker.example") and not local.allows("198.18.0.5")
    node = HostRule("", "198.18.0.2")
    assert node.allows("198.18.0.2") and not node.allows("198.18.0.3")
    # Bound to every interface: any address (never rebound), names only its own.
    every = HostRule("", "0.0.0.0")
    assert every.allows("198.18.0.5") and every.allows("fe80::1")
    assert not every.allows("attacker.example")
    # A list replaces the defaults; "*" lets any host in.
    listed = HostRule("gw.example.com, localhost", "0.0.0.0")
    assert listed.allows("gw.example.com") and not listed.allows("198.18.0.5")
    assert HostRule("*", "127.0.0.1").allows("anything.example")


def test_origins_are_compared_by_scheme_host_and_port() -> None:
    rule = OriginRule(["https://app.example.com", "http://localhost:3000"])
    assert rule.allows("https://app.example.com") and rule.allows("https://app.example.com:443")
    assert not rule.allows("http://app.example.com") and not rule.allows("http://localhost")
    assert not rule.allows("null") and not rule.allows("garbage")
    assert OriginRule(["*"]).allows("https://anything.example")
    # A stray bracket made urlsplit raise: a 500 for a hostile Origin, now a refusal.
    assert not rule.allows("https://x].example") and not rule.allows("http://[::1")


@pytest.mark.parametrize(("method", "path", "kwargs"), READABLE)
async def test_a_rebound_host_reads_nothing(
    tok: Tokenizer, method: str, path: str, kwargs: dict[str, Any]
) -> None:
    app, fake = default_app(tok)
    async with client(app, "attacker.example:8080") as c:
        response = await c.request(method, path, **kwargs)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "host_not_allowed"
    assert "allowed_hosts" in response.json()["error"]["message"]
    assert response.headers["x-request-id"]
    assert fake.calls == []


@pytest.mark.parametrize("host", ["127.0.0.1:8080", "localhost:8080", "[::1]:8080"])
async def test_the_gateway_answers_as_its_own_hosts(tok: Tokenizer, host: str) -> None:
    app, _ = default_app(tok)
    async with client(app, host) as c:
        response = await c.post("/chat", content=b"Hi")
    assert response.status_code == 200 and response.text == CHAT_ANSWER


async def test_a_cross_site_page_cannot_make_the_gateway_generate(tok: Tokenizer) -> None:
    app, fake = default_app(tok)
    page = {"Origin": "https://evil.example", "Content-Type": "text/plain"}
    async with client(app) as c:
        chat = await c.post("/chat", content=b"Hi", headers=page)
        openai = await c.post("/v1/chat/completions", json=CHAT, headers={"Origin": page["Origin"]})
        preflight = await c.options(
            "/v1/chat/completions",
            headers={"Origin": page["Origin"], "Access-Control-Request-Method": "POST"},
        )
    for response in (chat, openai, preflight):
        assert response.status_code == 403, response.text
        assert response.json()["error"]["code"] == "origin_not_allowed"
        assert "access-control-allow-origin" not in response.headers
    assert fake.calls == []


async def test_the_gateway_own_pages_are_same_origin(tok: Tokenizer) -> None:
    app, _ = default_app(tok)
    async with client(app, "localhost:8080") as c:
        response = await c.post(
            "/v1/chat/completions", json=CHAT, headers={"Origin": "http://localhost:8080"}
        )
    assert response.status_code == 200, response.text


async def test_a_named_origin_gets_cors_headers(tok: Tokenizer) -> None:
    origin = "https://app.example.com"
    app, _ = default_app(tok, cors_origins=f"{origin}, http://localhost:3000")
    async with client(app) as c:
        preflight = await c.options(
            "/v1/chat/completions",
            headers={
                "Origin": origin,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type",
            },
        )
        response = await c.post("/v1/chat/completions", json=CHAT, headers={"Origin": origin})
    assert preflight.status_code == 204
    assert preflight.headers["access-control-allow-origin"] == origin
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert "Authorization" in preflight.headers["access-control-allow-headers"]
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] == origin
    assert "X-Request-ID" in response.headers["access-control-expose-headers"]
    assert "Origin" in response.headers["vary"]


@pytest.mark.parametrize("kind", [None, "text/plain", "application/x-www-form-urlencoded"])
async def test_json_routes_want_json(tok: Tokenizer, kind: str | None) -> None:
    app, fake = default_app(tok)
    headers = {} if kind is None else {"Content-Type": kind}
    body = b'{"prompt": "Hi", "max_tokens": 4}'
    async with client(app) as c:
        for path in ("/v1/completions", "/v1/chat/completions"):
            response = await c.post(path, content=body, headers=headers)
            assert response.status_code == 415, response.text
            error = response.json()["error"]
            assert (
                error["code"] == "unsupported_media_type" and "application/json" in error["message"]
            )
        # /chat keeps taking text (curl -d labels it form-urlencoded).
        chat = await c.post("/chat", content=b"Hi", headers=headers)
    assert chat.status_code == 200 and chat.text == CHAT_ANSWER
    assert len(fake.calls) == 1


async def test_json_with_a_charset_is_json(tok: Tokenizer) -> None:
    app, _ = default_app(tok)
    async with client(app) as c:
        response = await c.post(
            "/v1/completions",
            content=b'{"prompt": "Hi", "max_tokens": 4}',
            headers={"Content-Type": "application/json; charset=utf-8"},
        )
    assert response.status_code == 200, response.text


async def test_a_refused_host_or_origin_reaches_the_console_log_escaped(
    tok: Tokenizer, restore_logging: None
) -> None:
    """The console format (an operator's terminal) shows a hostile Host or Origin with its
    escapes written out: no sequence in a request header reaches the terminal."""
    stream = io.StringIO()
    configure_logging("gateway", fmt="console", stream=stream)
    app, fake = default_app(tok)
    async with client(app) as c:
        host = await c.get("/health", headers={"Host": b"evil\x1b[2J.example"})
        origin = await c.post(
            "/chat", content=b"Hi", headers={"Origin": b"https://x\x9b2J\x1bc\x07.example"}
        )
    assert (host.status_code, origin.status_code) == (400, 403)
    text = stream.getvalue()
    assert "request refused: Host not allowed" in text and "evil\\x1b[2J.example" in text
    assert "request refused: cross-origin" in text and "x\\x9b2J\\x1bc\\x07.example" in text
    assert not any(c in text for c in "\x1b\x07\x9b")
    assert fake.calls == []
