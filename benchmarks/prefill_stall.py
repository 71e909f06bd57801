"""A long prompt entering a busy worker: what it costs the streams already decoding, and
what they cost it (chunked prefill: the worker's ``busy_prefill_chunk``).

One worker with every layer, behind a broker and the gateway; ``--load-streams`` chat
streams decode (``ignore_eos``); once each has had a few tokens, a plain prompt of
``--prompt-tokens`` tokens is sent. Per setting: its TTFT, the streams' longest gap
between two tokens while it was prefilled (from its send to its first token), and their
median gap before it was sent. Each ``busy_prefill_chunk`` value (``--chunks``; the
largest, equal to ``prefill_chunk``, is the behaviour without it) is a cluster of its
own, started afresh in alternating rounds; ``--probes`` long prompts per start.

    python benchmarks/prefill_stall.py [--chunks 2048 512 256 128] [--prompt-tokens 2000]
        [--load-streams 16] [--rounds 3] [--probes 2] [--quant int4] [--model DIR]

Writes benchmarks/results/prefill_stall.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # see benchmarks/__init__.py

import argparse
import os
import signal
from typing import Any

from benchmarks.http_client import run_all
from benchmarks.peer_servers import zmqllm_server
from benchmarks.report import cpu_name, write_json
from benchmarks.serving_peers import chat, long_prompt, long_prompt_probe, under_load
from benchmarks.stats import spread, spread_text
from benchmarks.throughput import PROMPTS

FIGURES = (
    ("ttft_ms", "prompt's TTFT ms"),
    ("stall_ms", "streams' longest gap ms"),
    ("itl_before_ms", "their median gap before ms"),
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, help="a Mistral checkpoint (default: the default)")
    ap.add_argument("--quant", choices=["none", "int8", "int4"], default="int4")
    ap.add_argument("--threads", type=int, default=0, help="worker threads (0: cores)")
    ap.add_argument("--chunks", type=int, nargs="+", default=[2048, 512, 256, 128])
    ap.add_argument("--prefill-chunk", type=int, default=2048, help="the worker's")
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--load-streams", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--probes", type=int, default=2, help="long prompts per start")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/prefill_stall.json"))
    a = ap.parse_args()
    if any(c < 1 or c > a.prefill_chunk for c in a.chunks):
        ap.error(f"--chunks: each from 1 to --prefill-chunk ({a.prefill_chunk})")
    if a.prompt_tokens < 8:
        ap.error("--prompt-tokens: at least 8")
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # finally blocks stop servers
    if a.model is None:
        from zmqllm.config.paths import default_model_dir
        from zmqllm.models.prepare import prepare_default_model

        a.model = prepare_default_model(default_model_dir())
    model_dir = a.model.resolve()
    threads = a.threads or os.cpu_count() or 1
    text = long_prompt(model_dir, a.prompt_tokens)
    cpu = cpu_name()
    print(
        f"prefill stall — {model_dir.name}, {a.quant}, {threads} threads, {cpu}: a "
        f"{a.prompt_tokens}-token prompt under {a.load_streams} decoding streams"
    )
    runs: dict[int, list[dict[str, float]]] = {c: [] for c in a.chunks}
    for rnd in range(a.rounds):
        order = a.chunks if rnd % 2 == 0 else a.chunks[::-1]
        for chunk in order:
            flags = ("--prefill-chunk", str(a.prefill_chunk), "--busy-prefill-chunk", str(chunk))
            with zmqllm_server(model_dir, a.quant, threads, worker_flags=flags) as server:
                run_all([chat(server, PROMPTS[0], 4)])  # warm-up
                for _ in range(a.probes):
                    got = under_load(
                        server, a.load_streams, long_prompt_probe(server, text()), 4096
                    )
                    runs[chunk].append(got)
                    print(
                        f"  round {rnd + 1} busy_prefill_chunk {chunk}: "
                        + ", ".join(f"{label} {got[k]:.0f}" for k, label in FIGURES),
                        flush=True,
                    )
    summary: dict[int, dict[str, Any]] = {}
    print(f"\n{'busy_prefill_chunk':>18}" + "".join(f"{label:>32}" for _, label in FIGURES))
    for chunk, got in runs.items():
        summary[chunk] = {k: spread([g[k] for g in got]) for k, _ in FIGURES}
        cells = [spread_text([g[k] for g in got], 0) for k, _ in FIGURES]
        print(f"{chunk:>18}" + "".join(t.rjust(32) for t in cells))
    meta = {
        "model": str(model_dir),
        "quant": a.quant,
        "threads": threads,
        "cpu": cpu,
        "prefill_chunk": a.prefill_chunk,
        "prompt_tokens": a.prompt_tokens,
        "load_streams": a.load_streams,
        "rounds": a.rounds,
        "probes": a.probes,
    }
    write_json(a.out, {"meta": meta, "summary": summary, "runs": runs})


if __name__ == "__main__":
    main()
