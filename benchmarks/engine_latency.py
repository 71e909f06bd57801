"""Engine latency: zmqllm's single-process engine against HF transformers `generate`
and llama.cpp.

Same model (the default model: HF and zmqllm float32 on the converted weights,
zmqllm int4 and llama.cpp on the Q4_1 GGUF it came from), same prompt, same
threads, in one run, in alternating rounds: HF, zmqllm's engine (the compiled
single-stream path), the engine on PyTorch's ops alone (its portable fallback),
zmqllm int8 and int4 shards, and llama.cpp (llama-cpp-python, when installed:
pip install zmqllm[bench-llama]). Measures prefill time for a 256-token prompt
and decode ms/token over 128 tokens, and the memory floor: weight bytes read per
token / the read bandwidth of a sum over a filled 512 MiB tensor with the same
threads, measured every round (for float32 and for the int4 shard's bytes).

    python benchmarks/engine_latency.py [--threads 2] [--repeats 5] [--out FILE]

Prints a table and writes JSON + PNG (default benchmarks/results/engine_latency.json).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # see benchmarks/__init__.py

import argparse
import platform
import time
from collections.abc import Callable

import torch

from benchmarks.floor import read_bandwidth
from benchmarks.report import write_json, write_plot
from benchmarks.stats import median, spread
from zmqllm.config.paths import default_model_dir
from zmqllm.engine.generator import Generator
from zmqllm.engine.gguf_weights import gguf_source
from zmqllm.models.prepare import prepare_default_model
from zmqllm.models.tokenizer import Tokenizer

TEXT = (
    "ZeroMQ is a high-performance asynchronous messaging library aimed at use in distributed "
    "or concurrent applications. It provides a message queue, but unlike message-oriented "
    "middleware, a ZeroMQ system can run without a dedicated message broker. "
)


def seconds(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def llama_cpp_run(gguf: Path, ids: list[int], n: int, threads: int) -> Callable[[int], list[int]]:
    """llama.cpp's greedy generation from the same prompt ids, its state reset each run."""
    from llama_cpp import Llama

    llm = Llama(
        str(gguf),
        n_threads=threads,
        n_threads_batch=threads,
        n_ctx=len(ids) + n + 16,
        n_batch=512,
        verbose=False,
    )

    def run(k: int) -> list[int]:
        llm.reset()  # no reuse of the previous run's prompt
        out: list[int] = []
        for token in llm.generate(ids, top_k=1, temp=0.0, reset=True):
            out.append(int(token))
            if len(out) == k:
                break
        return out

    return run


def draw_bars(decode: dict[str, list[float]], title: str) -> Callable[[object], object]:
    def draw(plt: object) -> object:
        names = list(decode)
        med = [median(decode[k]) for k in names]
        lo = [m - min(decode[k]) for k, m in zip(names, med, strict=True)]
        hi = [max(decode[k]) - m for k, m in zip(names, med, strict=True)]
        fig, ax = plt.subplots(figsize=(8, 4))  # type: ignore[attr-defined]
        ax.barh(names, med, xerr=[lo, hi], color="#4477aa")
        ax.invert_yaxis()
        ax.set_xlabel("decode ms/token (median, run-to-run range)")
        ax.set_title(title)
        return fig

    return draw


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model directory (default: the default model)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5, help="alternating rounds")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--out", default="benchmarks/results/engine_latency.json")
    a = ap.parse_args()

    torch.set_num_threads(a.threads)
    model_dir = Path(a.model) if a.model else prepare_default_model(default_model_dir())
    tok = Tokenizer.from_dir(model_dir)
    ids = (tok.encode(TEXT) * (a.prompt_tokens // 10 + 1))[: a.prompt_tokens]
    n = a.new_tokens
    dtype = getattr(torch, a.dtype)

    from transformers import MistralForCausalLM

    hf = MistralForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    x = torch.tensor([ids])

    def hf_run(k: int) -> list[int]:
        with torch.inference_mode():
            out = hf.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=k,
                do_sample=False,
                eos_token_id=None,
            )
        return out[0, len(ids) :].tolist()

    gen = Generator(model_dir, dtype=a.dtype)

    def zmq_run(k: int) -> list[int]:
        return list(gen.generate(ids, k))

    gen_pt = Generator(model_dir, dtype=a.dtype, compiled=False)

    def pt_run(k: int) -> list[int]:
        return list(gen_pt.generate(ids, k))

    runs: dict[str, Callable[[int], list[int]]] = {
        "hf_generate": hf_run,
        "zmqllm_engine": zmq_run,
        "zmqllm_pytorch_ops": pt_run,
    }
    quantized: dict[str, Generator] = {}
    if a.dtype == "float32":
        for kind in ("int8", "int4"):
            quantized[kind] = Generator(model_dir, quant=kind)
            runs[f"zmqllm_{kind}"] = lambda k, g=quantized[kind]: list(g.generate(ids, k))
    gguf = gguf_source(model_dir, "int4")
    if gguf is None:
        print("no GGUF behind this model: llama.cpp not timed")
    else:
        try:
            runs["llama_cpp_q4_1"] = llama_cpp_run(gguf, ids, n, a.threads)
        except ImportError:
            print("llama-cpp-python not installed (pip install zmqllm[bench-llama]): not timed")
    want = hf_run(n)
    agree: dict[str, int] = {}  # greedy tokens equal to HF's before the first difference
    for name, run in runs.items():
        if name != "hf_generate":
            got = run(n)
            diff = [i for i, (x, y) in enumerate(zip(got, want, strict=True)) if x != y]
            agree[name] = diff[0] if diff else n
    same = {name: k == n for name, k in agree.items()}

    # Bytes read per decode token: every weight once (the embedding is only
    # gathered, one row, unless tied to the lm_head, which reads it whole).
    itemsize = torch.empty((), dtype=dtype).element_size()
    shard = gen.shards[0]
    weight_bytes = sum(p.numel() for p in shard.layers.parameters()) * itemsize
    weight_bytes += shard.lm_head.numel() * itemsize if shard.lm_head is not None else 0
    int4_bytes = 0
    if "int4" in quantized:  # the same floor at the int4 shard's bytes (its head is tied)
        int4_bytes = quantized["int4"].shards[0].weight_bytes()

    # Alternating rounds (the order flipped each round): this machine's speed drifts.
    floors = ["floor", "floor_int4"] if int4_bytes else ["floor"]
    decode: dict[str, list[float]] = {name: [] for name in [*runs, *floors]}
    prefill: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(a.repeats):
        order = list(runs.items())
        for name, run in order if r % 2 == 0 else order[::-1]:
            run(2)  # warm-up
            t1 = seconds(lambda run=run: run(1))
            tn = seconds(lambda run=run: run(n))
            prefill[name].append(t1 * 1e3)
            decode[name].append((tn - t1) / (n - 1) * 1e3)
        rate = 1 / read_bandwidth(a.threads)  # seconds a byte
        decode["floor"].append(rate * weight_bytes * 1e3)
        if int4_bytes:
            decode["floor_int4"].append(rate * int4_bytes * 1e3)
        print(f"  round {r + 1}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in decode.items()))

    results = {
        name: {"prefill_ms": spread(prefill[name]), "decode_ms_per_token": spread(decode[name])}
        for name in runs
    }

    def per_round(num: str, den: str) -> dict[str, float] | None:
        if num not in decode or den not in decode:
            return None
        return spread([x / y for x, y in zip(decode[num], decode[den], strict=True)])

    floor = median(decode["floor"])
    summary = {
        "ratio_decode_zmqllm_over_hf": per_round("zmqllm_engine", "hf_generate"),
        "weight_bytes_per_token": weight_bytes,
        "int4_weight_bytes_per_token": int4_bytes,
        "floor_ms_per_token": spread(decode["floor"]),
        "read_bandwidth_gb_s": weight_bytes / floor / 1e6,
        "zmqllm_decode_over_floor": per_round("zmqllm_engine", "floor"),
        "int4_over_llama_cpp": per_round("zmqllm_int4", "llama_cpp_q4_1"),
        "int4_over_int4_floor": per_round("zmqllm_int4", "floor_int4"),
        "int4_over_hf": per_round("zmqllm_int4", "hf_generate"),
        "greedy_tokens_identical_to_hf": same,
        "greedy_tokens_before_first_difference_from_hf": agree,
    }

    print(
        f"\nengine latency — {model_dir.name}, {a.dtype}, {a.threads} threads, "
        f"prompt {len(ids)} tokens, {n} new tokens, {a.repeats} alternating rounds"
    )
    print(f"{'':20} {'prefill ms':>11} {'decode ms/tok (range)':>24} {'tok/s':>7}")
    for name in [*runs, *floors]:
        d = spread(decode[name])
        pre = f"{median(prefill[name]):11.1f}" if name in prefill else " " * 11
        print(
            f"{name:20} {pre} {d['median']:9.2f} ({d['min']:5.2f}-{d['max']:6.2f}) "
            f"{1e3 / d['median']:7.1f}"
        )
    for key in (
        "ratio_decode_zmqllm_over_hf",
        "zmqllm_decode_over_floor",
        "int4_over_hf",
        "int4_over_llama_cpp",
        "int4_over_int4_floor",
    ):
        r = summary[key]
        if isinstance(r, dict):
            print(f"{key} per round: {r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f})")
    print(
        f"floor: {weight_bytes / 1e6:.0f} MB/token (int4 shard {int4_bytes / 1e6:.0f} MB) at "
        f"{summary['read_bandwidth_gb_s']:.1f} GB/s (sum over a filled 512 MiB tensor)\n"
        f"greedy tokens equal to HF's before the first difference (of {n}): {agree}"
    )
    meta = {
        "model": str(model_dir),
        "dtype": a.dtype,
        "threads": a.threads,
        "prompt_tokens": len(ids),
        "new_tokens": n,
        "repeats": a.repeats,
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
    }
    write_json(Path(a.out), {"meta": meta, "results": results, "summary": summary})
    title = f"{model_dir.name}: decode, {a.threads} threads, {a.repeats} rounds"
    write_plot(Path(a.out), draw_bars(decode, title))


if __name__ == "__main__":
    main()
