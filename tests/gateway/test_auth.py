"""API keys and TLS on the gateway's HTTP side, against a fake broker client.

Every path but /health and /ready needs ``Authorization: Bearer KEY``; a request without
one gets an OpenAI-style 401 before its route runs. TLS files are checked at start
(both or neither, readable, a certificate and its own key) and served by uvicorn.
"""

from __future__ import annotations

import io
import json
import re
import ssl
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.fake_broker_client import FakeBrokerClient
from tests.gateway.support import (
    ANSWER,
    MODEL,
    TEST_HOSTS,
    answer_script,
    make_app,
    serving,
    tiny_tokenizer,
)
from tests.tls_support import openssl, self_signed
from zmqllm import cli
from zmqllm.config.settings import ConfigError, GatewaySettings
from zmqllm.gateway.api_keys import ApiKeys
from zmqllm.gateway.app import create_app
from zmqllm.gateway.http_server import base_url, tls_files, uvicorn_config
from zmqllm.models.tokenizer import Tokenizer

httpx = pytest.importorskip("httpx")

KEY = "sk-test-4f1d2c"
OTHER = "sk-test-other"
CHAT = {"messages": [{"role": "user", "content": "Hi"}]}
# Every guarded path, asked the way a client asks it.
GUARDED: list[tuple[str, str, dict[str, Any]]] = [
    ("POST", "/chat", {"content": b"Hi"}),
    ("GET", "/v1/models", {}),
    ("POST", "/v1/completions", {"json": {"prompt": "Hi"}}),
    ("POST", "/v1/chat/completions", {"json": CHAT}),
    ("GET", "/metrics", {}),
]
UNAUTHORIZED = {"type": "authentication_error", "param": None, "code": "invalid_api_key"}


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return tiny_tokenizer(tmp_path_factory.mktemp("tiny-tokenizer"))


@pytest.fixture
def fake(tok: Tokenizer) -> FakeBrokerClient:
    return FakeBrokerClient(answer_script(tok))


@pytest.fixture
async def client(fake: FakeBrokerClient, tok: Tokenizer) -> AsyncIterator[Any]:
    app = make_app_with_keys(fake, tok)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
            yield http


def make_app_with_keys(fake: FakeBrokerClient, tok: Tokenizer) -> Any:
    return create_app(
        fake,
        GatewaySettings(allowed_hosts=TEST_HOSTS),
        tok,
        MODEL,
        2048,
        api_keys=ApiKeys([KEY, OTHER]),
        ready_poll_interval=0.01,
        ready_recheck_interval=0.02,
    )


def generations(fake: FakeBrokerClient) -> list[Any]:
    """What the fake was asked to generate, less the readiness warm-up."""
    return [call for call in fake.calls if not call.request_id.startswith("warmup-")]


def answer_of(path: str, response: Any) -> str | None:
    """The generated text in a 200 answer (None where the path generates none)."""
    if path == "/chat":
        return str(response.text).removesuffix("\n")
    if path == "/v1/completions":
        return str(response.json()["choices"][0]["text"])
    if path == "/v1/chat/completions":
        return str(response.json()["choices"][0]["message"]["content"])
    return None


def assert_refused(response: Any, message: str) -> None:
    assert response.status_code == 401, response.text
    assert response.json() == {"error": {"message": message, **UNAUTHORIZED}}
    assert response.headers["www-authenticate"] == "Bearer"
    assert response.headers["x-request-id"]


# --- the app --------------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize(("method", "path", "kwargs"), GUARDED)
async def test_every_guarded_path_needs_a_valid_key(
    client: Any, fake: FakeBrokerClient, method: str, path: str, kwargs: dict[str, Any]
) -> None:
    missing = await client.request(method, path, **kwargs)
    assert_refused(missing, "missing API key: send it as the header 'Authorization: Bearer KEY'")
    wrong = await client.request(method, path, headers={"Authorization": "Bearer nope"}, **kwargs)
    assert_refused(wrong, "invalid API key")
    basic = await client.request(method, path, headers={"Authorization": "Basic eDp5"}, **kwargs)
    assert_refused(basic, "malformed Authorization header: expected 'Bearer KEY'")
    assert not generations(fake)  # nothing reached the broker

    for key in (KEY, OTHER):
        ok = await client.request(
            method, path, headers={"Authorization": f"Bearer {key}"}, **kwargs
        )
        assert ok.status_code == 200, ok.text
        assert answer_of(path, ok) in (ANSWER, None)


@pytest.mark.anyio
async def test_probes_are_open_and_unknown_paths_are_guarded(client: Any) -> None:
    assert (await client.get("/health")).json() == {"status": "ok"}
    ready = await client.get("/ready")
    assert ready.status_code in (200, 503) and "status" in ready.json()  # not a 401
    assert_refused(
        await client.get("/nope"),
        "missing API key: send it as the header 'Authorization: Bearer KEY'",
    )
    # Refused before the body is read: a body past max_body_bytes is a 401, not a 413.
    big = await client.post("/v1/completions", content=b"x" * 2_000_000)
    assert big.status_code == 401
    # With a key an unknown path is the usual 404: keys guard, routes decide.
    found = await client.get("/nope", headers={"Authorization": f"Bearer {KEY}"})
    assert found.status_code == 404


@pytest.mark.anyio
async def test_refusals_are_counted_and_logged_without_the_key(
    client: Any, log_stream: io.StringIO
) -> None:
    await client.get("/v1/models")
    await client.get("/v1/models", headers={"Authorization": "Bearer sk-guess-1"})
    await client.get("/v1/models", headers={"Authorization": "Bearer sk-guess-2"})
    await client.get("/v1/models", headers={"Authorization": "Token x"})
    text = (await client.get("/metrics", headers={"Authorization": f"Bearer {KEY}"})).text
    assert 'zmqllm_http_unauthorized_total{reason="missing"} 1.0' in text
    assert 'zmqllm_http_unauthorized_total{reason="invalid"} 2.0' in text
    assert 'zmqllm_http_unauthorized_total{reason="malformed"} 1.0' in text
    assert 'zmqllm_requests_total{path="/v1/models",status="401"} 4.0' in text

    lines = [json.loads(line) for line in log_stream.getvalue().splitlines()]
    refused = [line for line in lines if line["event"] == "request refused: no valid API key"]
    assert [line["reason"] for line in refused] == ["missing", "invalid", "invalid", "malformed"]
    assert all(line["request_id"] and line["path"] == "/v1/models" for line in refused)
    finished = [line for line in lines if line["event"] == "request finished"]
    assert [line["status"] for line in finished[:4]] == [401] * 4
    assert finished[0]["error"] == "invalid_api_key"
    for secret in ("sk-guess", KEY, OTHER):
        assert secret not in log_stream.getvalue()


@pytest.mark.anyio
async def test_the_settings_key_file_is_honoured(
    fake: FakeBrokerClient, tok: Tokenizer, tmp_path: Path
) -> None:
    path = tmp_path / "keys.txt"
    path.write_text(f"# gateway keys\n{KEY}\n")
    app = make_app(fake, tok, api_keys_file=str(path))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        assert (await c.get("/v1/models")).status_code == 401
        authorized = {"Authorization": f"Bearer {KEY}"}
        assert (await c.get("/v1/models", headers=authorized)).status_code == 200


@pytest.mark.anyio
async def test_without_keys_the_api_stays_open(fake: FakeBrokerClient, tok: Tokenizer) -> None:
    app = make_app(fake, tok)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        assert (await c.get("/v1/models")).status_code == 200


# --- the openai package on a real port, over http and https ---------------------------------


def test_openai_package_with_the_key_over_https(
    fake: FakeBrokerClient, tok: Tokenizer, tmp_path: Path
) -> None:
    openai = pytest.importorskip("openai")
    cert, key = self_signed(tmp_path)
    app = make_app_with_keys(fake, tok)
    app.state.gateway.settings = GatewaySettings(ssl_certfile=str(cert), ssl_keyfile=str(key))
    trust = ssl.create_default_context(cafile=str(cert))
    with serving(app) as (url, _server), httpx.Client(verify=trust) as http:
        secure = url.replace("http://", "https://") + "/v1"
        api = openai.OpenAI(base_url=secure, api_key=KEY, http_client=http, max_retries=0)
        messages = [{"role": "user", "content": "Capital of France?"}]
        answer = api.chat.completions.create(model=MODEL, messages=messages)
        assert answer.choices[0].message.content == ANSWER

        wrong = openai.OpenAI(base_url=secure, api_key="sk-wrong", http_client=http, max_retries=0)
        with pytest.raises(openai.AuthenticationError) as refused:
            wrong.models.list()
        assert refused.value.status_code == 401 and refused.value.code == "invalid_api_key"

        # A client that does not trust the certificate is stopped by TLS itself.
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(secure + "/models")
        # Plain http to the https port gets no answer.
        with pytest.raises(httpx.HTTPError):
            httpx.get(url + "/health", timeout=5)


# --- TLS settings ---------------------------------------------------------------------------


def test_tls_files_pass_to_uvicorn_and_the_url_says_https(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    settings = GatewaySettings(
        host="127.0.0.1", port=8443, ssl_certfile=str(cert), ssl_keyfile=str(key)
    )
    assert tls_files(settings) == (str(cert), str(key))
    config = uvicorn_config(object(), settings)
    assert (config.ssl_certfile, config.ssl_keyfile) == (str(cert), str(key))
    assert base_url(settings) == "https://127.0.0.1:8443"
    assert base_url(GatewaySettings(host="::1", port=80)) == "http://[::1]:80"
    plain = uvicorn_config(object(), GatewaySettings())
    assert plain.ssl_certfile is None and plain.ssl_keyfile is None


def bad_tls_cases(tmp_path: Path) -> list[tuple[dict[str, str], str]]:
    cert, key = self_signed(tmp_path, "one")
    other_cert, _ = self_signed(tmp_path, "two")
    encrypted = tmp_path / "encrypted-key.pem"
    topk8 = ["pkcs8", "-topk8", "-in", str(key), "-out", str(encrypted), "-passout", "pass:pw"]
    subprocess.run([openssl(), *topk8], capture_output=True, check=True, timeout=30)
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    return [
        ({"ssl_certfile": str(cert)}, "TLS needs both ssl_certfile and ssl_keyfile"),
        ({"ssl_keyfile": str(key)}, "ssl_keyfile given, ssl_certfile not"),
        (
            {"ssl_certfile": str(tmp_path / "nope.pem"), "ssl_keyfile": str(key)},
            re.escape(f"TLS certificate file {tmp_path / 'nope.pem'}: cannot read it"),
        ),
        ({"ssl_certfile": str(cert), "ssl_keyfile": str(tmp_path)}, "TLS key file .*: cannot read"),
        ({"ssl_certfile": str(garbage), "ssl_keyfile": str(key)}, "cannot be used"),
        ({"ssl_certfile": str(other_cert), "ssl_keyfile": str(key)}, "cannot be used"),
        ({"ssl_certfile": str(cert), "ssl_keyfile": str(encrypted)}, "is encrypted"),
    ]


def test_bad_tls_settings_are_config_errors(tmp_path: Path) -> None:
    for given, message in bad_tls_cases(tmp_path):
        with pytest.raises(ConfigError, match=message):
            tls_files(GatewaySettings(**given))


@pytest.mark.usefixtures("restore_logging")
def test_the_gateway_command_exits_2_naming_a_bad_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "empty-keys.txt"
    empty.write_text("# nothing yet\n")
    cert, _ = self_signed(tmp_path)
    cases = [
        (f'api_keys_file = "{empty}"', f"{empty} holds no keys"),
        (f'api_keys_file = "{tmp_path / "absent.txt"}"', f"{tmp_path / 'absent.txt'}: cannot read"),
        (f'ssl_certfile = "{cert}"', "TLS needs both ssl_certfile and ssl_keyfile"),
    ]
    for line, message in cases:
        config = tmp_path / "gateway.toml"
        config.write_text(f'[gateway]\n{line}\n[log]\nformat = "json"\n')
        # Exits before the model's files are looked for: the model path does not exist.
        assert cli.main(["gateway", "--config", str(config), "--model", "/no/such/model"]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err


def test_a_tls_handshake_that_never_ends_is_cut_at_the_header_deadline(
    fake: FakeBrokerClient, tok: Tokenizer, tmp_path: Path
) -> None:
    """A client that connects to the https port and sends nothing (no ClientHello) holds
    a socket only until header_timeout, as a slow plain-http client does."""
    import socket

    cert, key = self_signed(tmp_path)
    app = make_app_with_keys(fake, tok)
    app.state.gateway.settings = GatewaySettings(
        ssl_certfile=str(cert), ssl_keyfile=str(key), header_timeout=1.0
    )
    with serving(app) as (url, _server):
        host, port = url.removeprefix("http://").split(":")
        # Waited for 30 s at most (socket.timeout fails the test): 30 times the header
        # deadline, and only half of asyncio's own 60 s bound on a handshake.
        silent = socket.create_connection((host, int(port)), timeout=30)
        try:
            assert silent.recv(1024) == b""  # closed by the server
        except ConnectionResetError:
            pass
        finally:
            silent.close()
