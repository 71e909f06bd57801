"""Aggregate tokens/s at 1, 4 and 16 concurrent streams: zmqllm int4 against llama.cpp
decoding as many sequences in one batch, side by side in one run.

zmqllm: a local cluster (broker, one worker holding every layer with ``--quant int4``,
gateway) and that many streaming HTTP requests at once (`ignore_eos`), as
`throughput.py` sends them. llama.cpp: the same prompts (the same token ids: both
tokenize with the model's vocabulary) through `llama-cpp-python`'s low-level batch API,
every sequence's next token in one `llama_decode` call, greedy, on the model's Q4_1
GGUF (the default model's own, or `model-Q4_1.gguf` of a `prepare-model --random`
directory), with the same threads. Two rates for each: decode, the tokens made while
every stream was past its prompt, over that time (llama.cpp: its batched steps; zmqllm:
from the last stream's first token to the end), and wall, every token over the time
from the first request to the last token, prefill included. Rounds alternate the two.

    python benchmarks/aggregate_streams.py [--model DIR] [--levels 1 4 16] [--new-tokens 32]

Writes benchmarks/results/aggregate_streams[_NAME].json and .png.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # see benchmarks/__init__.py

import argparse
import ctypes
import tempfile
import time
from typing import Any

import numpy as np

from benchmarks.report import write_json, write_plot
from benchmarks.stats import spread
from benchmarks.throughput import PROMPTS, burst
from testbed.cluster import Cluster
from zmqllm.config.paths import default_model_dir
from zmqllm.models.model_args import ModelArgs
from zmqllm.models.prepare import prepare_default_model
from zmqllm.models.tokenizer import Tokenizer


def gguf_of(model_dir: Path) -> Path:
    """The Q4_1 GGUF whose blocks `--quant int4` loads for this model."""
    from zmqllm.engine.gguf_weights import gguf_source

    found = gguf_source(model_dir, "int4")
    if found is None:
        raise SystemExit(f"{model_dir}: no Q4_1 GGUF beside the checkpoint")
    return found


class LlamaBatch:
    """One llama.cpp context holding ``seqs`` sequences, decoded together."""

    def __init__(self, gguf: Path, seqs: int, ctx_per_seq: int, threads: int) -> None:
        import llama_cpp as L
        from llama_cpp import _logger

        _logger.set_verbose(False)  # llama.cpp's own lines only for errors
        self.L = L
        L.llama_backend_init()
        params = L.llama_model_default_params()
        self.model = L.llama_model_load_from_file(str(gguf).encode(), params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        cp = L.llama_context_default_params()
        cp.n_ctx = seqs * ctx_per_seq
        cp.n_batch = cp.n_ubatch = max(512, seqs)
        cp.n_seq_max = seqs
        cp.n_threads = cp.n_threads_batch = threads
        self.ctx = L.llama_init_from_model(self.model, cp)
        self.n_batch = cp.n_batch
        self.batch = L.llama_batch_init(cp.n_batch, 0, seqs)
        self.vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))

    def close(self) -> None:
        self.L.llama_batch_free(self.batch)
        self.L.llama_free(self.ctx)
        self.L.llama_model_free(self.model)

    def _decode(self, items: list[tuple[int, int, int, bool]]) -> None:
        """items: (token, position, sequence, wants logits), at most n_batch of them."""
        b = self.batch
        for i, (tok, pos, seq, logits) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i] = tok, pos, 1
            b.seq_id[i][0] = seq
            b.logits[i] = logits
        b.n_tokens = len(items)
        if self.L.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")

    def _argmax(self, i: int) -> int:
        ptr = self.L.llama_get_logits_ith(self.ctx, i)
        row = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), (self.vocab,))
        return int(row.argmax())

    def run(self, prompts: list[list[int]], n: int) -> dict[str, float]:
        """Greedy ``n`` tokens for every prompt at once: decode and wall tokens/s."""
        self.L.llama_memory_clear(self.L.llama_get_memory(self.ctx), True)
        t0 = time.perf_counter()
        nxt = []
        for s, ids in enumerate(prompts):  # prefill, a sequence per call
            for at in range(0, len(ids), self.n_batch):
                chunk = ids[at : at + self.n_batch]
                last = at + len(chunk) == len(ids)
                self._decode(
                    [(t, at + j, s, last and j == len(chunk) - 1) for j, t in enumerate(chunk)]
                )
            nxt.append(self._argmax(len(chunk) - 1))  # the last chunk's last token
        t1 = time.perf_counter()
        for step in range(1, n):  # every sequence's next token in one batch
            self._decode([(nxt[s], len(p) + step - 1, s, True) for s, p in enumerate(prompts)])
            nxt = [self._argmax(s) for s in range(len(prompts))]
        t2 = time.perf_counter()
        return {
            "decode": len(prompts) * (n - 1) / (t2 - t1),
            "wall": len(prompts) * n / (t2 - t0),
        }


def llama_levels(
    gguf: Path, prompts: list[list[int]], a: argparse.Namespace
) -> dict[int, dict[str, float]]:
    out = {}
    for level in a.levels:
        chosen = [prompts[i % len(prompts)] for i in range(level)]
        width = max(map(len, chosen)) + a.new_tokens + 8
        lb = LlamaBatch(gguf, level, width, a.threads)
        try:
            lb.run(chosen[:1] * level, 4)  # warm-up
            out[level] = lb.run(chosen, a.new_tokens)
        finally:
            lb.close()
    return out


def zmqllm_levels(model_dir: Path, a: argparse.Namespace) -> dict[int, dict[str, Any]]:
    layers = ModelArgs.from_dir(model_dir).num_layers
    rows: dict[int, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        c = Cluster(Path(tmp), model_dir, heartbeat=1.0, threads=a.threads, quant="int4")
        try:
            c.start_all((f"0:{layers}",))
            streams(c, 2, 4)  # warm-up
            for level in a.levels:
                rows[level] = streams(c, level, a.new_tokens)
        finally:
            c.stop()
    return rows


def streams(c: Cluster, level: int, n: int) -> dict[str, Any]:
    """throughput.py's burst of ``level`` streams: decode and wall tokens/s, rows per forward."""
    got = burst(c, level, n)
    stamps = got["stamps"]
    # An event per token with text: a token that ends inside a UTF-8 character comes with
    # the next one, so a stream may count a few less than n (never more).
    if any(len(s) < 2 for s in stamps):
        raise RuntimeError(f"a stream made no text: {[len(s) - 1 for s in stamps]} events")
    end = max(s[-1] for s in stamps)
    all_in = max(s[1] for s in stamps)  # every stream past its prompt from here on
    decoded = sum(1 for s in stamps for t in s[1:] if t > all_in)
    return {
        "decode": decoded / (end - all_in) if end > all_in else float("nan"),
        "wall": level * n / got["wall_s"],
        "stages": {
            name: {"forwards": st["forwards"], "rows_per_forward": st["mean_batch"]}
            for name, st in got["stages"].items()
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, help="a model directory (default: the default model)")
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    model_dir = a.model or prepare_default_model(default_model_dir())
    gguf = gguf_of(model_dir)
    tok = Tokenizer.from_dir(model_dir)
    prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]

    names = ("zmqllm_int4", "llama_cpp_q4_1")
    runs: dict[str, list[dict[int, dict[str, Any]]]] = {n: [] for n in names}
    for r in range(a.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            if name == "llama_cpp_q4_1":
                runs[name].append(llama_levels(gguf, prompts, a))
            else:
                runs[name].append(zmqllm_levels(model_dir, a))
        print(
            f"  round {r + 1} decode tok/s: "
            + "; ".join(
                f"{n} " + " ".join(f"{lv}:{v['decode']:.1f}" for lv, v in rs[-1].items())
                for n, rs in runs.items()
            ),
            flush=True,
        )

    results: dict[str, Any] = {}
    print(f"\naggregate tokens/s — {model_dir.name}, int4 / Q4_1, {a.threads} threads")
    print(f"{'streams':>7} {'rate':>6} {'zmqllm':>8} {'llama.cpp':>10} {'ratio (range)':>20}")
    for lv in a.levels:
        row: dict[str, Any] = {"zmqllm_stages": runs["zmqllm_int4"][-1][lv]["stages"]}
        for rate in ("decode", "wall"):
            z = [rs[lv][rate] for rs in runs["zmqllm_int4"]]
            ll = [rs[lv][rate] for rs in runs["llama_cpp_q4_1"]]
            ratio = spread([x / y for x, y in zip(z, ll, strict=True)])
            row[rate] = {"zmqllm_int4": spread(z), "llama_cpp_q4_1": spread(ll), "ratio": ratio}
            print(
                f"{lv:7d} {rate:>6} {spread(z)['median']:8.1f} {spread(ll)['median']:10.1f} "
                f"{ratio['median']:8.2f} ({ratio['min']:.2f}-{ratio['max']:.2f})"
            )
        results[str(lv)] = row
    from scale_7b import _cpu

    meta = {
        "model": model_dir.name,
        "gguf": gguf.name,
        "threads": a.threads,
        "new_tokens": a.new_tokens,
        "rounds": a.rounds,
        "cpu": _cpu(),
    }
    default = Path("benchmarks/results") / (
        "aggregate_streams.json" if a.model is None else f"aggregate_streams_{model_dir.name}.json"
    )
    out = a.out or default
    write_json(out, {"meta": meta, "results": results})

    def draw(plt: Any) -> Any:
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, style in (("zmqllm_int4", "o"), ("llama_cpp_q4_1", "s")):
            for rate, line in (("decode", "-"), ("wall", ":")):
                ax.plot(
                    a.levels,
                    [results[str(lv)][rate][name]["median"] for lv in a.levels],
                    style + line,
                    label=f"{name} {rate}",
                )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel("aggregate tokens/s")
        ax.set_title(f"{model_dir.name}: int4 / Q4_1, {a.threads} threads")
        ax.legend()
        return fig

    write_plot(out.with_suffix(".png"), draw)


if __name__ == "__main__":
    main()
