"""A 2-stage cluster on Mistral-7B's geometry (4 of its layers, random weights): the
completion over HTTP equals transformers' greedy text token for token, and a stage
whose weights and KV budget do not fit the memory given to it refuses to start,
naming both figures."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from testbed.cluster import Cluster
from tests.e2e.expected import sent_text

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.e2e, pytest.mark.torch, pytest.mark.slow]

N = 32
PROMPT = "The history of the bus, in short:"


def _complete(c: Cluster, prompt: str) -> dict:
    body = {"prompt": prompt, "max_tokens": N, "temperature": 0, "ignore_eos": True}
    req = urllib.request.Request(
        c.url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def test_two_stages_over_http_equal_hf_greedy(random_7b_dir: Path, tmp_path: Path) -> None:
    from zmqllm.models.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(random_7b_dir)
    ids = tok.encode(PROMPT)
    hf = transformers.MistralForCausalLM.from_pretrained(random_7b_dir, dtype=torch.float32)
    x = torch.tensor([ids])
    with torch.no_grad():
        out = hf.eval().generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=N,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    want = sent_text(tok, out[0, len(ids) :].tolist())
    del hf, out
    # Each stage a few GiB of float32 weights: a KV budget sized to the test.
    c = Cluster(tmp_path / "cluster", random_7b_dir, worker_flags=("--max-kv-tokens", "2048"))
    try:
        c.start_all()
        reply = _complete(c, PROMPT)
        assert reply["choices"][0]["text"] == want
        assert reply["usage"]["completion_tokens"] == N
        workers = c.status()["workers"]
        assert sorted(w["layers"] for w in workers) == [[0, 2], [2, 4]]
    finally:
        c.stop()


def test_a_stage_that_cannot_fit_refuses_to_start(random_7b_dir: Path) -> None:
    cmd = [sys.executable, "-m", "zmqllm.cli", "worker", "--model", str(random_7b_dir)]
    cmd += ["--layers", "0:2", "--max-memory-mb", "3000", "--insecure"]
    cmd += ["--broker", "tcp://127.0.0.1:9", "--log-format", "json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    said = done.stderr.strip().splitlines()[-1]
    assert said.startswith("zmqllm worker: stage 0:2 does not fit: weights ")
    # Both figures, and what to change.
    # float32: 2 layers' matmuls (1.62 GiB) and the embedding; MKL's packed copy of the
    # matmuls; 2 layers x 8 KV heads x 128 x (k, v) x 4 bytes a token.
    assert "weights 2.38 GiB + packed copy 1.62 GiB" in said
    # max_kv_tokens 0: the budget is what is left, here nothing.
    assert "+ runtime 0.75 GiB leave room for 0 KV tokens (16384 bytes each)" in said
    assert "of the 2.93 GiB given (max_memory_mb), fewer than the 4096" in said
    assert "use --quant int4 or int8" in said
    logged = [
        json.loads(line)
        for line in (done.stdout + done.stderr).splitlines()
        if line.startswith("{")
    ]
    assert any(e.get("event") == "stage does not fit" for e in logged)
