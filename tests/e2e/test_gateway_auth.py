"""API keys and TLS as users meet them: curl and the openai package against real processes.

One broker and two workers (layers 0:2 and 2:4 of the tiny model) serve two gateways, both
configured through a TOML file as `zmqllm gateway --config FILE` reads it: one over http
with an API key file, one over https with a self-signed certificate made here (and the
same keys). Answers with the right key must equal HF greedy generate on the same weights.
"""

from __future__ import annotations

import json
import os
import shutil
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from testbed.cluster import Cluster, free_port
from tests.tls_support import self_signed

pytestmark = [pytest.mark.e2e, pytest.mark.torch]

KEY = "sk-e2e-7d0c1f9a42b6"
NEW_KEY = "sk-e2e-rotated-5e8b"
PROMPT = "Why is the sky blue?"
UNAUTHORIZED = {"type": "authentication_error", "param": None, "code": "invalid_api_key"}
# Every guarded path with a body it would accept: (method, path, body).
GUARDED = [
    ("POST", "/chat?max_tokens=4", b"Hi"),
    ("GET", "/v1/models", None),
    ("POST", "/v1/completions", json.dumps({"prompt": "Hi", "max_tokens": 4}).encode()),
    (
        "POST",
        "/v1/chat/completions",
        json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}).encode(),
    ),
    ("GET", "/metrics", None),
]


@dataclass
class Secured:
    cluster: Cluster
    keys_file: Path
    cert: Path
    key: Path
    tls_port: int

    @property
    def url(self) -> str:
        return self.cluster.url

    @property
    def tls_url(self) -> str:
        return f"https://127.0.0.1:{self.tls_port}"

    def trust(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.cert))


def write_config(path: Path, **gateway: str) -> Path:
    lines = [f"{name} = {json.dumps(value)}" for name, value in gateway.items()]
    path.write_text("[gateway]\n" + "\n".join(lines) + "\n")
    return path


def request(
    url: str, method: str = "GET", body: bytes | None = None, key: str | None = None, **kw: Any
) -> tuple[int, dict[str, str], bytes]:
    headers = {"Content-Type": "application/json"} if body is not None else {}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=body, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=60, **kw) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def wait_https_ready(c: Cluster, port: int, trust: ssl.SSLContext, timeout: float = 60.0) -> None:
    gateway = c.procs[-1]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not gateway.alive():
            raise RuntimeError(f"https gateway exited:\n{gateway.text()[-3000:]}")
        try:
            if request(f"https://127.0.0.1:{port}/ready", context=trust)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"https gateway not ready:\n{gateway.text()[-3000:]}")


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory, e2e_model: Path) -> Iterator[Secured]:
    root = tmp_path_factory.mktemp("auth")
    keys_file = root / "api-keys.txt"
    keys_file.write_text(f"# e2e keys\n{KEY}\n")
    cert, key = self_signed(root / "tls")
    plain = write_config(root / "keys.toml", api_keys_file=str(keys_file))
    tls = write_config(
        root / "tls.toml",
        api_keys_file=str(keys_file),
        ssl_certfile=str(cert),
        ssl_keyfile=str(key),
    )
    c = Cluster(root / "cluster", e2e_model)
    try:
        c.start_broker()
        for layers in ("0:2", "2:4"):
            c.start_worker(layers)
        tls_port = free_port()
        c.start_gateway("--config", str(tls), "--port", str(tls_port))
        c.start_gateway("--config", str(plain))  # the last gateway: what wait_ready watches
        c.wait_ready()
        s = Secured(c, keys_file, cert, key, tls_port)
        wait_https_ready(c, tls_port, s.trust())
        yield s
    finally:
        c.stop()


def test_every_guarded_path_refuses_a_missing_or_wrong_key(secured: Secured) -> None:
    for method, path, body in GUARDED:
        for key in (None, "sk-wrong"):
            status, headers, raw = request(secured.url + path, method, body, key)
            assert status == 401, (path, key, raw)
            error = json.loads(raw)["error"]
            assert {k: error[k] for k in UNAUTHORIZED} == UNAUTHORIZED
            assert headers["www-authenticate"] == "Bearer"
        status, _, raw = request(secured.url + path, method, body, KEY)
        assert status == 200, (path, raw)
    # Probes need no key.
    assert request(secured.url + "/health")[:1] == (200,)
    assert request(secured.url + "/ready")[:1] == (200,)


def curl(*args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("curl")
    if exe is None:
        pytest.skip("curl is not installed")
    return subprocess.run(
        [exe, "-sS", "-N", "--max-time", "60", *args], capture_output=True, text=True, timeout=90
    )


def test_curl_with_the_key_gets_the_greedy_answer(secured: Secured, reference) -> None:
    want = reference.body(PROMPT, 40)
    url = secured.url + "/chat?max_tokens=40"
    done = curl("-H", f"Authorization: Bearer {KEY}", "-d", PROMPT, url)
    assert done.returncode == 0, done.stderr
    assert done.stdout == want
    refused = curl("-w", "\n%{http_code}", "-d", PROMPT, url)
    body, _, code = refused.stdout.rpartition("\n")
    assert code == "401" and json.loads(body)["error"]["code"] == "invalid_api_key"
    # And over https, trusting the test's certificate.
    tls = curl(
        "--cacert",
        str(secured.cert),
        "-H",
        f"Authorization: Bearer {KEY}",
        "-d",
        PROMPT,
        secured.tls_url + "/chat?max_tokens=40",
    )
    assert tls.returncode == 0, tls.stderr
    assert tls.stdout == want


def test_openai_package_with_the_key(secured: Secured, reference) -> None:
    openai = pytest.importorskip("openai")
    api = openai.OpenAI(base_url=secured.url + "/v1", api_key=KEY, max_retries=0)
    name = api.models.list().data[0].id
    messages = [{"role": "user", "content": PROMPT}]
    answer = api.chat.completions.create(model=name, messages=messages, max_tokens=24)
    assert answer.choices[0].message.content == reference(PROMPT, 24)
    stream = api.completions.create(model=name, prompt="The quick", max_tokens=24, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == reference.raw("The quick", 24)

    wrong = openai.OpenAI(base_url=secured.url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as refused:
        wrong.chat.completions.create(model=name, messages=messages, max_tokens=24)
    assert refused.value.status_code == 401 and refused.value.code == "invalid_api_key"


def test_openai_package_over_https(secured: Secured, reference) -> None:
    openai = pytest.importorskip("openai")
    httpx = pytest.importorskip("httpx")
    with httpx.Client(verify=secured.trust()) as http:
        api = openai.OpenAI(
            base_url=secured.tls_url + "/v1", api_key=KEY, http_client=http, max_retries=0
        )
        name = api.models.list().data[0].id
        messages = [{"role": "user", "content": PROMPT}]
        answer = api.chat.completions.create(model=name, messages=messages, max_tokens=24)
        assert answer.choices[0].message.content == reference(PROMPT, 24)
        stream = api.chat.completions.create(
            model=name, messages=messages, max_tokens=24, stream=True
        )
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert streamed == reference(PROMPT, 24)
    # Without trusting the certificate, TLS itself refuses.
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        urllib.request.urlopen(secured.tls_url + "/health", timeout=10)


def test_a_rotated_key_file_takes_effect_without_a_restart(secured: Secured) -> None:
    def status_with(key: str) -> int:
        return request(secured.url + "/v1/models", key=key)[0]

    def swap(text: str) -> None:
        tmp = secured.keys_file.with_suffix(".new")
        tmp.write_text(text)
        os.replace(tmp, secured.keys_file)

    swap(f"{NEW_KEY}\n")
    try:
        secured.cluster.wait_for(lambda: status_with(KEY) == 401, 10, "the old key refused")
        assert status_with(NEW_KEY) == 200
        # A broken file (no keys) keeps the keys in force.
        swap("# all keys removed by mistake\n")
        time.sleep(1.5)
        assert status_with(NEW_KEY) == 200
    finally:
        swap(f"{KEY}\n")
        secured.cluster.wait_for(lambda: status_with(KEY) == 200, 10, "the key restored")
    lines = "\n".join(p.text() for p in secured.cluster.by_name("gateway"))
    assert "API keys reloaded" in lines and "API keys not reloaded" in lines
    assert KEY not in lines and NEW_KEY not in lines


def start_extra_gateway(
    secured: Secured, *flags: str, trust: ssl.SSLContext | None = None
) -> tuple[Any, str]:
    """Another gateway on the module's cluster, listening (its /health answers); its URL."""
    port = free_port()
    proc = secured.cluster.start_gateway("--port", str(port), *flags)
    url = f"{'https' if trust else 'http'}://127.0.0.1:{port}"

    def listening() -> bool:
        assert proc.alive(), proc.text()[-2000:]
        try:
            return request(url + "/health", context=trust)[0] == 200  # open: no key needed
        except OSError:
            return False

    secured.cluster.wait_for(listening, 60, "the gateway listening")
    return proc, url


def test_the_environment_variable_gives_the_key(
    secured: Secured, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ZMQLLM_API_KEY", NEW_KEY)
    proc, url = start_extra_gateway(secured)
    try:
        assert request(url + "/v1/models")[0] == 401
        assert request(url + "/v1/models", key=NEW_KEY)[0] == 200
    finally:
        secured.cluster.kill(proc)


def test_the_command_line_flags_do_what_the_config_does(secured: Secured) -> None:
    flags = ["--api-key-file", str(secured.keys_file)]
    flags += ["--ssl-certfile", str(secured.cert), "--ssl-keyfile", str(secured.key)]
    trust = secured.trust()
    proc, url = start_extra_gateway(secured, *flags, trust=trust)
    try:
        assert url.startswith("https://")
        assert request(url + "/v1/models", context=trust)[0] == 401
        assert request(url + "/v1/models", key=KEY, context=trust)[0] == 200
    finally:
        secured.cluster.kill(proc)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"api_keys_file": "{root}/empty.txt"}, "{root}/empty.txt holds no keys"),
        ({"api_keys_file": "{root}/absent.txt"}, "{root}/absent.txt: cannot read it"),
        ({"ssl_certfile": "{root}/cert.pem"}, "TLS needs both ssl_certfile and ssl_keyfile"),
        (
            {"ssl_certfile": "{root}/garbage.pem", "ssl_keyfile": "{root}/garbage.pem"},
            "cannot be used",
        ),
    ],
)
def test_a_bad_key_or_tls_file_exits_2_naming_it(
    tmp_path: Path, e2e_model: Path, settings: dict[str, str], message: str
) -> None:
    (tmp_path / "empty.txt").write_text("# no keys yet\n")
    (tmp_path / "cert.pem").write_text("unused\n")
    (tmp_path / "garbage.pem").write_text("not PEM\n")
    values = {name: value.format(root=tmp_path) for name, value in settings.items()}
    config = write_config(tmp_path / "bad.toml", **values)
    args = ["gateway", "--config", str(config), "--port", str(free_port())]
    args += ["--broker", "tcp://127.0.0.1:9", "--model", str(e2e_model)]
    done = subprocess.run(
        [sys.executable, "-m", "zmqllm.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, ZMQLLM_API_KEY=""),
    )
    assert done.returncode == 2, done.stderr
    assert message.format(root=tmp_path) in done.stderr
    assert "Traceback" not in done.stderr
