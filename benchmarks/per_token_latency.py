"""Per-token latency over HTTP streaming: 1, 2 and 3-stage clusters against HF and the engine.

In one run, on the default model: HF transformers `generate` (a streamer
stamps each token), zmqllm's single-process engine, and local clusters of 1, 2
and 3 stages (real broker, worker and gateway processes on 127.0.0.1), each
measured over `POST /v1/completions` with `stream: true` (one SSE event per
token). Reports time to first token, inter-token latency p50/p95/p99, tokens/s,
the bus overhead per token (cluster ITL minus the engine's) and per hop, and
the peak RSS of every process.

    python benchmarks/per_token_latency.py [--stages 1 2 3] [--new-tokens 128] [--requests 5]

Writes benchmarks/results/per_token_latency.json and .png. With ``--link-delay-ms 0 5
20 [--link-rate 100mbit]`` (root) it measures instead the 2-stage cluster across three
network namespaces, broker and gateway on one host and a stage on each other: ITL
against the workers' added one-way link delay, beside compute + 4 crossings x delay
(per_token_latency_links.json and .png).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # see benchmarks/__init__.py

import argparse
import contextlib
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from benchmarks import http_client
from benchmarks.http_client import RequestInput, RequestOutput, netns_socket
from benchmarks.links import CROSSINGS, across_hosts
from benchmarks.process_cpu import Usage, measured
from benchmarks.report import write_json, write_plot
from benchmarks.stats import median, ms, pct, spread, tokens_per_s
from testbed.cluster import Cluster
from zmqllm.config.paths import default_model_dir
from zmqllm.engine.generator import Generator
from zmqllm.models.model_args import ModelArgs
from zmqllm.models.prepare import prepare_default_model
from zmqllm.models.tokenizer import Tokenizer

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def measure(once: Callable[[], RequestOutput], requests: int) -> dict[str, float]:
    """Run ``once`` requests + 1 times, the first to warm up, and summarize the rest."""
    outs = [once() for _ in range(requests + 1)][1:]
    itls = [gap for o in outs for gap in o.itl]
    return {
        "ttft_ms_p50": ms(pct([o.ttft for o in outs], 50)),
        "itl_ms_p50": ms(pct(itls, 50)),
        "itl_ms_p95": ms(pct(itls, 95)),
        "itl_ms_p99": ms(pct(itls, 99)),
        "itl_ms_mean": ms(statistics.fmean(itls)) if itls else float("nan"),
        "tokens_per_s": tokens_per_s(
            sum(o.generated_tokens for o in outs), sum(o.latency for o in outs)
        ),
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

    def once() -> RequestOutput:
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
        # put() is first called with the prompt itself
        return RequestOutput(ok=True, start=t0, stamps=st.t[1:])

    return measure(once, requests)


def engine_stamps(gen: Generator, ids: list[int], n: int) -> RequestOutput:
    """One greedy generation in this process, timed as a request."""
    out = RequestOutput(ok=True, start=time.perf_counter())
    for _ in gen.generate(ids, n):
        out.stamps.append(time.perf_counter())
    return out


def completion(n: int, url: str, connect: Callable[[], Any] | None = None) -> RequestInput:
    """The request every cluster row streams: ``n`` greedy tokens of PROMPT."""
    return RequestInput(
        url,
        prompt=PROMPT,
        max_tokens=n,
        ignore_eos=True,
        temperature=0,
        timeout=300,
        connect=connect,
    )


def stream_once(port: int, n: int) -> RequestOutput:
    return http_client.run(completion(n, f"http://127.0.0.1:{port}/v1/completions"))


@contextlib.contextmanager
def running_cluster(
    model_dir: Path,
    stages: int,
    threads: int,
    keys: Path | None = None,
    quant: str = "none",
    cpu_lock: bool = False,
) -> Iterator[Any]:
    """A local cluster of ``stages`` workers, ready, stopped on the way out."""
    layers = ModelArgs.from_dir(model_dir).stage_ranges(stages)
    with tempfile.TemporaryDirectory() as tmp:
        c = Cluster(
            Path(tmp),
            model_dir,
            heartbeat=1.0,
            threads=threads,
            # Taking turns, every forward has all threads; else a share of the cores each.
            batch_threads=threads if cpu_lock else max(1, (os.cpu_count() or 1) // stages),
            cpu_lock=cpu_lock,
            keys=keys,
            quant=quant,
        )
        try:
            c.start_all(tuple(f"{a}:{b}" for a, b in layers))
            yield c
        finally:
            c.stop()


def bench_cluster(
    model_dir: Path,
    stages: int,
    n: int,
    requests: int,
    threads: int,
    keys: Path | None = None,
    quant: str = "none",
) -> dict[str, Any]:
    with running_cluster(model_dir, stages, threads, keys, quant) as c:
        res: dict[str, Any] = measure(lambda: stream_once(c.http_port, n), requests)
        res["rss_mb"] = {p.name: round(peak_rss_mb(p.popen.pid), 1) for p in c.procs}
        return res


def curve_cost(model_dir: Path, a: argparse.Namespace) -> None:
    """ITL p50 of each cluster with and without CURVE, in alternating rounds."""
    from benchmarks import curve_hop
    from benchmarks.paired import alternate, compare, describe
    from zmqllm.bus.keys import init_keys

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


def link_sweep(model_dir: Path, a: argparse.Namespace) -> None:
    """The 2-stage cluster across three hosts: ITL at each added one-way delay, in
    alternating rounds, beside compute + CROSSINGS x delay."""

    (a0, b0), (a1, b1) = ModelArgs.from_dir(model_dir).stage_ranges(2)
    delays = sorted(a.link_delay_ms)
    itl: dict[float, list[float]] = {d: [] for d in delays}
    ttft: dict[float, list[float]] = {d: [] for d in delays}
    flags = ("--quant", a.quant) if a.quant != "none" else ()
    hosts = across_hosts(
        model_dir,
        (f"{a0}:{b0}", f"{a1}:{b1}"),
        rate=a.link_rate,
        threads=a.threads,
        worker_flags=flags,
    )
    # The engine in this process (the root host), measured each round beside the hosts.
    gen = Generator(model_dir, quant=a.quant)
    ids = Tokenizer.from_dir(model_dir).encode(PROMPT)
    engine: list[float] = []
    with hosts as c:
        body = completion(
            a.new_tokens, "http://127.0.0.1/v1/completions", lambda: netns_socket(c.http(300))
        )

        def once() -> RequestOutput:
            return http_client.run(body)

        for r in range(a.rounds):
            for d in delays if r % 2 == 0 else delays[::-1]:
                c.set_delay(d)
                got = measure(once, a.requests)
                itl[d].append(got["itl_ms_p50"])
                ttft[d].append(got["ttft_ms_p50"])
            engine.append(
                measure(lambda: engine_stamps(gen, ids, a.new_tokens), a.requests)["itl_ms_p50"]
            )
            print(
                f"  round {r + 1}: engine {engine[-1]:.2f}, "
                + ", ".join(f"{d:g} ms {itl[d][-1]:.2f}" for d in delays)
            )
    base = median(itl[delays[0]])  # compute + the path's own cost, at the least delay
    rows = []
    for d in delays:
        mid = median(itl[d])
        extra = d - delays[0]
        rows.append(
            {
                "delay_ms": d,
                "itl_ms_p50": spread(itl[d]),
                "ttft_ms_p50": spread(ttft[d]),
                "model_ms": base + CROSSINGS * extra,
                "crossings": (mid - base) / extra if extra else None,
                # Against the engine in the same rounds: ITL / (engine + crossings x delay).
                "vs_engine_plus_links": spread(
                    [q / (e + CROSSINGS * d) for q, e in zip(itl[d], engine, strict=True)]
                ),
            }
        )
    # Crossings per token from every round: the least-squares slope of ITL on delay.
    xs = [d for d in delays for _ in itl[d]]
    ys = [v for d in delays for v in itl[d]]
    slope = float(np.polyfit(xs, ys, 1)[0]) if len(delays) > 1 else float("nan")
    print(
        f"\n2 stages across hosts, {model_dir.name}, link rate {a.link_rate or 'unlimited'}, "
        f"{a.new_tokens} tokens x {a.requests} requests x {a.rounds} rounds (median, range)"
    )
    print(f"{'delay ms':>9} {'ITL p50 ms':>22} {'model ms':>9} {'crossings':>9} {'TTFT ms':>8}")
    for row in rows:
        q, t = row["itl_ms_p50"], row["ttft_ms_p50"]
        crossings = f"{row['crossings']:.2f}" if row["crossings"] is not None else "-"
        print(
            f"{row['delay_ms']:9g} {q['median']:8.2f} ({q['min']:.2f}-{q['max']:.2f})"
            f" {row['model_ms']:9.2f} {crossings:>9} {t['median']:8.1f}"
        )
    print(f"model: ITL at {delays[0]:g} ms + {CROSSINGS} crossings x added delay; fit: {slope:.2f}")
    e = spread(engine)
    print(
        f"engine ITL p50 {e['median']:.2f} ({e['min']:.2f}-{e['max']:.2f}) ms; ITL over engine + "
        f"{CROSSINGS} x delay: "
        + ", ".join(f"{r['delay_ms']:g} ms {r['vs_engine_plus_links']['median']:.3f}" for r in rows)
    )
    out = Path(a.out).with_name(Path(a.out).stem + "_links.json")
    meta = {k: getattr(a, k) for k in ("threads", "new_tokens", "requests", "rounds")}
    meta.update(
        model=model_dir.name, quant=a.quant, link_rate=a.link_rate, crossings_model=CROSSINGS
    )
    payload = {"meta": meta, "rows": rows, "crossings_fit": slope, "itl_ms_p50": itl}
    write_json(out, {**payload, "engine_itl_ms_p50": e})

    def draw(plt: Any) -> Any:
        fig, ax = plt.subplots(figsize=(6, 4))
        for d in delays:
            ax.scatter([d] * len(itl[d]), itl[d], color="tab:blue", s=12)
        ax.plot(delays, [median(itl[d]) for d in delays], "o-", label="measured")
        ax.plot(delays, [r["model_ms"] for r in rows], "--", label=f"{CROSSINGS} x delay model")
        ax.set_xlabel("added one-way delay per link (ms)")
        ax.set_ylabel("inter-token latency p50 (ms)")
        ax.set_title(f"{model_dir.name}: 2 stages across hosts")
        ax.legend()
        return fig

    write_plot(out, draw)


def median_row(runs: list[dict[str, float]]) -> dict[str, Any]:
    return {k: median(r[k] for r in runs) for k in runs[0]}


def per_token_rows(model_dir: Path, ids: list[int], a: argparse.Namespace) -> dict[str, Any]:
    """HF, the engine, and each cluster alternating with the engine round by round: the
    cluster's ITL over the engine's is taken per round, so the drift of a shared
    machine's cores between runs cancels."""
    from benchmarks.paired import alternate

    n = a.new_tokens
    rows: dict[str, Any] = {}
    if not a.no_hf:
        rows["hf_generate"] = bench_hf(model_dir, ids, n, a.requests)
    gen = Generator(model_dir, quant=a.quant)
    engine_runs: list[dict[str, float]] = []
    for k in a.stages:
        with running_cluster(model_dir, k, a.threads, quant=a.quant, cpu_lock=a.cpu_lock) as c:
            runs: dict[str, list[dict[str, float]]] = {"engine": [], "cluster": []}
            usage = Usage()

            def run(
                name: str,
                once: Callable[[], RequestOutput],
                runs: dict[str, list[dict[str, float]]] = runs,
            ) -> float:
                runs[name].append(measure(once, a.requests))
                return runs[name][-1]["itl_ms_p50"]

            def run_cluster(c: Any = c, usage: Usage = usage) -> float:
                # measure() makes requests + 1 answers of n tokens each (ignore_eos).
                tokens = (a.requests + 1) * n

                def once() -> RequestOutput:
                    return stream_once(c.http_port, n)

                return float(measured(c, usage, tokens, lambda: run("cluster", once)))

            alternate(
                a.rounds,
                ("engine", lambda: run("engine", lambda: engine_stamps(gen, ids, n))),
                ("cluster", run_cluster),
            )
            row = median_row(runs["cluster"])
            pairs = list(zip(runs["engine"], runs["cluster"], strict=True))
            row["ratio_itl_vs_engine"] = spread(
                [q["itl_ms_p50"] / e["itl_ms_p50"] for e, q in pairs]
            )
            row["bus_overhead_ms_per_token"] = spread(
                [q["itl_ms_p50"] - e["itl_ms_p50"] for e, q in pairs]
            )
            row["rss_mb"] = {p.name: round(peak_rss_mb(p.popen.pid), 1) for p in c.procs}
            row.update(usage.per_token_ms())
            rows[f"cluster_{k}_stage"] = row
            engine_runs += runs["engine"]
    rows["engine"] = median_row(engine_runs)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3], help="cluster sizes")
    ap.add_argument("--new-tokens", type=int, default=128, help="tokens per request")
    ap.add_argument("--requests", type=int, default=5, help="requests per measurement")
    ap.add_argument("--threads", type=int, default=2, help="threads of each engine and worker")
    ap.add_argument(
        "--quant",
        choices=("none", "int8", "int4"),
        default="none",
        help="engine and workers",
    )
    ap.add_argument("--no-hf", action="store_true", help="leave out HF generate")
    ap.add_argument(
        "--out", default="benchmarks/results/per_token_latency.json", help="JSON; PNG beside it"
    )
    ap.add_argument(
        "--curve",
        action="store_true",
        help="instead: each cluster with CURVE keys against --insecure, alternating rounds",
    )
    ap.add_argument("--rounds", type=int, default=4, help="alternating rounds")
    ap.add_argument(
        "--link-delay-ms",
        type=float,
        nargs="+",
        metavar="MS",
        help="instead: the 2-stage cluster across three network namespaces (root), its "
        "workers' links delayed this much each way in turn (e.g. 0 5 20)",
    )
    ap.add_argument(
        "--link-rate", metavar="RATE", help="with --link-delay-ms: every link's rate (100mbit)"
    )
    ap.add_argument(
        "--cpu-lock",
        action="store_true",
        help="the cluster's workers take turns on the cores, as `zmqllm up` runs them",
    )
    ap.add_argument(
        "--model",
        type=Path,
        help="a model directory instead of the default model (e.g. prepare-model --random)",
    )
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    model_dir = a.model or prepare_default_model(default_model_dir())
    tok = Tokenizer.from_dir(model_dir)
    ids = tok.encode(PROMPT)  # raw completion prompt, as /v1/completions sends it
    n = a.new_tokens
    if a.curve:
        curve_cost(model_dir, a)
        return
    if a.link_delay_ms:
        link_sweep(model_dir, a)
        return

    rows = per_token_rows(model_dir, ids, a)
    hf = rows.get("hf_generate", {}).get("itl_ms_p50", float("nan"))
    print(
        f"\nper-token latency — {model_dir.name}, quant {a.quant}, {a.threads} threads, "
        f"{n} tokens, {a.requests} requests x {a.rounds} rounds (medians over rounds)"
    )
    head = f"{'':16} {'TTFT ms':>8} {'ITL p50':>8} {'p95':>7} {'p99':>7} {'tok/s':>7}"
    head += f" {'vs engine (range)':>19} {'vs HF':>6}"
    print(head)
    for name, r in rows.items():
        q = r.get("ratio_itl_vs_engine")
        eng = rows["engine"]["itl_ms_p50"]
        ve = f"{q['median']:.3f} ({q['min']:.2f}-{q['max']:.2f})" if q else ""
        ve = ve or f"{r['itl_ms_p50'] / eng:.3f}"
        print(
            f"{name:16} {r['ttft_ms_p50']:8.1f} {r['itl_ms_p50']:8.2f} {r['itl_ms_p95']:7.2f} "
            f"{r['itl_ms_p99']:7.2f} {r['tokens_per_s']:7.1f} {ve:>19} {r['itl_ms_p50'] / hf:6.2f}"
        )
    for name, r in rows.items():
        if "bus_overhead_ms_per_token" in r:
            o = r["bus_overhead_ms_per_token"]
            print(
                f"{name}: bus overhead {o['median']:.2f} ms/token ({o['min']:.2f}-{o['max']:.2f})"
                f"; peak RSS MB {r['rss_mb']}"
            )
            print(f"  CPU ms/token by process: {r['cpu_ms_per_token']}")
            print(f"  ms/token inside forwards, by worker: {r['forward_ms_per_token']}")

    meta = {
        "model": str(model_dir),
        "threads": a.threads,
        "new_tokens": n,
        "requests": a.requests,
        "rounds": a.rounds,
        "quant": a.quant,
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
