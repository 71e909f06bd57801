"""A burst past the gateway's limits: queued and served, or 429 only past the queue bound.

Real broker, worker and gateway processes on 127.0.0.1; every answer must equal HF greedy
generate on the same weights. The 200-stream burst runs the default model as `zmqllm up`
starts it (configs/local.toml: two workers for layers 0:15 and 15:30 sharing the cores
through the launcher's cpu_lock, every setting at its default); the small queue bound
runs the tiny model.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from testbed.cluster import Cluster
from tests.e2e.expected import sent_text
from tests.e2e.test_cluster import open_long_stream

pytestmark = [pytest.mark.e2e, pytest.mark.torch]

STREAMS = 200  # over three times the default max_concurrent (64)
MAX_TOKENS = 12
PROMPTS = [
    "Hello there!",
    "What is the capital of France?",
    "List three colours.",
    "Count to five.",
    "Why is the sky blue?",
]
# Generous: a queued request waits for the ones ahead of it on a shared 2-core machine.
HTTP_TIMEOUT = 120.0
# The default model's burst: short answers keep 200 streams within a few minutes on two
# cores (4 rounds of 64 prefills and DEFAULT_MAX_TOKENS batched decode steps), which other
# test runs may share: a request at the back of the queue waits for all the rounds ahead.
DEFAULT_MAX_TOKENS = 8
BURST_TIMEOUT = 300.0
REPO = Path(__file__).resolve().parents[2]


def chat(
    c: Cluster, prompt: str, max_tokens: int = MAX_TOKENS, timeout: float = HTTP_TIMEOUT
) -> tuple[int, str, dict[str, str]]:
    """POST /chat; (status, whole body, headers with lower-case names)."""
    conn = http.client.HTTPConnection("127.0.0.1", c.http_port, timeout=timeout)
    try:
        conn.request("POST", f"/chat?max_tokens={max_tokens}", body=prompt.encode())
        resp = conn.getresponse()
        body = resp.read().decode()
        return resp.status, body, {k.lower(): v for k, v in resp.getheaders()}
    finally:
        conn.close()


def gauge(c: Cluster, name: str) -> float:
    _, text = c.get("/metrics")
    for line in text.decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


@dataclass
class UpCluster(Cluster):
    """The processes `zmqllm up` starts for configs/local.toml, with the command lines
    the launcher plans (its cpu_lock included), on free ports; every other setting is
    the file's or the default."""

    def start_up(self) -> None:
        """Start every process; `wait_ready` waits for them (the default model's workers
        take a while to load: the caller may do something else meanwhile)."""
        from zmqllm.config.loading import load_config
        from zmqllm.launch.plan import plan

        text = (REPO / "configs" / "local.toml").read_text()
        for old, new in (
            ("127.0.0.1:5555", self.frontend.removeprefix("tcp://")),
            ("127.0.0.1:5556", self.backend.removeprefix("tcp://")),
            ("port = 8080", f"port = {self.http_port}"),
        ):
            assert old in text, old
            text = text.replace(old, new)
        path = self.root / "local.toml"
        path.write_text(text)
        cfg = load_config(path)
        assert cfg.model.path == "default" and [s.layers for s in cfg.stages] == ["1/2", "2/2"]
        for child in plan(cfg, path):
            assert child.argv[1:3] == ("-m", "zmqllm.cli"), child.argv
            self._start(child.name, list(child.argv[3:]))


def default_reference(default_model_dir: Path, max_tokens: int) -> dict[str, str]:
    """HF MistralForCausalLM greedy /chat text of each prompt on the default model,
    stopping at EOS (the gateway applies the chat template the same way)."""
    import torch
    from transformers import MistralForCausalLM

    from zmqllm.models.tokenizer import Tokenizer

    model = MistralForCausalLM.from_pretrained(default_model_dir).eval()
    tok = Tokenizer.from_dir(default_model_dir)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 2 cores shared with other runs: no waits on descheduled threads
    try:
        out = {}
        for prompt in PROMPTS:
            ids = tok.encode_chat([{"role": "user", "content": prompt}])
            x = torch.tensor([ids])
            with torch.no_grad():
                new = model.generate(
                    x,
                    attention_mask=torch.ones_like(x),
                    max_new_tokens=max_tokens,
                    do_sample=False,
                    eos_token_id=sorted(tok.eos_token_ids),
                    pad_token_id=0,
                )[0, len(ids) :].tolist()
            out[prompt] = sent_text(tok, new)
    finally:
        torch.set_num_threads(threads)
    del model
    return out


@pytest.mark.slow
def test_a_burst_of_200_streams_on_the_default_model_is_queued_not_refused(
    tmp_path: Path, default_model_dir: Path
) -> None:
    """`zmqllm up` with configs/local.toml and default settings: 200 concurrent /chat
    streams, 64 at a time, the rest queued in the gateway; every one gets 200 and its own
    exact greedy answer, none a 429; nothing is left in the cluster afterwards."""
    c = UpCluster(tmp_path / "cluster", default_model_dir)
    try:
        c.start_up()
        # While the workers load their shards.
        expected = default_reference(default_model_dir, DEFAULT_MAX_TOKENS)
        assert len(set(expected.values())) == len(PROMPTS)  # answers tell prompts apart
        c.wait_ready(timeout=180)
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(STREAMS)]
        most_queued = 0.0
        done = threading.Event()

        def watch_queue() -> None:
            nonlocal most_queued
            while not done.is_set():
                most_queued = max(most_queued, gauge(c, "zmqllm_requests_queued"))
                time.sleep(0.5)  # the queue stays long for a while: no need to hurry

        watcher = threading.Thread(target=watch_queue, daemon=True)
        watcher.start()
        started = time.monotonic()
        try:
            with ThreadPoolExecutor(STREAMS) as pool:
                results = list(
                    pool.map(lambda p: chat(c, p, DEFAULT_MAX_TOKENS, BURST_TIMEOUT), prompts)
                )
        finally:
            done.set()
            watcher.join(timeout=10)
        took = time.monotonic() - started
        statuses = [status for status, _, _ in results]
        assert statuses == [200] * STREAMS, {s: statuses.count(s) for s in set(statuses)}
        wrong = [
            (i, prompt, text)
            for i, (prompt, (_, text, _)) in enumerate(zip(prompts, results, strict=True))
            if text != expected[prompt] + "\n"  # /chat ends the answer with a newline
        ]
        assert not wrong, (len(wrong), wrong[:5], expected)
        assert most_queued > 0  # the burst really went past max_concurrent
        print(f"\n{STREAMS} streams in {took:.1f}s, up to {most_queued:g} queued")  # with -s
        # Nothing left: not in the gateway, not in the broker, not on a worker.
        assert gauge(c, "zmqllm_requests_queued") == 0
        assert gauge(c, "zmqllm_requests_in_flight") == 0

        def drained() -> bool:
            s = c.status()
            return (
                s["sessions"] == 0
                and s["queue"] == 0
                and all(w["sessions"] == 0 and w["kv_tokens_reserved"] == 0 for w in s["workers"])
            )

        c.wait_for(drained, timeout=5, what="no sessions, queue or KV reservations left")
        # The processes are the ones started: nothing died along the way.
        assert all(p.alive() for p in c.procs), [p.name for p in c.procs if not p.alive()]
    finally:
        c.stop()


def test_past_a_small_queue_bound_429_then_normal_service(
    tmp_path: Path, e2e_model: Path, reference
) -> None:
    c = Cluster(tmp_path / "cluster", e2e_model)
    try:
        c.start_broker()
        c.start_worker("0:2")
        c.start_worker("2:4")
        c.start_gateway("--max-concurrent", "2", "--max-queued", "3")
        c.wait_ready()
        long_streams = []
        for _ in range(2):  # two long streams hold both slots
            conn, resp = open_long_stream(c, timeout=HTTP_TIMEOUT, model=None)
            assert resp.status == 200
            resp.read1(64)
            long_streams.append(conn)
        # Three requests fill the queue ...
        with ThreadPoolExecutor(3) as waiting:
            queued = [waiting.submit(chat, c, prompt) for prompt in PROMPTS[:3]]
            c.wait_for(lambda: gauge(c, "zmqllm_requests_queued") == 3, what="3 queued")
            # ... and every request past them gets 429 with Retry-After, nothing else.
            with ThreadPoolExecutor(10) as burst:
                refused = list(burst.map(lambda p: chat(c, p), PROMPTS * 2))
            for status, body, headers in refused:
                assert status == 429, (status, body)
                assert headers["retry-after"] == "1"
                error = json.loads(body)["error"]
                assert error["code"] == "too_many_requests"
                assert error["type"] == "rate_limit_error"
            assert gauge(c, "zmqllm_requests_queued") == 3
            # The long streams' clients leave: their sessions are cancelled, the queued
            # requests get the slots and their exact answers.
            for conn in long_streams:
                conn.close()
            for prompt, future in zip(PROMPTS[:3], queued, strict=True):
                status, text, _ = future.result(timeout=HTTP_TIMEOUT)
                assert status == 200 and text == reference.body(prompt, MAX_TOKENS), prompt
        # Afterwards the cluster serves normally.
        status, text, _ = chat(c, "Hello there!", 16)
        assert status == 200 and text == reference.body("Hello there!", 16)
    finally:
        c.stop()
