"""Scale: a Mistral-7B-shaped model (prepare-model --random mistral-7b) on this machine,
zmqllm against llama.cpp and HF transformers, side by side in one run.

Every runtime runs in a fresh process of its own, one at a time (the machine cannot hold
several 7B models at once), in rounds whose order alternates: zmqllm int4 (the Q4_1 GGUF's
blocks as they are), int8 and bf16 in one process over all layers; llama.cpp
(llama-cpp-python) on the very same weights in model-Q4_1.gguf and model-BF16.gguf; HF
transformers in bf16. Each process reports its load time, RSS after load, prefill of a
--prompt-tokens prompt (tokens/s) and decode ms/token over --new-tokens greedy tokens.
The parent measures the read bandwidth every round (a sum over a filled 512 MiB tensor,
same threads) and the floor: the bytes each format reads per token / that bandwidth.
Per-round ratios give the run-to-run range. A projection from the measured per-layer
cost: full Mistral-7B split over 1, 2 and 4 machines of this kind (memory per stage,
ms/token, hops x link latency).

    zmqllm prepare-model --random mistral-7b --output DIR
    python benchmarks/scale_7b.py --model DIR [--rounds 3] [--prompt-tokens 512]
        [--new-tokens 32] [--threads 2] [--runtimes zmqllm_int4 llama_cpp_q4_1 ...]

Writes benchmarks/results/scale_7b.json and .png.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # see benchmarks/__init__.py

import argparse
import itertools
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from typing import Any

from benchmarks.floor import read_bandwidth
from benchmarks.report import write_json, write_plot
from benchmarks.stats import median, spread

RUNTIMES = (
    "zmqllm_int4",
    "llama_cpp_q4_1",
    "zmqllm_int8",
    "zmqllm_bf16",
    "llama_cpp_bf16",
    "hf_bf16",
)
# What each runtime's floor is computed from: the bytes it reads per decode token.
FLOOR_OF = {
    "zmqllm_int4": "int4",
    "llama_cpp_q4_1": "int4",
    "zmqllm_int8": "int8",
    "zmqllm_bf16": "bf16",
    "llama_cpp_bf16": "bf16",
    "hf_bf16": "bf16",
}
TEXT = (
    "ZeroMQ is a high-performance asynchronous messaging library aimed at use in distributed "
    "or concurrent applications. It provides a message queue, but unlike message-oriented "
    "middleware, a ZeroMQ system can run without a dedicated message broker. "
)
GIB = 1 << 30


# -- one runtime, in a process of its own -------------------------------------------------


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def gaps(stamps: list[float]) -> list[float]:
    """Seconds between successive tokens."""
    return [b - a for a, b in itertools.pairwise(stamps)]


def _zmqllm(model: Path, runtime: str) -> Callable[[list[int], int], tuple[float, list[float]]]:
    from zmqllm.engine.generator import Generator

    quant = {"zmqllm_int4": "int4", "zmqllm_int8": "int8"}.get(runtime, "none")
    dtype = "bfloat16" if runtime == "zmqllm_bf16" else "float32"
    gen = Generator(model, dtype=dtype, quant=quant)

    def run(ids: list[int], n: int) -> tuple[float, list[float]]:
        stamps = [time.perf_counter()]
        for _ in gen.generate(ids, n):
            stamps.append(time.perf_counter())
        return stamps[1] - stamps[0], gaps(stamps[1:])

    return run


def _llama_cpp(model: Path, runtime: str, threads: int, ctx: int) -> Callable:
    from llama_cpp import Llama

    name = "model-Q4_1.gguf" if runtime == "llama_cpp_q4_1" else "model-BF16.gguf"
    llm = Llama(
        str(model / name),
        n_threads=threads,
        n_threads_batch=threads,
        n_ctx=ctx,
        n_batch=512,
        verbose=False,
    )

    def run(ids: list[int], n: int) -> tuple[float, list[float]]:
        llm.reset()
        stamps = [time.perf_counter()]
        for _ in llm.generate(ids, top_k=1, temp=0.0, reset=True):
            stamps.append(time.perf_counter())
            if len(stamps) == n + 1:
                break
        return stamps[1] - stamps[0], gaps(stamps[1:])

    return run


def _hf(model: Path) -> Callable:
    import torch
    from transformers import MistralForCausalLM

    hf = MistralForCausalLM.from_pretrained(model, dtype=torch.bfloat16).eval()

    @torch.inference_mode()
    def run(ids: list[int], n: int) -> tuple[float, list[float]]:
        # generate()'s own loop, unrolled so each token is stamped as it is made.
        t0 = time.perf_counter()
        out = hf(torch.tensor([ids]), use_cache=True)
        token = out.logits[0, -1].argmax()
        stamps = [time.perf_counter()]
        cache = out.past_key_values
        for _ in range(n - 1):
            out = hf(token.view(1, 1), past_key_values=cache, use_cache=True)
            cache, token = out.past_key_values, out.logits[0, -1].argmax()
            stamps.append(time.perf_counter())
        return stamps[0] - t0, gaps(stamps)

    return run


def child(a: argparse.Namespace) -> None:
    """Load one runtime, warm it up, time one prompt; one JSON line on stdout."""
    import torch

    torch.set_num_threads(a.threads)
    from zmqllm.models.tokenizer import Tokenizer

    model = Path(a.model)
    ids = (Tokenizer.from_dir(model).encode(TEXT) * (a.prompt_tokens // 10 + 1))[: a.prompt_tokens]
    t0 = time.perf_counter()
    if a.child.startswith("zmqllm"):
        run = _zmqllm(model, a.child)
    elif a.child.startswith("llama_cpp"):
        run = _llama_cpp(model, a.child, a.threads, len(ids) + a.new_tokens + 16)
    else:
        run = _hf(model)
    load_s = time.perf_counter() - t0
    rss = _rss()
    run(ids[:16], 4)  # warm-up: kernels built, pages touched
    prefill_s, steps = run(ids, a.new_tokens)
    print(
        json.dumps(
            {
                "load_s": load_s,
                "rss_bytes": rss,
                "prefill_s": prefill_s,
                "prompt_tokens": len(ids),
                "decode_ms": median(steps) * 1e3,
                "decode_mean_ms": statistics.fmean(steps) * 1e3,
            }
        )
    )


# -- the parent: rounds, floor, table ------------------------------------------------------


def bytes_per_token(model: Path) -> dict[str, int]:
    """Weight bytes a decode token must read in each format: every tensor of the GGUF
    file but the embedding, of which a step gathers one row; int8 as Q8_0 would hold it
    (34 bytes a block of 32)."""
    import gguf

    out = {}
    for fmt, name in (("int4", "model-Q4_1.gguf"), ("bf16", "model-BF16.gguf")):
        reader = gguf.GGUFReader(str(model / name))
        out[fmt] = sum(int(t.n_bytes) for t in reader.tensors if t.name != "token_embd.weight")
        if fmt == "bf16":
            weights = sum(
                int(t.n_elements) for t in reader.tensors if t.name != "token_embd.weight"
            )
            out["int8"] = weights * 34 // 32
    return out


def projection(
    model: Path, decode_ms: float, int4_bytes: int, link_ms: float, full_layers: int = 32
) -> list[dict[str, Any]]:
    """Full Mistral-7B (32 layers) over K machines of this kind, from this run: a token's
    compute scales with the int4 bytes it reads (this run's time per byte), the weights
    per stage are the memory plan's, and each of the K crossings of a K-stage ring
    (stage to stage, the last stage's token back to stage 0) costs one link latency."""
    import dataclasses

    from zmqllm.engine.memory_plan import plan_stage
    from zmqllm.models.model_args import ModelArgs

    measured = ModelArgs.from_dir(model)
    full = dataclasses.replace(measured, num_layers=full_layers)
    layer_bytes = (int4_bytes - head_bytes(measured)) / measured.num_layers
    ms_per_byte = decode_ms / int4_bytes
    rows = []
    for k in (1, 2, 4):
        per_stage = full_layers // k
        stages = [plan_stage(full, s, s + per_stage, "float32", "int4", 4096, 1) for s in
                  range(0, full_layers, per_stage)]  # fmt: skip
        compute = (layer_bytes * full_layers + head_bytes(full)) * ms_per_byte
        rows.append(
            {
                "machines": k,
                "layers_per_stage": per_stage,
                "largest_stage_weights_gib": max(p.weight_bytes for p in stages) / GIB,
                "kv_bytes_per_token_per_stage": stages[0].kv_bytes_per_token,
                "compute_ms_per_token": compute,
                "link_ms_per_token": (k if k > 1 else 0) * link_ms,
                "ms_per_token": compute + (k if k > 1 else 0) * link_ms,
            }
        )
    return rows


def head_bytes(args: Any) -> int:
    """The Q8_0 head's bytes (34 a block of 32)."""
    return args.vocab_size * args.hidden_size * 34 // 32


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a prepare-model --random directory")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    ap.add_argument("--runtimes", nargs="+", default=list(RUNTIMES), choices=RUNTIMES)
    ap.add_argument("--link-ms", type=float, default=5.0, help="projection: one-way latency")
    ap.add_argument("--out", default="benchmarks/results/scale_7b.json")
    ap.add_argument("--child", choices=RUNTIMES, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a)
        return
    model = Path(a.model)
    runs: dict[str, list[dict[str, Any]]] = {r: [] for r in a.runtimes}
    bandwidth: list[float] = []
    for r in range(a.rounds):
        order = a.runtimes if r % 2 == 0 else a.runtimes[::-1]
        bandwidth.append(read_bandwidth(a.threads))
        for name in order:
            cmd = [sys.executable, __file__, "--child", name, "--model", str(model)]
            cmd += ["--threads", str(a.threads), "--prompt-tokens", str(a.prompt_tokens)]
            cmd += ["--new-tokens", str(a.new_tokens)]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                print(f"  {name} failed:\n{done.stderr[-2000:]}")
                continue
            got = json.loads(done.stdout.strip().splitlines()[-1])
            runs[name].append(got)
            print(
                f"  round {r + 1} {name}: load {got['load_s']:.1f} s, "
                f"RSS {got['rss_bytes'] / GIB:.2f} GiB, prefill "
                f"{got['prompt_tokens'] / got['prefill_s']:.1f} tok/s, decode "
                f"{got['decode_ms']:.1f} ms/token",
                flush=True,
            )
    per_token = bytes_per_token(model)
    floors = {fmt: [b / bw * 1e3 for bw in bandwidth] for fmt, b in per_token.items()}
    results: dict[str, Any] = {}
    for name, got in runs.items():
        if not got:
            continue
        results[name] = {
            "load_s": spread([g["load_s"] for g in got]),
            "rss_gib": spread([g["rss_bytes"] / GIB for g in got]),
            "prefill_tok_s": spread([g["prompt_tokens"] / g["prefill_s"] for g in got]),
            "decode_ms": spread([g["decode_ms"] for g in got]),
        }

    def ratio(num: str, den: str, key: str = "decode_ms") -> dict[str, float] | None:
        if not runs.get(num) or not runs.get(den) or len(runs[num]) != len(runs[den]):
            return None
        return spread([x[key] / y[key] for x, y in zip(runs[num], runs[den], strict=True)])

    def over_floor(name: str) -> dict[str, float] | None:
        if not runs.get(name) or len(runs[name]) != len(bandwidth):
            return None
        fl = floors[FLOOR_OF[name]]
        return spread([g["decode_ms"] / f for g, f in zip(runs[name], fl, strict=True)])

    summary = {
        "int4_decode_over_llama_cpp_q4_1": ratio("zmqllm_int4", "llama_cpp_q4_1"),
        "int4_decode_over_floor": over_floor("zmqllm_int4"),
        "llama_cpp_q4_1_decode_over_floor": over_floor("llama_cpp_q4_1"),
        # tokens/s over tokens/s: llama.cpp's prefill time over zmqllm's
        "int4_prefill_tok_s_over_llama_cpp": ratio("llama_cpp_q4_1", "zmqllm_int4", "prefill_s"),
        "bf16_decode_over_hf_bf16": ratio("zmqllm_bf16", "hf_bf16"),
        "bf16_decode_over_llama_cpp_bf16": ratio("zmqllm_bf16", "llama_cpp_bf16"),
        "bf16_decode_over_floor": over_floor("zmqllm_bf16"),
        "int8_decode_over_floor": over_floor("zmqllm_int8"),
        "read_bandwidth_gb_s": spread([b / 1e9 for b in bandwidth]),
        "bytes_per_token": per_token,
    }
    from zmqllm.models.model_args import ModelArgs

    layers = ModelArgs.from_dir(model).num_layers
    if "zmqllm_int4" in results:
        summary["projection_int4"] = projection(
            model, results["zmqllm_int4"]["decode_ms"]["median"], per_token["int4"], a.link_ms
        )
    print(
        f"\nscale — {model.name} ({layers} layers), {a.threads} threads, prompt "
        f"{a.prompt_tokens} tokens, {a.new_tokens} new tokens, {a.rounds} alternating rounds"
    )
    print(f"{'':16} {'load s':>7} {'RSS GiB':>8} {'prefill tok/s':>14} {'decode ms/token':>22}")
    for name, r in results.items():
        d = r["decode_ms"]
        print(
            f"{name:16} {r['load_s']['median']:7.1f} {r['rss_gib']['median']:8.2f} "
            f"{r['prefill_tok_s']['median']:14.1f} {d['median']:9.1f} "
            f"({d['min']:.1f}-{d['max']:.1f})"
        )
    for fmt, fl in floors.items():
        print(f"{'floor_' + fmt:16} {'':32} {median(fl):9.1f}")
    for key, value in summary.items():
        if isinstance(value, dict) and "median" in value:
            print(f"{key}: {value['median']:.2f} ({value['min']:.2f}-{value['max']:.2f})")
    print(f"projection, full Mistral-7B int4, {a.link_ms} ms links:")
    for row in summary.get("projection_int4", []):
        print(
            f"  {row['machines']} machine(s): {row['layers_per_stage']} layers a stage, "
            f"{row['largest_stage_weights_gib']:.2f} GiB weights a stage, "
            f"{row['compute_ms_per_token']:.0f} ms compute + {row['link_ms_per_token']:.0f} ms "
            f"links = {row['ms_per_token']:.0f} ms/token"
        )
    meta = {
        "model": str(model),
        "layers": layers,
        "threads": a.threads,
        "prompt_tokens": a.prompt_tokens,
        "new_tokens": a.new_tokens,
        "rounds": a.rounds,
        "cpu": _cpu(),
        "machine": platform.machine(),
    }
    out = Path(a.out)
    write_json(out, {"meta": meta, "results": results, "summary": summary})
    write_plot(out, _draw(results, floors, f"{model.name}: decode, {a.threads} threads"))


def _cpu() -> dict[str, Any]:
    info = Path("/proc/cpuinfo").read_text()
    name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if "model name" in ln), "")
    flags = next(
        (ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), []
    )
    return {
        "name": name,
        "avx512": any(f.startswith("avx512") for f in flags),
        "avx2": "avx2" in flags,
    }


def _draw(results: dict[str, Any], floors: dict[str, list[float]], title: str) -> Callable:
    def draw(plt: Any) -> Any:
        names = [*results, *(f"floor_{k}" for k in floors)]
        med = [results[n]["decode_ms"]["median"] for n in results]
        med += [median(v) for v in floors.values()]
        fig, ax = plt.subplots(figsize=(8, 4))
        ax.barh(names, med, color="#4477aa")
        ax.invert_yaxis()
        ax.set_xlabel("decode ms/token (median)")
        ax.set_title(title)
        return fig

    return draw


if __name__ == "__main__":
    main()
