"""Serving peers: vLLM's OpenAI server (CPU backend) and zmqllm's gateway, side by side.

One model directory, two runtimes, one at a time (never both up: they would share the
cores), each driven over HTTP by the same client (benchmarks/http_client.py) with the
same prompts: streamed chat completions with ``ignore_eos``, so every stream asks for
the same number of tokens. Per concurrency level: decode tokens/s counted while every
stream is past its prompt, wall tokens/s, TTFT p50/p99. Beside them: the prefill rate
of a 512-token prompt on an idle server (prompt tokens / TTFT), the TTFT of one
request arriving while 16 streams decode, and of a 2000-token prompt arriving while they
do, with the longest wait it causes them between two tokens (chunked prefill). Every
prompt starts with a number of its own, so neither runtime's prefix cache serves one
request from another's prompt.

    python benchmarks/serving_peers.py [--model DIR] [--quant int4|int8|none]
        [--levels 1 4 16 64] [--new-tokens 64] [--rounds 3] [--vllm-threads 0 2]

vLLM comes from its own venv: benchmarks/peers/install_vllm.sh (default .venv-vllm).
``--vllm-threads 0`` leaves vLLM its own OpenMP thread count; N binds N threads; each
value is a runtime of its own in the table, and the ratio is taken against the best.
Writes benchmarks/results/serving_peers.json and .png.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # see benchmarks/__init__.py

import argparse
import asyncio
import functools
import itertools
import os
import signal
import tempfile
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

from benchmarks import floor
from benchmarks.http_client import RequestInput, RequestOutput, run_all, stream
from benchmarks.many_rows import cpu_name
from benchmarks.peer_servers import Server, default_vllm_venv, vllm_server, zmqllm_server
from benchmarks.report import write_json, write_plot
from benchmarks.stats import median, ms, pct, spread, tokens_per_s
from benchmarks.throughput import PROMPTS
from zmqllm.models.model_args import ModelArgs

# Plain prose to cut the long prompt from: no chat template, so token counts are the
# tokenizer's alone.
PROSE = (
    "The harbour town woke slowly. Fishing boats came in with the tide, gulls followed "
    "them, and the market filled with crates of silver fish, ropes, nets and the smell of "
    "salt. Children ran between the stalls while the old men argued about the weather. "
)
_nonce = itertools.count(1)
# Tokens each loading stream has had before a probe is sent: all are decoding, and their
# gaps before it are known.
WARM = 3


def chat(server: Server, content: str, max_tokens: int) -> RequestInput:
    url = f"{server.url}/v1/chat/completions"
    msg = [{"role": "user", "content": f"({next(_nonce)}) {content}"}]
    return RequestInput(url, messages=msg, max_tokens=max_tokens, ignore_eos=True, temperature=0)


def long_prompt(model_dir: Path, tokens: int) -> Callable[[], str]:
    """Texts of about ``tokens`` tokens, each opening with a number of its own."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids = tok.encode(PROSE * (tokens // 40 + 2), add_special_tokens=False).ids
    body = tok.decode(ids[: tokens - 4])  # the number and its brackets take the rest
    return lambda: f"({next(_nonce)}) {body}"


def decode_rate(outs: list[RequestOutput]) -> float:
    """Tokens/s between the last first token and the first last token: the span in which
    every stream is decoding and none is still in its prompt."""
    if not all(o.stamps for o in outs):
        return float("nan")
    lo = max(o.stamps[0] for o in outs)
    hi = min(o.stamps[-1] for o in outs)
    tokens = sum(1 for o in outs for t in o.stamps if lo < t <= hi)
    return tokens_per_s(tokens, hi - lo) if hi > lo else float("nan")


def burst(server: Server, level: int, n: int) -> dict[str, float]:
    outs = run_all([chat(server, PROMPTS[i % len(PROMPTS)], n) for i in range(level)])
    start = min(o.start for o in outs)
    end = max(o.end for o in outs)
    ttfts = [o.ttft for o in outs]
    return {
        "decode_tokens_per_s": decode_rate(outs),
        "wall_tokens_per_s": tokens_per_s(sum(o.generated_tokens for o in outs), end - start),
        "ttft_ms_p50": ms(pct(ttfts, 50)),
        "ttft_ms_p99": ms(pct(ttfts, 99)),
        "completion_tokens": sum(o.completion_tokens for o in outs),
        "token_events": sum(o.generated_tokens for o in outs),
        "prompt_tokens": median(o.prompt_tokens for o in outs),
    }


def prefill(server: Server, text: str) -> dict[str, float]:
    """One long prompt on an idle server, two tokens asked: prompt tokens / TTFT."""
    url = f"{server.url}/v1/completions"
    inp = RequestInput(url, prompt=text, max_tokens=2, ignore_eos=True, temperature=0)
    (out,) = run_all([inp])
    return {
        "prompt_tokens": out.prompt_tokens,
        "ttft_ms": ms(out.ttft),
        "prefill_tokens_per_s": tokens_per_s(out.prompt_tokens, out.ttft),
    }


def under_load(server: Server, streams: int, probe: RequestInput, n: int) -> dict[str, float]:
    """``probe`` sent once ``streams`` chat streams have each had WARM tokens: its TTFT, how
    many of them were still streaming when it ended (``still_decoding``), their median
    gap between tokens before it was sent, and ``stall_ms``: the longest gap of any of
    them that overlapped the probe's prefill (from its send to its first token), what a
    prompt entering a busy server costs the streams already decoding. The others are
    then dropped (both servers cancel a request whose client went), so ``n`` may be
    generous at no cost."""
    loading: dict[int, RequestOutput] = {}

    async def go() -> tuple[RequestOutput, int]:
        started = asyncio.Event()

        def first(out: RequestOutput) -> None:
            loading[id(out)] = out
            if len(loading) == streams and all(len(o.stamps) >= WARM for o in loading.values()):
                started.set()

        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(streams)]
        tasks = [asyncio.create_task(stream(chat(server, p, n), first)) for p in prompts]
        waiter = asyncio.create_task(started.wait())
        try:
            await asyncio.wait([waiter, *tasks], return_when=asyncio.FIRST_COMPLETED)
            if ended := [t.result() for t in tasks if t.done()]:  # no load left to probe
                raise RuntimeError(f"a loading stream ended early: {ended[0].error or 'ok'}")
            out = await stream(probe)
            return out, sum(1 for t in tasks if not t.done())
        finally:
            for t in [waiter, *tasks]:
                t.cancel()
            await asyncio.gather(waiter, *tasks, return_exceptions=True)

    out, decoding = asyncio.run(go())
    if not out.ok or not out.stamps:
        raise RuntimeError(f"the stream failed: {out.error or 'no token'}")
    sent, first_token = out.start, out.stamps[0]
    before: list[float] = []
    stall = 0.0
    for o in loading.values():
        for t0, t1 in itertools.pairwise(o.stamps):
            if t1 <= sent:
                before.append(t1 - t0)
            elif t0 < first_token:
                stall = max(stall, t1 - t0)
    return {
        "ttft_ms": ms(out.ttft),
        "streams": streams,
        "still_decoding": decoding,
        "itl_before_ms": ms(median(before)) if before else float("nan"),
        "stall_ms": ms(stall),
    }


def long_prompt_probe(server: Server, text: str) -> RequestInput:
    url = f"{server.url}/v1/completions"
    return RequestInput(url, prompt=text, max_tokens=2, ignore_eos=True, temperature=0)


def measure(
    server: Server, a: argparse.Namespace, text: Callable[[], str], long_text: Callable[[], str]
) -> dict[str, Any]:
    run_all([chat(server, PROMPTS[0], 4)])  # warm-up: first-call costs stay out of the figures
    prefill(server, text())
    out: dict[str, Any] = {"levels": {}}
    for level in a.levels:
        out["levels"][level] = burst(server, level, a.new_tokens)
        r = out["levels"][level]
        print(
            f"  {server.name} concurrency {level}: decode {r['decode_tokens_per_s']:.1f} tok/s, "
            f"wall {r['wall_tokens_per_s']:.1f} tok/s, TTFT p50 {r['ttft_ms_p50']:.0f} ms",
            flush=True,
        )
    out["prefill"] = prefill(server, text())
    load = max(4 * a.new_tokens, 256)
    out["ttft_under_load"] = under_load(server, a.load_streams, chat(server, PROMPTS[-1], 4), load)
    out["long_under_load"] = under_load(
        server, a.load_streams, long_prompt_probe(server, long_text()), max(load, 1024)
    )
    lu = out["long_under_load"]
    print(
        f"  {server.name}: prefill {out['prefill']['prefill_tokens_per_s']:.0f} tok/s, "
        f"TTFT under {a.load_streams} streams {out['ttft_under_load']['ttft_ms']:.0f} ms; "
        f"a {a.long_prompt_tokens}-token prompt under them: TTFT {lu['ttft_ms']:.0f} ms, "
        f"their longest gap {lu['stall_ms']:.0f} ms (median {lu['itl_before_ms']:.0f} before)",
        flush=True,
    )
    return out


def runtimes(
    model_dir: Path, a: argparse.Namespace, logs: Path
) -> Iterator[tuple[str, Callable[[], AbstractContextManager[Server]]]]:
    threads = a.threads or os.cpu_count() or 1
    yield f"zmqllm[{a.quant}]", lambda: zmqllm_server(model_dir, a.quant, threads, a.zmqllm_dtype)
    if a.int8_activations:
        yield (
            f"zmqllm[{a.quant}, int8 act]",
            functools.partial(
                zmqllm_server, model_dir, a.quant, threads, a.zmqllm_dtype, int8_activations=True
            ),
        )
    if a.bf16_kv:
        yield (
            f"zmqllm[{a.quant}, bf16 KV]",
            functools.partial(
                zmqllm_server,
                model_dir,
                a.quant,
                threads,
                a.zmqllm_dtype,
                worker_flags=("--kv-dtype", "bfloat16"),
            ),
        )
    for t in a.vllm_threads:
        yield (
            f"vLLM[{t or 'own'} thr]",
            functools.partial(
                vllm_server,
                model_dir,
                Path(a.vllm_venv),
                t,
                logs,
                a.max_model_len,
                a.kv_gib,
                tuple(a.vllm_arg),
            ),
        )


Row = tuple[str, Callable[[dict[str, Any]], float], bool]


def level_figure(level: int, key: str) -> Callable[[dict[str, Any]], float]:
    return lambda r: float(r["levels"][level][key])


def rows(a: argparse.Namespace) -> list[Row]:
    """The figures the table shows: (label, how to read one run, higher is better)."""
    out: list[Row] = []
    for lv in a.levels:
        for key, label, up in (
            ("decode_tokens_per_s", "decode tok/s", True),
            ("wall_tokens_per_s", "wall tok/s", True),
            ("ttft_ms_p50", "TTFT p50 ms", False),
            ("ttft_ms_p99", "TTFT p99 ms", False),
        ):
            out.append((f"c={lv} {label}", level_figure(lv, key), up))
    out.append(
        (
            f"prefill {a.prefill_tokens} tok/s",
            lambda r: r["prefill"]["prefill_tokens_per_s"],
            True,
        )
    )
    out.append(
        (f"TTFT, {a.load_streams} streams ms", lambda r: r["ttft_under_load"]["ttft_ms"], False)
    )
    long = f"{a.long_prompt_tokens}-token prompt"
    out.append((f"{long} TTFT ms", lambda r: r["long_under_load"]["ttft_ms"], False))
    out.append(("  streams' longest gap ms", lambda r: r["long_under_load"]["stall_ms"], False))
    return out


def table(runs: dict[str, list[dict[str, Any]]], a: argparse.Namespace) -> dict[str, Any]:
    """Print every figure as median (min-max) per runtime and zmqllm / the best vLLM
    (the highest rate, the lowest time: a ratio below 1 on a time is zmqllm ahead)."""
    names = list(runs)
    ours = [n for n in names if n.startswith("zmqllm")]  # zmqllm, then its variants
    peers = [n for n in names if n not in ours]
    heads = "".join(f"{'/vLLM':>13}" if i else f"{'zmqllm/vLLM':>13}" for i in range(len(ours)))
    print(f"\n{'':26}" + "".join(f"{n:>24}" for n in names) + heads)
    summary: dict[str, Any] = {}
    for label, read, up in rows(a):
        cells = {n: spread([read(r) for r in runs[n]]) for n in names}
        texts = [f"{c['median']:.1f} ({c['min']:.1f}-{c['max']:.1f})" for c in cells.values()]
        best = (max if up else min)((cells[p]["median"] for p in peers), default=float("nan"))
        ratios = [cells[n]["median"] / best if best else float("nan") for n in ours]
        shown = "".join(f"{r:>13.2f}" for r in ratios)
        print(f"{label:26}" + "".join(t.rjust(24) for t in texts) + shown)
        summary[label] = {**cells, "ratio_zmqllm_over_best_vllm": ratios[0]}
        for n, r in zip(ours[1:], ratios[1:], strict=True):  # the variants: int8 act, bf16 KV
            summary[label][f"ratio {n} over best vLLM"] = r
    return summary


def weights_of(name: str, a: argparse.Namespace) -> str:
    """How a runtime of the table holds its weights (a floor.BYTES_PER_WEIGHT key)."""
    if name.startswith("zmqllm"):
        return a.quant if a.quant != "none" else a.zmqllm_dtype or "float32"
    return "bfloat16"  # peer_servers starts vLLM with --dtype bfloat16


def floor_table(
    runs: dict[str, list[dict[str, Any]]],
    machines: list[floor.Machine],
    args: ModelArgs,
    a: argparse.Namespace,
) -> dict[str, Any]:
    """The floor of each runtime's weights (floor.py) from the median of the rounds'
    measurements, and each runtime's median figure over it: how much of the machine it
    uses. A stream's cache holds its prompt and, on average, half its new tokens."""
    rates = {d: median(m.flops_per_s[d] for m in machines) for d in machines[0].flops_per_s}
    machine = floor.Machine(median(m.read_bytes_per_s for m in machines), rates)
    prompt = median(r["levels"][lv]["prompt_tokens"] for rs in runs.values() for r in rs
                    for lv in a.levels)  # fmt: skip
    context = round(prompt) + a.new_tokens // 2
    held = {n: weights_of(n, a) for n in runs}
    f = floor.floors(machine, args, tuple(sorted(set(held.values()))), a.levels, context,
                     a.prefill_tokens)  # fmt: skip
    print(floor.describe(f))
    print(f"\n{'share of the floor':26}" + "".join(f"{n:>24}" for n in runs))
    shares: dict[str, dict[str, float]] = {n: {} for n in runs}
    for lv in a.levels:
        for n, rs in runs.items():
            got = median(r["levels"][lv]["decode_tokens_per_s"] for r in rs)
            shares[n][f"c={lv} decode"] = got / f["decode_tokens_per_s"][held[n]][lv]
    for n, rs in runs.items():
        got = median(r["prefill"]["prefill_tokens_per_s"] for r in rs)
        shares[n]["prefill"] = got / f["prefill_tokens_per_s"]
    for label in shares[next(iter(runs))]:
        print(f"{label:26}" + "".join(f"{shares[n][label]:>24.2f}" for n in runs))
    return {**f, "weights": held, "share": shares}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, help="a Mistral HF checkpoint (default: the default)")
    ap.add_argument("--quant", choices=["none", "int8", "int4"], default="int4", help="zmqllm's")
    ap.add_argument("--zmqllm-dtype", default="", help="the worker's --dtype (default: its own)")
    ap.add_argument("--threads", type=int, default=0, help="zmqllm worker threads (0: cores)")
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prefill-tokens", type=int, default=512)
    ap.add_argument("--load-streams", type=int, default=16)
    ap.add_argument(
        "--long-prompt-tokens",
        type=int,
        default=2000,
        help="the prompt sent while --load-streams streams decode (its TTFT, their stall)",
    )
    ap.add_argument("--rounds", type=int, default=3, help="each runtime started this often")
    ap.add_argument(
        "--vllm-threads",
        type=int,
        nargs="+",
        default=[0, os.cpu_count() or 1],
        help="vLLM's OpenMP threads, one run each (0: vLLM's own choice)",
    )
    ap.add_argument("--vllm-venv", default=str(default_vllm_venv()))
    ap.add_argument("--vllm-arg", action="append", default=[], help="one more vLLM flag")
    ap.add_argument("--max-model-len", type=int, default=2048, help="vLLM's")
    ap.add_argument("--kv-gib", type=int, default=2, help="vLLM's VLLM_CPU_KVCACHE_SPACE")
    ap.add_argument("--no-vllm", action="store_true", help="zmqllm alone")
    ap.add_argument(
        "--int8-activations", action="store_true", help="zmqllm with them too, one run each"
    )
    ap.add_argument(
        "--bf16-kv", action="store_true", help="zmqllm with a bfloat16 KV cache too (kv_dtype)"
    )
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/serving_peers.json"))
    a = ap.parse_args()
    # SIGTERM unwinds like Ctrl-C, so the finally blocks stop whatever server is up.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    if a.no_vllm:
        a.vllm_threads = []
    if a.model is None:
        from zmqllm.config.paths import default_model_dir
        from zmqllm.models.prepare import prepare_default_model

        a.model = prepare_default_model(default_model_dir())
    model_dir = a.model.resolve()
    text = long_prompt(model_dir, a.prefill_tokens)
    long_text = long_prompt(model_dir, a.long_prompt_tokens)
    cpu = cpu_name()
    print(f"serving peers — {model_dir.name} on {cpu}, {os.cpu_count()} cores, zmqllm {a.quant}")
    runs: dict[str, list[dict[str, Any]]] = {}
    settings: dict[str, Any] = {}
    args = ModelArgs.from_dir(model_dir)
    machines: list[floor.Machine] = []
    # vLLM's logs outlive the run (a few MB): where a server failed mid-run, they say why.
    logs = Path(tempfile.mkdtemp(prefix="serving-peers-logs-"))
    print(f"vLLM logs in {logs}")
    for rnd in range(a.rounds):
        order = list(runtimes(model_dir, a, logs))
        if rnd % 2:
            order.reverse()  # alternate who goes first: drift falls on both
        # The floor's measurements each round, with no server up: the machine drifts.
        machines.append(floor.measure(args, a.threads or os.cpu_count() or 1))
        for name, start in order:
            print(f"round {rnd + 1}/{a.rounds}: {name}", flush=True)
            with start() as server:
                runs.setdefault(name, []).append(measure(server, a, text, long_text))
                settings[name] = server.settings
    summary = table(runs, a)
    summary["floor"] = floor_table(runs, machines, args, a)
    meta = {
        "model": str(model_dir),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "levels": a.levels,
        "new_tokens": a.new_tokens,
        "prefill_tokens": a.prefill_tokens,
        "load_streams": a.load_streams,
        "long_prompt_tokens": a.long_prompt_tokens,
        "rounds": a.rounds,
        "settings": settings,
    }
    write_json(a.out, {"meta": meta, "summary": summary, "runs": runs})

    def draw(plt: Any) -> Any:
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
        for name, rs in runs.items():
            dec = [median(r["levels"][lv]["decode_tokens_per_s"] for r in rs) for lv in a.levels]
            p50 = [median(r["levels"][lv]["ttft_ms_p50"] for r in rs) for lv in a.levels]
            ax1.plot(a.levels, dec, "o-", label=name)
            ax2.plot(a.levels, p50, "o-", label=name)
        for w, per_level in summary["floor"]["decode_tokens_per_s"].items():
            ax1.plot(a.levels, [per_level[lv] for lv in a.levels], "--", label=f"floor, {w}")
        for ax, what in ((ax1, "decode tokens/s"), (ax2, "TTFT p50, ms")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrent streams")
            ax.set_ylabel(what)
            ax.legend()
        fig.suptitle(f"{model_dir.name} on {cpu}")
        return fig

    write_plot(a.out, draw)


if __name__ == "__main__":
    main()
