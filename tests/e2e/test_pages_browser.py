"""The chat page and the cluster page in a real browser: Debian's chromium driven by
Playwright for Python, against a real tiny cluster (broker, workers 0:2 and 2:4, gateway).

Outside CI a machine without playwright or /usr/bin/chromium skips these; under CI
(CI=true, where .ci/run installs chromium) a browser that cannot start fails them.
Screenshots go to $ZMQLLM_SCREENSHOTS, else to the test's temporary folder.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from testbed.cluster import Cluster

pytestmark = pytest.mark.torch

# The pages are tried on the tiny model: only where torch is (the torch environment).
pytest.importorskip("torch")

CHROMIUM = Path("/usr/bin/chromium")
IN_CI = os.environ.get("CI") == "true"
if not IN_CI:
    pytest.importorskip("playwright.sync_api")
    if not CHROMIUM.exists():
        pytest.skip("no /usr/bin/chromium (apt-get install chromium)", allow_module_level=True)

from playwright.sync_api import Browser, Page, expect, sync_playwright  # noqa: E402

PROMPT = "Tell me about the sea."
# Greedy on the tiny model, these run to max tokens without an EOS (checked below).
LONG_PROMPT = "Write a very long story."
LONG_TOKENS = 900  # of the tiny model's 1024-token context
UI_TIMEOUT_MS = 30_000


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM))
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1200, "height": 900})
    context.set_default_timeout(UI_TIMEOUT_MS)
    p = context.new_page()
    errors: list[str] = []
    p.on("pageerror", lambda exc: errors.append(str(exc)))
    try:
        yield p
    finally:
        context.close()
    assert not errors, errors  # no script error on the page


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = Path(os.environ.get("ZMQLLM_SCREENSHOTS") or tmp_path_factory.mktemp("screenshots"))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def record_growth(page: Page) -> None:
    """Note the length of the newest reply at every change of the conversation."""
    page.evaluate(
        """() => {
          window.replyLengths = [];
          new MutationObserver(() => {
            const replies = document.querySelectorAll("li.message.assistant .text");
            const newest = replies[replies.length - 1];
            if (newest) window.replyLengths.push(newest.textContent.length);
          }).observe(document.getElementById("messages"),
                     {childList: true, subtree: true, characterData: true});
        }"""
    )


def send(page: Page, text: str) -> Any:
    page.get_by_role("textbox", name="Message").fill(text)
    page.get_by_role("button", name="Send").click()
    return page.locator("li.message.assistant").last


def wait_done(reply: Any) -> str:
    expect(reply.locator(".meta")).not_to_be_empty()
    expect(reply).not_to_have_attribute("aria-busy", "true")
    return str(reply.locator(".meta").text_content())


def test_a_reply_grows_while_it_streams_and_the_chat_goes_on(
    cluster: Cluster, page: Page, reference: Any, shots: Path
) -> None:
    page.goto(cluster.url + "/")
    expect(page.locator("#model")).to_have_text("tiny")
    page.get_by_label("Max tokens").fill("120")
    record_growth(page)
    reply = send(page, PROMPT)
    meta = wait_done(reply)
    page.screenshot(path=str(shots / "chat.png"), full_page=True)
    assert reply.locator(".text").text_content() == reference(PROMPT, 120)
    lengths = page.evaluate("window.replyLengths")
    growth = sorted(set(lengths))
    assert len(growth) >= 10, lengths  # drawn piece by piece, not at the end
    assert lengths == sorted(lengths)
    assert "time to first token" in meta and "tokens/s" in meta, meta
    # The second turn sends the whole conversation: its reply is the model's greedy one
    # for these three messages.
    first = str(reply.locator(".text").text_content())
    second = send(page, "And then?")
    wait_done(second)
    conversation = [
        {"role": "user", "content": PROMPT},
        {"role": "assistant", "content": first},
        {"role": "user", "content": "And then?"},
    ]
    assert second.locator(".text").text_content() == reference.turns(conversation, 120)
    page.screenshot(path=str(shots / "chat-two-turns.png"), full_page=True)


def test_stop_ends_the_reply_and_the_session(
    cluster: Cluster, page: Page, reference: Any, shots: Path
) -> None:
    whole = reference(LONG_PROMPT, LONG_TOKENS)
    tok = reference.tokenizer
    assert len(tok.encode(whole)) > LONG_TOKENS // 2  # no early EOS: the reply is long
    page.goto(cluster.url + "/")
    page.get_by_label("Max tokens").fill(str(LONG_TOKENS))
    reply = send(page, LONG_PROMPT)
    expect(reply.locator(".text")).not_to_be_empty()
    assert cluster.status()["sessions"] == 1  # the reply is being made
    page.get_by_role("button", name="Stop").click()
    stopped_at = time.monotonic()
    meta = wait_done(reply)
    assert meta.startswith("stopped"), meta
    cluster.wait_for(lambda: cluster.status()["sessions"] == 0, timeout=10, what="session gone")
    took = time.monotonic() - stopped_at
    shown = str(reply.locator(".text").text_content())
    assert whole.startswith(shown) and len(shown) < len(whole)  # cut, as far as it came
    page.screenshot(path=str(shots / "chat-stopped.png"), full_page=True)
    print(f"session gone {took:.2f}s after Stop")  # with -s
    # Stop left the page ready for the next message.
    expect(page.get_by_role("button", name="Send")).to_be_enabled()
    expect(page.get_by_role("button", name="Stop")).to_be_disabled()


def test_the_cluster_page_shows_each_worker_and_its_range(
    cluster: Cluster, page: Page, shots: Path
) -> None:
    workers = cluster.status()["workers"]
    done = threading.Event()
    # Streams run meanwhile, so the rates have something to show.
    busy = threading.Thread(target=keep_generating, args=(cluster, done), daemon=True)
    busy.start()
    try:
        page.goto(cluster.url + "/cluster")
        expect(page.locator(".worker")).to_have_count(len(workers))
        expect(page.locator(".worker .range")).to_have_text(["0:2", "2:4"])
        for w in workers:
            card = page.get_by_role("article", name=f"worker {w['id']}")
            expect(card).to_contain_text(f"{w['layers'][0]}:{w['layers'][1]}")
            expect(card).to_contain_text(w["info"]["host"])
            expect(card).to_contain_text("MiB")
        expect(page.get_by_role("region", name="layers 0:2")).to_be_visible()
        expect(page.locator("#routes li")).to_have_text(["0:2 → 2:4"])
        # Rates need two snapshots a second apart.
        tokens_per_s = page.locator('#summary dd[data-figure="tokens-per-s"]')
        expect(tokens_per_s).to_have_text(re.compile(r"^\d+\.\d$"))
        # Each host's workers together (all on this machine here), and each worker's CPU.
        hosts = {w["info"]["host"] for w in workers}
        for host in hosts:
            expect(page.get_by_role("listitem", name=f"host {host}")).to_contain_text(
                f"{len(workers)} workers, RSS "
            )
        # The prefix cache's figures are not the clients' to see (prefix_stats is off), nor
        # the busy time a hit shortens.
        expect(page.locator('.worker dd[data-figure="prefix"]')).to_have_count(0)
        expect(page.locator('.worker dd[data-figure="busy"]')).to_have_count(0)
        page.screenshot(path=str(shots / "cluster.png"), full_page=True)
    finally:
        done.set()
        busy.join(timeout=30)


def keep_generating(cluster: Cluster, done: threading.Event) -> None:
    body = json.dumps({"prompt": PROMPT, "max_tokens": 200, "ignore_eos": True})
    while not done.is_set():
        conn = http.client.HTTPConnection("127.0.0.1", cluster.http_port, timeout=60)
        try:
            conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            conn.getresponse().read()
        finally:
            conn.close()


def test_with_api_keys_the_page_asks_for_the_key_and_then_chats(
    page: Page, tmp_path: Path, shots: Path
) -> None:
    """A gateway with API keys (on a fake broker: the key is what is tested here)."""
    from tests.fake_broker_client import FakeBrokerClient
    from tests.gateway.support import ANSWER, answer_script, running_server, tiny_tokenizer
    from zmqllm.config.settings import GatewaySettings
    from zmqllm.gateway.api_keys import ApiKeys
    from zmqllm.gateway.app import create_app

    key = "sk-browser-5e2b"
    tok = tiny_tokenizer(tmp_path / "tok")
    fake = FakeBrokerClient(answer_script(tok))
    app = create_app(fake, GatewaySettings(), tok, "tiny-test", 2048, api_keys=ApiKeys([key]))
    with running_server(app) as url:
        page.goto(url + "/")
        key_box = page.get_by_label("API key")
        expect(key_box).to_be_hidden()
        reply = send(page, "Hi")
        expect(reply).to_have_class(re.compile("failed"))
        expect(reply.locator(".meta")).to_contain_text("API key")
        expect(key_box).to_be_visible()
        key_box.fill(key)
        key_box.press("Enter")
        reply = send(page, "Hi")
        wait_done(reply)
        expect(reply.locator(".text")).to_have_text(ANSWER)
        expect(page.locator("#model")).to_have_text("tiny-test")
        page.screenshot(path=str(shots / "chat-api-key.png"), full_page=True)


def test_the_cluster_page_shows_each_model_apart(
    tmp_path: Path, e2e_model: Path, page: Page, shots: Path
) -> None:
    """A pipeline model and a remote one on one broker: each model's stages under its
    name, and each model's routes."""
    from testbed.fake_upstream import FakeUpstream

    with FakeUpstream() as up:
        c = Cluster(tmp_path / "mixed", e2e_model)
        try:
            c.start_all(("0:2", "2:4"), up.url)
            page.goto(c.url + "/cluster")
            expect(page.locator(".worker")).to_have_count(3)
            for title in ("tiny · layers 0:2", "tiny · layers 2:4", f"{up.model_id} · remote"):
                expect(page.get_by_role("region", name=title)).to_be_visible()
            expect(page.locator("#routes li")).to_have_text(
                [f"{up.model_id}: remote", "tiny: 0:2 → 2:4"]
            )
            page.screenshot(path=str(shots / "cluster-two-models.png"), full_page=True)
        finally:
            c.stop()
