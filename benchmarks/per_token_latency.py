"""Per-token latency over HTTP streaming: 1, 2 and 3-stage clusters against HF and the engine.

In one run, on the default model: HF transformers `generate` (a streamer
stamps each token), zmqllm's single-process engine, and local clusters of 1, 2
and 3 stages (real broker, worker and gateway processes on 127.0.0.1), each
measured over `POST /v1/completions` with `stream: true` (one SSE event per
token). Reports time to first token, inter-token latency p50/p95/p99, tokens/s,
the bus overhead per token (cluster ITL minus the engine's) and per hop, and
the peak RSS of every process.

    python benchmarks/per_token_latency.py [--stages 1 2 3] [--new-tokens 128] [--requests 5]

Writes benchmarks/results/per_token_latency.json and .png.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from report import write_json, write_plot

from zmqllm.config import default_model_dir
from zmqllm.engine.generator import Generator
from zmqllm.models import prepare_default_model
from zmqllm.tokenizer import Tokenizer

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


def measure(once: Callable[[], list[float]], requests: int) -> dict[str, float]:
    """Run ``once`` (the start time, then each token's arrival) requests + 1 times, the
    first to warm up, and summarize the rest."""
    ttfts: list[float] = []
    itls: list[float] = []
    tokens, total = 0, 0.0
    for r in range(requests + 1):
        stamps = once()
        if r:
            ttfts.append(stamps[1] - stamps[0])
            itls += list(np.diff(stamps[1:]))
            tokens += len(stamps) - 1
            total += stamps[-1] - stamps[0]
    return {
        "ttft_ms_p50": pct(ttfts, 50) * 1e3,
        "itl_ms_p50": pct(itls, 50) * 1e3,
        "itl_ms_p95": pct(itls, 95) * 1e3,
        "itl_ms_p99": pct(itls, 99) * 1e3,
        "itl_ms_mean": statistics.fmean(itls) * 1e3 if itls else float("nan"),
        "tokens_per_s": tokens / total if total else float("nan"),
    }


def peak_rss_mb(pid: int) -> float:
    """VmHWM: the most resident memory the process ever held."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def bench_hf(model_dir: Path, ids: list[int], n: int, requests: int) -> dict[str, float]:
    from transformers import MistralForCausalLM
    from transformers.generation.streamers import BaseStreamer

    model = MistralForCausalLM.from_pretrained(model_dir).eval()

    class Stamps(BaseStreamer):
        def __init__(self) -> None:
            self.t: list[float] = []

        def put(self, value: torch.Tensor) -> None:
            self.t.append(time.perf_counter())

        def end(self) -> None:
            pass

    x = torch.tensor([ids])

    def once() -> list[float]:
        st = Stamps()
        t0 = time.perf_counter()
        model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            streamer=st,
        )
        return [t0, *st.t[1:]]  # put() is first called with the prompt itself

    return measure(once, requests)


def bench_engine(model_dir: Path, ids: list[int], n: int, requests: int) -> dict[str, float]:
    gen = Generator(model_dir)

    def once() -> list[float]:
        stamps = [time.perf_counter()]
        for _ in gen.generate(ids, n):
            stamps.append(time.perf_counter())
        return stamps

    return measure(once, requests)


def stream_once(port: int, n: int) -> list[float]:
    """Arrival time of every token event of one streamed completion (t0 first)."""
    body = json.dumps(
        {"prompt": PROMPT, "max_tokens": n, "stream": True, "ignore_eos": True, "temperature": 0}
    )
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    stamps = [t0]
    buf = b""
    while True:
        piece = resp.read1(65536)
        if not piece:
            break
        now = time.perf_counter()
        buf += piece
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            if event.startswith(b"data: {") and b'"usage"' not in event[:30]:
                data = json.loads(event[6:])
                if data.get("choices"):
                    stamps.append(now)
    conn.close()
    return stamps


def bench_cluster(
    model_dir: Path, stages: int, n: int, requests: int, threads: int, keys: Path | None = None
) -> dict[str, Any]:
    # Imported here, not at the top: compare_revisions.py loads this module's stream_once
    # into older trees, which have no testbed/ (and must keep their own zmqllm first).
    import repo_root  # noqa: F401

    from testbed.cluster import Cluster
    from zmqllm.layers import split_layers
    from zmqllm.model_args import ModelArgs

    layers = split_layers(ModelArgs.from_dir(model_dir).num_layers, stages)
    with tempfile.TemporaryDirectory() as tmp:
        c = Cluster(
            Path(tmp),
            model_dir,
            heartbeat=1.0,
            threads=threads,
            batch_threads=max(1, (os.cpu_count() or 1) // stages),
            keys=keys,
        )
        try:
            c.start_all(tuple(f"{a}:{b}" for a, b in layers))
            res: dict[str, Any] = measure(lambda: stream_once(c.http_port, n), requests)
            res["rss_mb"] = {p.name: round(peak_rss_mb(p.popen.pid), 1) for p in c.procs}
            return res
        finally:
            c.stop()


def curve_cost(model_dir: Path, a: argparse.Namespace) -> None:
    """ITL p50 of each cluster with and without CURVE, in alternating rounds."""
    import curve_hop
    from paired import alternate, compare, describe

    from zmqllm.keys import init_keys

    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        keys = init_keys(Path(tmp) / "keys")
        for k in a.stages:
            print(f"{k} stage(s), ITL p50 ms:", flush=True)

            def run(with_keys: Path | None, k: int = k) -> float:
                r = bench_cluster(model_dir, k, a.new_tokens, a.requests, a.threads, with_keys)
                return float(r["itl_ms_p50"])

            values = alternate(
                a.rounds, ("insecure", lambda: run(None)), ("curve", lambda: run(keys))
            )
            results[f"cluster_{k}_stage"] = compare(values, "insecure", "curve")
            print(describe(results[f"cluster_{k}_stage"], "insecure", "curve", "ms"), flush=True)
    # The hop itself, in microseconds: what the rounds above can only bound.
    results["hop"] = curve_hop.measure(blocks=10, n=500)
    for k in a.stages:
        print(curve_hop.describe(results["hop"], k))
    meta = {k: getattr(a, k) for k in ("threads", "new_tokens", "requests", "rounds")}
    write_json(
        Path(a.out).with_name("per_token_latency_curve.json"), {"meta": meta, "results": results}
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--requests", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/per_token_latency.json")
    ap.add_argument(
        "--curve",
        action="store_true",
        help="instead: each cluster with CURVE keys against --insecure, alternating rounds",
    )
    ap.add_argument("--rounds", type=int, default=4, help="--curve: rounds of each")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    model_dir = prepare_default_model(default_model_dir())
    tok = Tokenizer.from_dir(model_dir)
    ids = tok.encode(PROMPT)  # raw completion prompt, as /v1/completions sends it
    n = a.new_tokens
    if a.curve:
        curve_cost(model_dir, a)
        return

    rows: dict[str, dict[str, Any]] = {}
    rows["hf_generate"] = bench_hf(model_dir, ids, n, a.requests)
    rows["engine"] = bench_engine(model_dir, ids, n, a.requests)
    for k in a.stages:
        rows[f"cluster_{k}_stage"] = bench_cluster(model_dir, k, n, a.requests, a.threads)

    eng = rows["engine"]["itl_ms_p50"]
    for k in a.stages:
        r = rows[f"cluster_{k}_stage"]
        r["bus_overhead_ms_per_token"] = r["itl_ms_p50"] - eng
        r["ratio_itl_vs_engine"] = r["itl_ms_p50"] / eng
        r["ratio_itl_vs_hf"] = r["itl_ms_p50"] / rows["hf_generate"]["itl_ms_p50"]
    if 1 in a.stages:
        one = rows["cluster_1_stage"]["itl_ms_p50"]
        for k in a.stages:
            if k > 1:
                r = rows[f"cluster_{k}_stage"]
                r["overhead_ms_per_extra_hop"] = (r["itl_ms_p50"] - one) / (k - 1)

    print(
        f"\nper-token latency — {model_dir.name}, fp32, {a.threads} threads, {n} tokens, "
        f"{a.requests} requests each (p50/p95/p99 over all tokens)"
    )
    head = f"{'':16} {'TTFT ms':>8} {'ITL p50':>8} {'p95':>7} {'p99':>7} {'tok/s':>7}"
    head += f" {'vs engine':>9} {'vs HF':>6}"
    print(head)
    for name, r in rows.items():
        ve = r.get("ratio_itl_vs_engine", r["itl_ms_p50"] / eng)
        vh = r["itl_ms_p50"] / rows["hf_generate"]["itl_ms_p50"]
        print(
            f"{name:16} {r['ttft_ms_p50']:8.1f} {r['itl_ms_p50']:8.2f} {r['itl_ms_p95']:7.2f} "
            f"{r['itl_ms_p99']:7.2f} {r['tokens_per_s']:7.1f} {ve:9.2f} {vh:6.2f}"
        )
    for k in a.stages:
        r = rows[f"cluster_{k}_stage"]
        extra = (
            f", {r['overhead_ms_per_extra_hop']:.2f} ms per extra hop"
            if "overhead_ms_per_extra_hop" in r
            else ""
        )
        print(
            f"{k} stage(s): bus overhead {r['bus_overhead_ms_per_token']:.2f} ms/token{extra}; "
            f"peak RSS MB {r['rss_mb']}"
        )

    meta = {
        "model": str(model_dir),
        "threads": a.threads,
        "new_tokens": n,
        "requests": a.requests,
        "torch": torch.__version__,
    }
    out = Path(a.out)
    write_json(out, {"meta": meta, "results": rows})

    def draw(plt: Any) -> Any:
        names = list(rows)
        fig, ax = plt.subplots(figsize=(8, 4))
        x = np.arange(len(names))
        for i, q in enumerate(("itl_ms_p50", "itl_ms_p95", "itl_ms_p99")):
            ax.bar(x + (i - 1) * 0.27, [rows[m][q] for m in names], 0.27, label=q.split("_")[-1])
        ax.set_xticks(x, names, rotation=15)
        ax.set_ylabel("inter-token latency (ms)")
        ax.set_title(f"{model_dir.name}: per-token latency, {a.threads} threads")
        ax.legend()
        return fig

    write_plot(out, draw)


if __name__ == "__main__":
    main()
