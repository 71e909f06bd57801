"""Pipeline scaling: what a stage on a core of its own adds, in one run.

The whole model in one worker on one core, then the same model split in 2 (and 3, where
the machine has the cores) stages, each worker pinned to a core of its own
(``os.sched_setaffinity`` on every thread), one torch thread each, cpu_lock off. At
each concurrency level (default 1, 4, 16, 32) that many streaming requests start at
once (`ignore_eos`, as `throughput.py` sends them): aggregate tokens/s, inter-token
latency p50/p99, rows per forward and busy fraction per stage. Beside them, 2 stages
with ``--micro-batches 1`` (every session in one group, the behaviour before
micro-batches), and 2 stages across test hosts (network namespaces, a link of
``--link-rate`` and ``--link-delay-ms`` one way per worker host; needs root), with their
peer link and with every hop through the broker (the testbed delays only the links to
the broker). ``--measured-split`` adds 2 stages cut where `zmqllm plan` puts them by
this machine's figures (what ``layers = "auto"`` gives), ``--cuts N ...`` 2 stages cut at
each layer N. Rounds repeat every configuration in turn; ratios to the 1-stage run are
taken round by round.

    python benchmarks/pipeline_scaling.py [--levels 1 4 16 32] [--new-tokens 64] [--rounds 2]
        [--measured-split] [--cuts 17 15]

Writes benchmarks/results/pipeline_scaling.json (or --out) and a PNG beside it.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # see benchmarks/__init__.py

import argparse
import contextlib
import functools
import json
import os
import socket
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

from benchmarks.http_client import netns_socket
from benchmarks.report import cpu_name, write_json, write_plot
from benchmarks.stats import spread
from benchmarks.throughput import ClusterLike, burst
from testbed.cluster import Cluster
from testbed.hosts import zmqllm_command
from zmqllm.config.paths import default_model_dir
from zmqllm.config.weighted_split import Figures, weighted_split
from zmqllm.models.model_args import ModelArgs
from zmqllm.models.prepare import prepare_default_model


def pin(pid: int, core: int) -> None:
    """Every thread of ``pid`` onto ``core``; threads it starts later inherit it."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(int(tid), {core})


def pin_cluster(c: ClusterLike, front_end: int | None) -> dict[str, int]:
    """Worker i (in layer order) onto core i; with ``front_end`` a core, the broker, the
    gateway and this process (the client) onto it too: one machine per stage, the
    front end on one of them, in every configuration alike."""
    workers = sorted((p for p in c.procs if p.name.startswith("worker-")), key=_first_layer)
    cores = {}
    for core, p in enumerate(workers):
        pin(p.popen.pid, core)
        cores[p.name] = core
    if front_end is not None:
        for p in c.procs:
            if not p.name.startswith("worker-") and p.alive():
                pin(p.popen.pid, front_end)
                cores[p.name] = front_end
        pin(os.getpid(), front_end)
    return cores


def _first_layer(p: Any) -> int:
    return int(p.name.split("-")[1])


def worker_flags(a: argparse.Namespace, micro_batches: int) -> tuple[str, ...]:
    flags = ["--batch-threads", "1", "--micro-batches", str(micro_batches)]
    if a.quant != "none":
        flags += ["--quant", a.quant]
    return tuple(flags)


@contextlib.contextmanager
def local_cluster(
    model_dir: Path, layers: list[tuple[int, int]], a: argparse.Namespace, micro: int
) -> Iterator[tuple[ClusterLike, Callable[[], socket.socket] | None]]:
    with tempfile.TemporaryDirectory() as tmp:
        c = Cluster(
            Path(tmp), model_dir, heartbeat=1.0, threads=1, worker_flags=worker_flags(a, micro)
        )
        try:
            c.start_all(tuple(f"{x}:{y}" for x, y in layers))
            yield c, None
        finally:
            c.stop()


@contextlib.contextmanager
def host_cluster(
    model_dir: Path,
    layers: list[tuple[int, int]],
    a: argparse.Namespace,
    micro: int,
    peer: bool = True,
) -> Iterator[tuple[ClusterLike, Callable[[], socket.socket] | None]]:
    """The 2 stages on test hosts of their own. The testbed delays the links to the
    broker only (a relay on its host); the workers' peer link carries the decode loop
    with the rate limit but no delay, so ``peer=False`` (every hop through the broker)
    is the run where each hop pays the delay."""
    from benchmarks.links import across_hosts

    spans = (f"{layers[0][0]}:{layers[0][1]}", f"{layers[1][0]}:{layers[1][1]}")
    flags = worker_flags(a, micro) + (() if peer else ("--peer", "off"))
    with across_hosts(
        model_dir,
        spans,
        delay_ms=a.link_delay_ms,
        rate=a.link_rate,
        threads=1,
        worker_flags=flags,
    ) as c:
        yield c, lambda: netns_socket(c.http(timeout=600))


# name, stages, micro_batches, cluster, the 2-stage boundary (0: what "k/n" gives)
Config = tuple[str, int, int, Callable[..., Any], int]


def configs(a: argparse.Namespace, num_layers: int) -> list[Config]:
    cores = len(os.sched_getaffinity(0))
    out: list[Config] = [("1 stage", 1, 0, local_cluster, 0)]
    for k in a.stages:
        if k > cores or k > num_layers:
            print(f"  {k} stages left out: {cores} cores, {num_layers} layers")
            continue
        out.append((f"{k} stages", k, 0, local_cluster, 0))
    for cut in a.cuts if cores >= 2 else ():
        out.append((f"2 stages, 0:{cut} {cut}:{num_layers}", 2, 0, local_cluster, cut))
    if cores >= 2 and a.measured_split:
        cut = measured_cut(a, num_layers)
        out.append((f"2 stages, measured 0:{cut}", 2, 0, local_cluster, cut))
    if cores >= 2 and not a.no_one_group:
        out.append(("2 stages, one group", 2, 1, local_cluster, 0))
    if cores >= 2 and not a.no_hosts:
        out.append(("2 stages across hosts", 2, 0, host_cluster, 0))
        via_broker = functools.partial(host_cluster, peer=False)
        out.append(("2 hosts, through the broker", 2, 0, via_broker, 0))
    return out


def measured_cut(a: argparse.Namespace, num_layers: int) -> int:
    """Where `zmqllm plan` cuts 2 stages of this machine's figures (`zmqllm measure` on
    one thread, as each worker runs): the split `layers = "auto"` gives."""
    cmd = [*zmqllm_command(), "measure", "--json", "--threads", "1", "--quant", a.quant]
    if a.model:
        cmd += ["--model", str(a.model)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True)
    f = Figures.from_dict(json.loads(done.stdout))
    (_, cut), _ = weighted_split(num_layers, [f, f])
    print(f"  measured: {f.ms_16:.2f} ms a layer, head {f.head_ms():.2f} ms at 16 rows: 0:{cut}")
    return cut


def run_config(
    model_dir: Path, args: ModelArgs, cfg: Config, a: argparse.Namespace
) -> dict[int, dict[str, Any]]:
    name, k, micro, make, cut = cfg
    layers = [(0, cut), (cut, args.num_layers)] if cut else args.stage_ranges(k)
    rows: dict[int, dict[str, Any]] = {}
    with make(model_dir, layers, a, micro) as (c, connect):
        cores = pin_cluster(c, None if a.front_end_core < 0 else a.front_end_core)
        burst(c, 2, 8, connect)  # warm-up, on the pinned cores
        for level in a.levels:
            r = burst(c, level, a.new_tokens, connect)
            del r["stamps"]
            r["cores"] = cores
            rows[level] = r
            stages = "  ".join(
                f"{s} {v['busy_fraction']:.2f}/{v['mean_batch']:.1f}"
                for s, v in r["stages"].items()
            )
            front = sum(v for k, v in r["cpu_ms_per_token"].items() if not k.startswith("worker"))
            print(
                f"  {name:28s} {level:3d} streams: {r['tokens_per_s']:6.1f} tok/s, ITL p50 "
                f"{r['itl_ms_p50']:.0f} p99 {r['itl_ms_p99']:.0f} ms; busy/rows {stages}; "
                f"front end {front:.1f} core-ms/token",
                flush=True,
            )
    return rows


def summarise(
    runs: dict[str, list[dict[int, dict[str, Any]]]], levels: list[int]
) -> dict[str, dict[int, dict[str, Any]]]:
    """Per configuration and level: the median and range of each figure over the rounds,
    and the aggregate's ratio to the 1-stage run of the same round."""
    base = runs["1 stage"]
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for name, rounds in runs.items():
        out[name] = {}
        for level in levels:
            rs = [r[level] for r in rounds]
            ratios = [
                r[level]["tokens_per_s"] / b[level]["tokens_per_s"]
                for r, b in zip(rounds, base, strict=True)
            ]
            itl_ratios = [
                r[level]["itl_ms_p50"] / b[level]["itl_ms_p50"]
                for r, b in zip(rounds, base, strict=True)
            ]
            out[name][level] = {
                "tokens_per_s": spread([r["tokens_per_s"] for r in rs]),
                "vs_one_stage": spread(ratios),
                "itl_p50_vs_one_stage": spread(itl_ratios),
                "itl_ms_p50": spread([r["itl_ms_p50"] for r in rs]),
                "itl_ms_p99": spread([r["itl_ms_p99"] for r in rs]),
                "stages": {
                    s: {
                        "rows_per_forward": spread([r["stages"][s]["mean_batch"] for r in rs]),
                        "busy_fraction": spread([r["stages"][s]["busy_fraction"] for r in rs]),
                    }
                    for s in rs[0]["stages"]
                },
                "runs": rs,
            }
    return out


def print_table(res: dict[str, dict[int, dict[str, Any]]], levels: list[int]) -> None:
    print(
        f"\n{'configuration':28s} {'streams':>7} {'tok/s':>13} {'x 1 stage':>15} "
        f"{'ITL p50':>7} {'ITL p99':>7}  stages: rows per forward / busy"
    )
    for name, by_level in res.items():
        for level in levels:
            r = by_level[level]
            t, x = r["tokens_per_s"], r["vs_one_stage"]
            stages = "  ".join(
                f"{s} {v['rows_per_forward']['median']:.1f}/{v['busy_fraction']['median']:.2f}"
                for s, v in r["stages"].items()
            )
            print(
                f"{name:28s} {level:7d} {t['median']:6.1f} ({t['min']:.0f}-{t['max']:.0f}) "
                f"{x['median']:5.2f} ({x['min']:.2f}-{x['max']:.2f}) "
                f"{r['itl_ms_p50']['median']:7.0f} {r['itl_ms_p99']['median']:7.0f}  {stages}"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, help="a model directory (default: the default model)")
    ap.add_argument("--quant", default="none", help="the workers' --quant (none, int8, int4)")
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 4, 16, 32])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 3], help="split in K stages")
    ap.add_argument(
        "--cuts",
        type=int,
        nargs="*",
        default=[],
        help="also 2 stages split at each of these layers (beside what 2/2 gives)",
    )
    ap.add_argument(
        "--measured-split",
        action="store_true",
        help="also 2 stages split where `zmqllm plan` puts them by this machine's figures",
    )
    ap.add_argument("--no-one-group", action="store_true", help="leave out --micro-batches 1")
    ap.add_argument("--no-hosts", action="store_true", help="leave out the test hosts")
    ap.add_argument("--link-rate", default="100mbit")
    ap.add_argument("--link-delay-ms", type=float, default=5.0)
    ap.add_argument(
        "--front-end-core",
        type=int,
        default=0,
        help="the core of the broker, gateway and client (-1: left to the scheduler)",
    )
    ap.add_argument("--out", default="benchmarks/results/pipeline_scaling.json")
    a = ap.parse_args()
    model_dir = a.model or prepare_default_model(default_model_dir())
    args = ModelArgs.from_dir(model_dir)
    todo = configs(a, args.num_layers)
    runs: dict[str, list[dict[int, dict[str, Any]]]] = {cfg[0]: [] for cfg in todo}
    for rnd in range(a.rounds):
        print(f"round {rnd + 1} of {a.rounds}", flush=True)
        for cfg in todo:
            runs[cfg[0]].append(run_config(model_dir, args, cfg, a))
    res = summarise(runs, a.levels)
    print(
        f"\npipeline scaling — {model_dir.name}, quant {a.quant}, one thread per worker, "
        f"{a.new_tokens} tokens per request, {a.rounds} rounds (median, range), {cpu_name()}"
    )
    print_table(res, a.levels)
    meta = {
        "model": str(model_dir),
        "quant": a.quant,
        "new_tokens": a.new_tokens,
        "rounds": a.rounds,
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "link": {"rate": a.link_rate, "delay_ms": a.link_delay_ms},
        "front_end_core": a.front_end_core,
    }
    out = Path(a.out)
    write_json(out, {"meta": meta, "results": res})

    def draw(plt: Any) -> Any:
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
        for name, by_level in res.items():
            lv = list(by_level)
            ax1.plot(lv, [by_level[x]["tokens_per_s"]["median"] for x in lv], "o-", label=name)
            ax2.plot(lv, [by_level[x]["itl_ms_p50"]["median"] for x in lv], "o-", label=name)
        for ax, label in ((ax1, "aggregate tokens/s"), (ax2, "inter-token p50, ms")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrent streams")
            ax.set_ylabel(label)
        ax1.legend(fontsize=8)
        fig.suptitle(f"{model_dir.name}: stages on cores of their own")
        fig.tight_layout()
        return fig

    write_plot(out, draw)


if __name__ == "__main__":
    main()
