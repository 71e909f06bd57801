"""Time to first token of a chat's third turn, with and without prefix caching.

In one run, on the default model and a 2-stage local cluster (real broker, workers and
gateway): a chat with a long system prompt (~1,500 tokens) runs three turns on a cluster
whose workers keep prompt prefixes; the third turn is streamed and its time to first
token taken. Then a second cluster, started with ``--no-prefix-cache``, is sent the very
same third-turn request (the same messages, replies included): that is the request sent
cold. Each round uses a system prompt of its own, so nothing is shared between rounds:
the third turn can reuse only what the second turn's prompt computed. Prints both TTFTs,
their ratio per round (median and range) and whether the greedy replies are identical.

    python benchmarks/prefix_cache.py [--rounds 3] [--system-tokens 1500] [--threads 2]

Writes benchmarks/results/prefix_cache.json and .png.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # see benchmarks/__init__.py

import argparse
import os
import tempfile
import time
from typing import Any

from benchmarks.http_client import RequestInput, run
from benchmarks.report import write_json, write_plot
from benchmarks.stats import median
from testbed.cluster import Cluster
from zmqllm.config.paths import default_model_dir
from zmqllm.models.model_args import ModelArgs
from zmqllm.models.prepare import prepare_default_model
from zmqllm.models.tokenizer import Tokenizer

QUESTIONS = [
    "Which rule matters most when a customer is angry?",
    "Give an example answer that follows it.",
    "Now shorten that answer to one sentence.",
]
TOPICS = ["billing", "shipping", "returns", "accounts", "privacy", "warranty", "orders"]


def system_prompt(tok: Tokenizer, round_no: int, tokens: int) -> str:
    """Numbered support-desk rules, cut to about ``tokens`` tokens; the round's number
    first, so no two rounds share a prefix block."""
    lines = [f"Support desk handbook, edition {round_no}."]
    i = 0
    while len(tok.encode("\n".join(lines))) < tokens:
        topic = TOPICS[i % len(TOPICS)]
        lines.append(
            f"Rule {i + 1}: on {topic} questions, greet the customer, restate the problem "
            f"in one line, give the {topic} policy that applies, and offer one next step."
        )
        i += 1
    return "\n".join(lines)


def chat(port: int, messages: list[dict[str, str]], max_tokens: int) -> tuple[float, str]:
    """Stream one greedy chat completion: (seconds to the first content, the reply)."""
    out = run(
        RequestInput(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            messages=messages,
            max_tokens=max_tokens,
            temperature=0,
        )
    )
    return (out.ttft if out.stamps else 0.0), out.text


def cluster(root: Path, model: Path, threads: int, flags: tuple[str, ...]) -> Cluster:
    layers = ModelArgs.from_dir(model).stage_ranges(2)
    c = Cluster(root, model, heartbeat=1.0, threads=threads, worker_flags=flags)
    c.start_all(tuple(f"{a}:{b}" for a, b in layers))
    return c


def hit_tokens(c: Cluster) -> int:
    return sum(
        int(w["stats"].get("prefix_hit_tokens", 0))
        for w in c.status()["workers"]
        if w["layers"][0] == 0
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--rounds", type=int, default=3, help="conversations measured")
    ap.add_argument("--system-tokens", type=int, default=1500, help="system prompt length")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens per reply")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="per worker")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args()

    model = default_model_dir()
    prepare_default_model(model)
    tok = Tokenizer.from_dir(model)
    # Round 0 warms each cluster up (first forwards, allocator) and is not counted.
    systems = [system_prompt(tok, r, args.system_tokens) for r in range(args.rounds + 1)]
    warm: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        c = cluster(Path(tmp) / "cached", model, args.threads, ())
        try:
            for r, system in enumerate(systems):
                messages = [{"role": "system", "content": system}]
                for q in QUESTIONS[:2]:
                    messages.append({"role": "user", "content": q})
                    _, reply = chat(c.http_port, messages, args.max_tokens)
                    messages.append({"role": "assistant", "content": reply})
                messages.append({"role": "user", "content": QUESTIONS[2]})
                before = hit_tokens(c)
                ttft, reply = chat(c.http_port, messages, args.max_tokens)
                time.sleep(1.5)  # the workers' counters travel in their heartbeats
                warm.append(
                    {
                        "round": r,
                        "messages": messages,
                        "prompt_tokens": len(tok.encode_chat(messages)),
                        "ttft_s": ttft,
                        "reply": reply,
                        "hit_tokens": hit_tokens(c) - before,
                    }
                )
                print(f"cached  round {r}: TTFT {ttft * 1e3:7.1f} ms", flush=True)
        finally:
            c.stop()
        c = cluster(Path(tmp) / "cold", model, args.threads, ("--no-prefix-cache",))
        try:
            for w in warm:
                ttft, reply = chat(c.http_port, w["messages"], args.max_tokens)
                w["cold_ttft_s"], w["identical"] = ttft, reply == w["reply"]
                print(f"cold    round {w['round']}: TTFT {ttft * 1e3:7.1f} ms", flush=True)
        finally:
            c.stop()

    rows = warm[1:]
    ratios = [w["ttft_s"] / w["cold_ttft_s"] for w in rows]
    summary = {
        "model": model.name,
        "threads": args.threads,
        "system_tokens": args.system_tokens,
        "third_turn_prompt_tokens": [w["prompt_tokens"] for w in rows],
        "reused_tokens": [w["hit_tokens"] for w in rows],
        "ttft_ms_cached": [round(w["ttft_s"] * 1e3, 1) for w in rows],
        "ttft_ms_cold": [round(w["cold_ttft_s"] * 1e3, 1) for w in rows],
        "ratio_median": median(ratios),
        "ratio_range": [min(ratios), max(ratios)],
        "identical_replies": all(w["identical"] for w in rows),
    }
    print()
    print(
        f"third turn: {summary['third_turn_prompt_tokens']} prompt tokens, "
        f"{summary['reused_tokens']} taken from the prefix cache"
    )
    print(f"TTFT cached  ms: {summary['ttft_ms_cached']}")
    print(f"TTFT cold    ms: {summary['ttft_ms_cold']}")
    print(
        f"cached / cold: {summary['ratio_median']:.3f} "
        f"({summary['ratio_range'][0]:.3f}-{summary['ratio_range'][1]:.3f})  "
        f"replies identical: {summary['identical_replies']}"
    )  # fmt: skip
    out = args.out / "prefix_cache.json"
    write_json(out, summary)

    def draw(plt: Any) -> Any:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        xs = range(len(rows))
        ax.bar([x - 0.2 for x in xs], summary["ttft_ms_cold"], 0.4, label="cold")
        ax.bar([x + 0.2 for x in xs], summary["ttft_ms_cached"], 0.4, label="prefix cached")
        ax.set_xticks(list(xs), [f"round {w['round']}" for w in rows])
        ax.set_ylabel("third-turn TTFT (ms)")
        ax.set_title(f"{model.name}, 2 stages, ~{args.system_tokens}-token system prompt")
        ax.legend()
        return fig

    write_plot(out, draw)


if __name__ == "__main__":
    main()
