"""A stream that fails after its headers went out, as clients see it on a real uvicorn.

`/chat` ends with the error line and no terminating chunk, so curl exits non-zero (18:
the transfer ended early) and a script can tell a cut answer from a whole one; a whole
answer still exits 0. An SSE stream that fails ends at its error event, without
`[DONE]`; a whole one ends with `[DONE]`.
"""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from tests.fake_broker_client import FakeBrokerClient, Script
from tests.gateway.support import (
    ANSWER,
    CHAT_ANSWER,
    MODEL,
    answer_script,
    make_app,
    serving,
    tiny_tokenizer,
)
from zmqllm.models.tokenizer import Tokenizer

httpx = pytest.importorskip("httpx")

CURL = shutil.which("curl")


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return tiny_tokenizer(tmp_path_factory.mktemp("tiny-tokenizer"))


def curl(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    assert CURL is not None
    return subprocess.run(
        [CURL, "-sN", "--max-time", "30", *args, url], capture_output=True, text=True
    )


@pytest.mark.skipif(CURL is None, reason="needs curl")
def test_curl_fails_on_a_chat_stream_cut_by_an_error(tok: Tokenizer) -> None:
    fake = FakeBrokerClient(answer_script(tok))
    fake.default_script = Script(answer_script(tok).tokens, fail_after=4)
    with serving(make_app(fake, tok)) as (url, _server):
        cut = curl(f"{url}/chat", "-d", "Hi")
        fake.default_script = answer_script(tok)
        whole = curl(f"{url}/chat", "-d", "Hi")
    assert cut.returncode == 18, (cut.returncode, cut.stderr)  # CURLE_PARTIAL_FILE
    text = tok.decode(tok.encode(ANSWER)[:4])
    assert cut.stdout == f"{text}\n[error: worker w1 stopped answering]\n"
    assert whole.returncode == 0 and whole.stdout == CHAT_ANSWER


def sse(url: str, fake: FakeBrokerClient) -> list[str]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        return [line[6:] for line in r.iter_lines() if line.startswith("data: ")]


def test_a_failed_sse_stream_ends_at_its_error_without_done(tok: Tokenizer) -> None:
    fake = FakeBrokerClient(answer_script(tok))
    fake.default_script = Script(answer_script(tok).tokens, fail_after=4)
    with serving(make_app(fake, tok)) as (url, _server):
        cut = sse(url, fake)
        fake.default_script = answer_script(tok)
        whole = sse(url, fake)
    assert "[DONE]" not in cut
    assert json.loads(cut[-1])["error"]["code"] == "worker_lost"
    assert whole[-1] == "[DONE]"
