"""Throughput under concurrency: a 2-stage cluster against HF `generate`, one run.

For each concurrency level (default 1, 2, 4, 8, 16, 32) a burst of that many
streaming requests starts at once against a local 2-stage cluster of the
default model (real broker, worker and gateway processes on 127.0.0.1); every
request asks for the same number of tokens (`ignore_eos`). Reports aggregate
tokens/s, inter-token latency p50/p99, time to first token p50/p99, the mean
batch per stage and how busy each stage was (stages computing at the same time
add up to more than 1). In the same run, HF transformers on the same prompts:
sequential `generate`, and batched `generate` with left padding.

    python benchmarks/throughput.py [--levels 1 2 4 8 16 32] [--new-tokens 64]

Writes benchmarks/results/throughput.json and .png.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # see benchmarks/__init__.py

import argparse
import os
import socket
import tempfile
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from benchmarks.http_client import RequestInput, run_all
from benchmarks.report import write_json, write_plot
from benchmarks.stats import ms, pct, tokens_per_s
from testbed.cluster import Cluster
from zmqllm.config.paths import default_model_dir
from zmqllm.launch.child_process import ChildProcess
from zmqllm.models.model_args import ModelArgs
from zmqllm.models.prepare import prepare_default_model
from zmqllm.models.tokenizer import Tokenizer

TOPICS = [
    "the ocean",
    "a lighthouse",
    "mountains",
    "a robot",
    "the moon",
    "a library",
    "rain",
    "a city at night",
    "trains",
    "a garden",
    "winter",
    "the desert",
    "a violin",
    "coffee",
    "an old map",
    "bees",
    "a river",
    "clouds",
    "a clock",
    "the forest",
    "a bridge",
    "volcanoes",
    "a chess game",
    "stars",
    "a bakery",
    "the wind",
    "a ship",
    "snow",
    "a market",
    "fireflies",
    "a castle",
    "autumn",
]
PROMPTS = [f"Write a short poem about {t}." for t in TOPICS]


class ClusterLike(Protocol):
    """A local Cluster or one across test hosts (testbed.hosts.HostCluster)."""

    procs: list[ChildProcess]

    def status(self) -> dict[str, Any]: ...


def stage_stats(c: ClusterLike) -> dict[str, dict[str, float]]:
    return {f"{w['layers'][0]}:{w['layers'][1]}": w.get("stats", {}) for w in c.status()["workers"]}


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def burst(
    c: ClusterLike, level: int, n: int, connect: Callable[[], socket.socket] | None = None
) -> dict[str, Any]:
    """``level`` streamed chat completions at once, to a local Cluster's gateway (or
    over the sockets ``connect`` makes: a gateway on a test host)."""
    if connect is None:
        assert isinstance(c, Cluster)
        url = f"http://127.0.0.1:{c.http_port}/v1/chat/completions"
    else:  # the sockets reach the gateway; the URL gives the path and the Host header
        url = "http://127.0.0.1/v1/chat/completions"
    inputs = [
        RequestInput(
            url,
            messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
            max_tokens=n,
            ignore_eos=True,
            temperature=0,
            connect=connect,
        )
        for i in range(level)
    ]
    before = stage_stats(c)
    cpu_before = {p.name: cpu_seconds(p.popen.pid) for p in c.procs if p.alive()}
    t0 = time.perf_counter()
    outs = run_all(inputs)
    wall = time.perf_counter() - t0
    cpu_after = {name: cpu_seconds(p.popen.pid) for p in c.procs if (name := p.name) in cpu_before}
    time.sleep(1.2)  # one heartbeat, so the workers' figures reach the broker
    after = stage_stats(c)
    ttfts = [o.ttft for o in outs]
    itls = [gap for o in outs for gap in o.itl]
    tokens = sum(o.generated_tokens for o in outs)
    stages = {}
    for name, a in after.items():
        b = before.get(name, {})
        fw = a.get("forwards", 0) - b.get("forwards", 0)
        busy = a.get("busy_s", 0.0) - b.get("busy_s", 0.0)
        stages[name] = {
            "busy_fraction": round(busy / wall, 3),
            "forwards": fw,
            "mean_batch": round((a.get("tokens", 0) - b.get("tokens", 0)) / fw, 2) if fw else 0,
            "max_batch": a.get("max_batch", 0),
        }
    return {
        "tokens_per_s": tokens_per_s(tokens, wall),
        "itl_ms_p50": ms(pct(itls, 50)),
        "itl_ms_p99": ms(pct(itls, 99)),
        "ttft_ms_p50": ms(pct(ttfts, 50)),
        "ttft_ms_p99": ms(pct(ttfts, 99)),
        "tokens": tokens,
        "wall_s": wall,
        "stages": stages,
        "stamps": [[o.start, *o.stamps] for o in outs],  # per stream: start, each token
        # Where the CPU went: core-milliseconds per generated token, per process.
        "cpu_ms_per_token": {
            k: round((cpu_after[k] - cpu_before[k]) * 1e3 / max(1, tokens), 2) for k in cpu_after
        },
    }


def hf_baselines(model_dir: Path, tok: Tokenizer, levels: list[int], n: int) -> dict[int, dict]:
    from transformers import MistralForCausalLM

    model = MistralForCausalLM.from_pretrained(model_dir).eval()
    pad = 0
    out: dict[int, dict] = {}
    chats = [tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    with torch.inference_mode():
        one = torch.tensor([chats[0]])
        model.generate(
            one, attention_mask=torch.ones_like(one), max_new_tokens=4, do_sample=False
        )  # warm-up
        t0 = time.perf_counter()
        model.generate(
            one,
            attention_mask=torch.ones_like(one),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=pad,
        )
        seq_rate = n / (time.perf_counter() - t0)  # sequential: one request at a time
        for level in levels:
            ids = [chats[i % len(chats)] for i in range(level)]
            width = max(map(len, ids))
            x = torch.tensor([[pad] * (width - len(r)) + r for r in ids])  # left padding
            mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in ids])
            t0 = time.perf_counter()
            model.generate(
                x,
                attention_mask=mask,
                max_new_tokens=n,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=pad,
            )
            out[level] = {
                "sequential_tokens_per_s": seq_rate,
                "batched_tokens_per_s": level * n / (time.perf_counter() - t0),
            }
    return out


def run_levels(
    model_dir: Path, layers: list[tuple[int, int]], a: argparse.Namespace, keys: Path | None
) -> dict[int, dict[str, Any]]:
    """One cluster (CURVE on with ``keys``), a burst at each concurrency level."""
    rows: dict[int, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        batch_threads = a.batch_threads or max(1, (os.cpu_count() or 1) // a.stages)
        if a.cpu_lock:
            batch_threads = a.batch_threads
        c = Cluster(
            Path(tmp),
            model_dir,
            heartbeat=1.0,
            threads=a.threads,
            batch_threads=batch_threads,
            cpu_lock=a.cpu_lock,
            keys=keys,
            worker_flags=() if a.micro_batches < 0 else ("--micro-batches", str(a.micro_batches)),
        )
        try:
            c.start_all(tuple(f"{x}:{y}" for x, y in layers))
            burst(c, 2, 8)  # warm-up
            for level in a.levels:
                rows[level] = burst(c, level, a.new_tokens)
                del rows[level]["stamps"]  # the summary above is what the JSON keeps
                print(f"  concurrency {level}: {rows[level]['tokens_per_s']:.1f} tok/s", flush=True)
        finally:
            c.stop()
    return rows


def curve_cost(model_dir: Path, layers: list[tuple[int, int]], a: argparse.Namespace) -> None:
    """Aggregate tokens/s at each level with and without CURVE, in alternating rounds."""
    from benchmarks.paired import alternate, compare, describe
    from zmqllm.bus.keys import init_keys

    runs: dict[str, list[dict[int, dict[str, Any]]]] = {"insecure": [], "curve": []}
    with tempfile.TemporaryDirectory() as tmp:
        keys = init_keys(Path(tmp) / "keys")

        def run(name: str, with_keys: Path | None) -> float:
            runs[name].append(run_levels(model_dir, layers, a, with_keys))
            return float(runs[name][-1][a.levels[-1]]["tokens_per_s"])

        alternate(
            a.rounds,
            ("insecure", lambda: run("insecure", None)),
            ("curve", lambda: run("curve", keys)),
        )
    results = {}
    for level in a.levels:
        values = {name: [r[level]["tokens_per_s"] for r in rs] for name, rs in runs.items()}
        results[level] = compare(values, "insecure", "curve")
        print(f"concurrency {level}, tokens/s:")
        print(describe(results[level], "insecure", "curve", "tok/s"))
    meta = {
        "stages": [f"{x}:{y}" for x, y in layers],
        "rounds": a.rounds,
        "new_tokens": a.new_tokens,
    }
    write_json(Path(a.out).with_name("throughput_curve.json"), {"meta": meta, "results": results})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument(
        "--cpu-lock",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="workers take turns on the cores with all their threads, as `zmqllm up` runs "
        "them (default); --no-cpu-lock: all compute at once on batch_threads each",
    )
    ap.add_argument(
        "--native",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="workers attend batched decode steps with the compiled kernel (default); "
        "--no-native: the PyTorch path (ZMQLLM_NATIVE=0)",
    )
    ap.add_argument(
        "--layers",
        nargs="+",
        metavar="A:B",
        help='explicit stage ranges instead of the split of "k/n", e.g. 0:17 17:30',
    )
    ap.add_argument("--threads", type=int, default=2, help="per worker, one stream in flight")
    ap.add_argument(
        "--batch-threads",
        type=int,
        default=0,
        help="per worker while several streams are in flight (default: cores / stages)",
    )
    ap.add_argument(
        "--micro-batches",
        type=int,
        default=-1,
        help="the workers' --micro-batches (0: one group per stage, or 1 with the cpu lock; "
        "1: one group; N: at most N; default: theirs, 0)",
    )
    ap.add_argument("--out", default="benchmarks/results/throughput.json")
    ap.add_argument(
        "--curve",
        action="store_true",
        help="instead: the cluster with CURVE keys against --insecure, alternating rounds",
    )
    ap.add_argument("--rounds", type=int, default=4, help="--curve: rounds of each")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    model_dir = prepare_default_model(default_model_dir())
    tok = Tokenizer.from_dir(model_dir)
    n = a.new_tokens

    layers: list[tuple[int, int]]
    if a.layers:
        layers = [(int(r.split(":")[0]), int(r.split(":")[1])) for r in a.layers]
        a.stages = len(layers)
    else:
        layers = ModelArgs.from_dir(model_dir).stage_ranges(a.stages)
    if not a.native:
        os.environ["ZMQLLM_NATIVE"] = "0"  # inherited by the workers
    if a.curve:
        curve_cost(model_dir, layers, a)
        return
    rows = run_levels(model_dir, layers, a, keys=None)
    hf = hf_baselines(model_dir, tok, a.levels, n)

    single = rows[a.levels[0]]
    print(
        f"\nthroughput — {model_dir.name}, fp32, {a.stages} stages, {a.threads} threads per "
        f"worker, {n} tokens per request, cpu_lock {'on' if a.cpu_lock else 'off'}, "
        f"decode attention {'compiled' if a.native else 'pytorch'}"
    )
    print(
        f"{'conc':>4} {'tok/s':>7} {'x single':>8} {'ITL p50':>8} {'ITL p99':>8} "
        f"{'TTFT p50':>9} {'TTFT p99':>9} {'HF seq':>7} {'HF batch':>8} {'vs HF batch':>11}  "
        "stages: busy / rows per forward"
    )
    for level, r in rows.items():
        h = hf[level]
        r["speedup_vs_single"] = r["tokens_per_s"] / single["tokens_per_s"]
        r["itl_p99_vs_single"] = r["itl_ms_p99"] / single["itl_ms_p99"]
        r["hf"] = h
        r["ratio_vs_hf_batched"] = r["tokens_per_s"] / h["batched_tokens_per_s"]
        stages = "  ".join(
            f"{k} {v['busy_fraction']:.2f}/{v['mean_batch']:.1f}" for k, v in r["stages"].items()
        )
        print(
            f"{level:4d} {r['tokens_per_s']:7.1f} {r['speedup_vs_single']:8.2f} "
            f"{r['itl_ms_p50']:8.1f} {r['itl_ms_p99']:8.1f} {r['ttft_ms_p50']:9.1f} "
            f"{r['ttft_ms_p99']:9.1f} {h['sequential_tokens_per_s']:7.1f} "
            f"{h['batched_tokens_per_s']:8.1f} {r['ratio_vs_hf_batched']:11.2f}  {stages}"
        )

    top = rows[max(rows)]
    print(f"CPU ms per token at concurrency {max(rows)}: {top['cpu_ms_per_token']}")
    meta = {
        "model": str(model_dir),
        "stages": [f"{x}:{y}" for x, y in layers],
        "threads": a.threads,
        "cpu_lock": a.cpu_lock,
        "native_attention": a.native,
        "new_tokens": n,
        "torch": torch.__version__,
    }
    out = Path(a.out)
    write_json(out, {"meta": meta, "results": rows})

    def draw(plt: Any) -> Any:
        lv = list(rows)
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
        ax1.plot(lv, [rows[x]["tokens_per_s"] for x in lv], "o-", label="zmqllm cluster")
        ax1.plot(
            lv, [hf[x]["batched_tokens_per_s"] for x in lv], "s--", label="HF batched generate"
        )
        ax1.plot(lv, [hf[x]["sequential_tokens_per_s"] for x in lv], ":", label="HF sequential")
        ax1.set_xscale("log", base=2)
        ax1.set_xlabel("concurrent streams")
        ax1.set_ylabel("aggregate tokens/s")
        ax1.legend()
        ax2.plot(lv, [rows[x]["itl_ms_p50"] for x in lv], "o-", label="ITL p50")
        ax2.plot(lv, [rows[x]["itl_ms_p99"] for x in lv], "o--", label="ITL p99")
        ax2.set_xscale("log", base=2)
        ax2.set_xlabel("concurrent streams")
        ax2.set_ylabel("ms")
        ax2.legend()
        fig.suptitle(f"{model_dir.name}: {a.stages}-stage cluster throughput")
        return fig

    write_plot(out, draw)


if __name__ == "__main__":
    main()
