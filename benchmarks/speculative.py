"""Speculative decoding by prompt lookup: ms/token and tokens per pass, with and without.

One 2-stage cluster per place, its last stage started with ``--speculative lookup``; the
two arms share it and differ only by the request's ``"speculative": false``, in rounds
that alternate which goes first (benchmarks/paired.py), so the ratio of a round compares
the same processes minutes apart at most. Places: one host (a local cluster on
127.0.0.1, the workers taking turns on the cores as ``zmqllm up`` starts them), and three
test hosts (benchmarks/links.py: broker and gateway on host 1, a stage on each other)
with the workers' links delayed 0, 5 and 20 ms each way, the delay changed while the
cluster runs, every hop through the broker (``--peer off``: the testbed delays the links
to the broker, not the workers' peer link). Prompts that repeat their input (rewrite a
paragraph, edit code in its context, answer after quoting the question) and prompts that
do not, as chat requests, greedy, ``ignore_eos`` and a fixed ``max_tokens``; 1 stream (the
class's prompts one after another) and 16 at once.

Figures: decode ms/token (a stream's last token time less its first, over its tokens
less one: the prefill is the same pass either way and is left out), the ratio with/without
per round, tokens per pass from the last stage's ``spec_tokens`` / ``spec_passes``
deltas, and the texts with and without compared (they must be identical; a difference is
printed as MISMATCH). Peers on the same prompts: HF ``generate`` with and without
``prompt_lookup_num_tokens`` in this process (default model), and llama.cpp's lookup
decoding on the GGUF the default model came from where llama-cpp-python is installed
(benchmarks/llama_lookup.py; ``--skip-hf`` skips both).

With ``--model`` the 7B-shaped model (random weights): its answers are not text and
rarely repeat the prompt, so lookup's proposals are seldom accepted there; its figures
show what speculation costs when it fails, not what it gains.

    python benchmarks/speculative.py [--model default|PATH] [--tokens 64] [--rounds 3]
        [--delays 0 5 20] [--streams 1 16] [--max-draft-tokens 6] [--mode lookup|draft]
        [--peer off|auto] [--skip-local] [--skip-hosts] [--skip-hf]

Writes benchmarks/results/speculative.json (``--out``). Needs root for the test hosts.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # see benchmarks/__init__.py

import argparse
import contextlib
import re
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from benchmarks import llama_lookup
from benchmarks.http_client import RequestInput, RequestOutput, netns_socket, run, run_all
from benchmarks.links import across_hosts
from benchmarks.paired import alternate, compare, describe
from benchmarks.report import cpu_name, write_json
from benchmarks.stats import median, ms
from testbed.cluster import Cluster
from zmqllm.config.paths import default_model_dir
from zmqllm.engine.gguf_weights import gguf_source
from zmqllm.models.model_args import ModelArgs
from zmqllm.models.prepare import prepare_default_model
from zmqllm.models.tokenizer import Tokenizer

PARAGRAPH = (
    "The old lighthouse stood at the edge of the cliff for more then a hundred years. "
    "Every night its keeper climbed the ninety steps, lit the lamp and wached the ships "
    "pass safely betwen the rocks. When the town built a new harbour, the light was no "
    "longer needed, but the keeper kept climbing the steps every evening, because he "
    "beleived that someone out at sea might still be looking for it."
)
CODE = """def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    out = []
    total = 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            out.append(total / window)
    return out
"""
QUESTION = (
    "If a train leaves the station at nine in the morning and travels at sixty miles per "
    "hour for two and a half hours, how far from the station is it at half past eleven?"
)
# Answers that copy long runs of the prompt: what lookup proposes from.
REPEATING = [
    "Rewrite this paragraph with the spelling mistakes corrected, changing nothing else:"
    f"\n\n{PARAGRAPH}",
    "Add a docstring to this Python function and show the whole function again:"
    f"\n\n```python\n{CODE}```",
    f"Repeat my question word for word, then answer it.\n\nQuestion: {QUESTION}",
]
# Answers that are new text: lookup finds little to propose.
PLAIN = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain why the sky is blue to a ten year old.",
    "Give me five ideas for a birthday party in winter, one sentence each.",
]
CLASSES = {"repeating": REPEATING, "plain": PLAIN}
ARMS = ("off", "spec")  # "off": the request says "speculative": false

# The "done when" of issue 39: (place, class, streams) -> the ratio spec/off to meet.
TARGETS = [
    ("hosts-20ms", "repeating", 1, 0.5),
    ("local", "repeating", 1, 0.7),
    *((place, "plain", n, 1.05) for place in ("local", "hosts-20ms") for n in (1, 16)),
]


def decode_ms_per_token(out: RequestOutput) -> float:
    """The stream's decode time per token: its first token (the prefill's) to its last."""
    if len(out.stamps) < 2:
        return float("nan")
    return ms(out.stamps[-1] - out.stamps[0]) / (len(out.stamps) - 1)


def last_stage(status: dict[str, Any], n_layers: int) -> dict[str, Any]:
    (w,) = [w for w in status["workers"] if w["layers"][1] == n_layers]
    return w.get("stats") or {}


class Place:
    """One running cluster: how to reach its gateway and read its last stage's figures."""

    def __init__(self, name: str, request: Callable[..., RequestInput], status: Any, beat: float):
        self.name = name
        self.request = request  # (messages, max_tokens, extra) -> RequestInput
        self.status = status  # () -> the broker's status
        self.beat = beat  # heartbeat interval: how stale the figures may be


def spec_counts(place: Place, n_layers: int) -> tuple[int, int, int, int]:
    """(passes, tokens, proposed, accepted) of the last stage, once the figures of what
    just ran have come in with the heartbeats."""
    time.sleep(2.5 * place.beat)
    s = last_stage(place.status(), n_layers)
    keys = ("spec_passes", "spec_tokens", "spec_proposed", "spec_accepted")
    return tuple(int(s.get(k, 0)) for k in keys)  # type: ignore[return-value]


def measure_case(
    place: Place, a: argparse.Namespace, n_layers: int, prompts: list[str], n: int
) -> tuple[dict[str, Any], dict[str, dict[str, list[str]]]]:
    """One class of prompts at ``n`` streams, both arms in alternating rounds; the row of
    figures, and each prompt's distinct texts per arm."""
    chosen = [prompts[i % len(prompts)] for i in range(n)] if n > 1 else prompts
    per_pass: dict[str, list[float]] = {arm: [] for arm in ARMS}
    agg: dict[str, list[float]] = {arm: [] for arm in ARMS}
    acceptance: list[float] = []
    texts: dict[str, dict[str, list[str]]] = {p: {arm: [] for arm in ARMS} for p in chosen}

    def once(arm: str) -> float:
        extra = {"speculative": False} if arm == "off" else {}
        inputs = [place.request([{"role": "user", "content": p}], a.tokens, extra) for p in chosen]
        before = counts[-1]
        # One stream: the prompts one after another; else all at once.
        outs = [run(i) for i in inputs] if n == 1 else run_all(inputs)
        after = spec_counts(place, n_layers)
        counts.append(after)  # the next arm's "before": nothing runs in between
        passes, tokens, proposed, accepted = (y - x for x, y in zip(before, after, strict=True))
        if arm == "off" and passes:
            print(f"  !! {passes} speculating passes in the arm without speculation")
        per_pass[arm].append(tokens / passes if passes else 1.0)
        if arm == "spec" and proposed:
            acceptance.append(accepted / proposed)
        for prompt, o in zip(chosen, outs, strict=True):
            if o.text not in texts[prompt][arm]:
                texts[prompt][arm].append(o.text)
        wall = max(o.end for o in outs) - min(o.start for o in outs)
        agg[arm].append(sum(len(o.stamps) for o in outs) / wall)
        if n == 1:
            # Decode time over decode tokens across the class: each prompt weighs by its tokens.
            spans = sum(o.stamps[-1] - o.stamps[0] for o in outs)
            return ms(spans) / sum(len(o.stamps) - 1 for o in outs)
        return median(decode_ms_per_token(o) for o in outs)

    for p in prompts:  # warm-up: each prompt's first prefill, the kernels' first shapes
        run(place.request([{"role": "user", "content": p}], a.tokens, {}))
    counts = [spec_counts(place, n_layers)]
    values = alternate(a.rounds, ("off", lambda: once("off")), ("spec", lambda: once("spec")))
    row = compare(values, "off", "spec")
    row["tokens_per_pass"] = {arm: median(v) for arm, v in per_pass.items()}
    row["acceptance"] = median(acceptance) if acceptance else None
    row["tokens_per_s_all_streams"] = {arm: median(v) for arm, v in agg.items()}
    # Identical: one text per prompt over both arms, every round and stream.
    mismatched = [p for p, arms in texts.items() if len({*arms["off"], *arms["spec"]}) != 1]
    row["identical_texts"] = not mismatched
    print(describe(row, "off", "spec", "ms/token"))
    acc = f"{row['acceptance']:.2f}" if row["acceptance"] is not None else "-"
    print(
        f"  tokens per pass with speculation {row['tokens_per_pass']['spec']:.2f}, "
        f"proposals accepted {acc}, all streams {row['tokens_per_s_all_streams']['off']:.1f} "
        f"-> {row['tokens_per_s_all_streams']['spec']:.1f} tok/s"
    )
    if mismatched:
        print("  !!!!! MISMATCH: texts with and without speculation differ for:")
        for p in mismatched:
            print(f"    {p[:60]!r}: {texts[p]}")
    else:
        print("  texts with and without speculation identical")
    return row, texts


def measure_place(
    place: Place, a: argparse.Namespace, n_layers: int, texts: dict[str, Any]
) -> dict[str, Any]:
    """Every class and stream count on one cluster."""
    out: dict[str, Any] = {}
    for cls, prompts in CLASSES.items():
        for n in a.streams:
            print(f"\n{place.name}: {cls} prompts, {n} stream(s), {a.tokens} tokens each:")
            key = f"{cls}/{n}"
            out[key], texts.setdefault(place.name, {})[key] = measure_case(
                place, a, n_layers, prompts, n
            )
    return out


def spec_flags(a: argparse.Namespace) -> tuple[str, ...]:
    flags = ("--speculative", a.mode, "--max-draft-tokens", str(a.max_draft_tokens))
    if a.mode == "draft":  # the draft model: the default model unless told otherwise
        flags += ("--draft-model", a.draft_model or str(default_model_dir()))
    return flags


@contextlib.contextmanager
def local_place(model_dir: Path, a: argparse.Namespace) -> Iterator[Place]:
    with tempfile.TemporaryDirectory() as tmp:
        # cpu_lock: what `zmqllm up` gives the workers of one machine.
        c = Cluster(Path(tmp), model_dir, threads=a.threads, cpu_lock=True)
        try:
            # The flags on the last stage only: a draft model runs where the tokens are
            # sampled, and a stage that is not the last refuses one.
            first, last = stages(model_dir)
            c.start_broker()
            c.start_worker(first)
            c.start_worker(last, flags=spec_flags(a))
            c.start_gateway()
            c.wait_ready()

            def request(messages: list, tokens: int, extra: dict) -> RequestInput:
                return RequestInput(
                    f"{c.url}/v1/chat/completions",
                    messages=messages,
                    max_tokens=tokens,
                    ignore_eos=True,
                    temperature=0,
                    extra=extra,
                    timeout=300,
                )

            yield Place("local", request, c.status, c.heartbeat)
        finally:
            c.stop()


def stages(model_dir: Path) -> tuple[str, str]:
    (a0, b0), (a1, b1) = ModelArgs.from_dir(model_dir).stage_ranges(2)
    return f"{a0}:{b0}", f"{a1}:{b1}"


def bench_hosts(model_dir: Path, a: argparse.Namespace, texts: dict) -> dict[str, Any]:
    n_layers = ModelArgs.from_dir(model_dir).num_layers
    out: dict[str, Any] = {}
    # The testbed delays the links to the broker (its relays), not the workers' peer
    # link: with peer links the decode loop runs between hosts 2 and 3 undelayed. "off"
    # (the default here) sends every hop through the broker, so each pays the delay.
    flags = spec_flags(a) + (() if a.peer == "auto" else ("--peer", "off"))
    with across_hosts(model_dir, stages(model_dir), threads=a.threads, worker_flags=flags) as c:

        def request(messages: list, tokens: int, extra: dict) -> RequestInput:
            return RequestInput(
                "http://127.0.0.1/v1/chat/completions",
                messages=messages,
                max_tokens=tokens,
                ignore_eos=True,
                temperature=0,
                extra=extra,
                timeout=300,
                connect=lambda: netns_socket(c.http(300)),
            )

        for d in a.delays:
            c.set_delay(d)
            name = f"hosts-{d:g}ms" + ("-peer" if a.peer == "auto" else "")
            place = Place(name, request, c.status, c.heartbeat)
            out[place.name] = measure_place(place, a, n_layers, texts)
    return out


class Stamps:
    """An HF streamer that stamps each ``put`` (one pass's new tokens) after the prompt's."""

    def __init__(self) -> None:
        self.puts: list[tuple[float, int]] = []
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.puts.append((time.perf_counter(), int(value.numel())))

    def end(self) -> None:
        pass


def bench_hf(model_dir: Path, a: argparse.Namespace) -> dict[str, Any]:
    """HF ``generate`` greedy, with and without ``prompt_lookup_num_tokens``, 1 stream."""
    from transformers import MistralForCausalLM

    model = MistralForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    tok = Tokenizer.from_dir(model_dir)
    out: dict[str, Any] = {}
    for cls, prompts in CLASSES.items():
        ids = [tok.encode_chat([{"role": "user", "content": p}]) for p in prompts]
        texts: dict[str, list[list[int]]] = {}
        passes: dict[str, list[float]] = {"off": [], "spec": []}

        def once(arm: str, ids: list[list[int]] = ids, texts: dict = texts, passes=passes) -> float:
            spans, tokens, puts = 0.0, 0, 0
            got = []
            for p in ids:
                x = torch.tensor([p])
                st = Stamps()
                kw = {"prompt_lookup_num_tokens": a.max_draft_tokens} if arm == "spec" else {}
                with torch.inference_mode():
                    y = model.generate(
                        x,
                        attention_mask=torch.ones_like(x),
                        max_new_tokens=a.tokens,
                        min_new_tokens=a.tokens,
                        do_sample=False,
                        pad_token_id=0,
                        streamer=st,
                        **kw,
                    )
                got.append(y[0, len(p) :].tolist())
                spans += st.puts[-1][0] - st.puts[0][0]
                tokens += sum(k for _, k in st.puts) - st.puts[0][1]
                puts += len(st.puts) - 1
            texts.setdefault(arm, got)
            passes[arm].append(tokens / puts)
            return ms(spans) / tokens

        print(f"\nHF generate, {cls} prompts, 1 stream, {a.tokens} tokens each:")
        once("off")  # warm-up
        values = alternate(a.rounds, ("off", lambda: once("off")), ("spec", lambda: once("spec")))
        row = compare(values, "off", "spec")
        row["tokens_per_pass"] = {arm: median(v) for arm, v in passes.items()}
        row["identical_texts"] = texts["off"] == texts["spec"]
        row["texts"] = [tok.decode(t) for t in texts["off"]]
        print(describe(row, "off", "spec", "ms/token"))
        print(f"  tokens per pass with prompt lookup {row['tokens_per_pass']['spec']:.2f}")
        print("  texts identical" if row["identical_texts"] else "  !!!!! MISMATCH in HF's texts")
        out[cls] = row
    return out


def bench_llama_peer(model_dir: Path, a: argparse.Namespace) -> dict[str, Any] | str:
    """llama.cpp's lookup decoding on the GGUF behind the default model (llama_lookup.py)."""
    gguf = gguf_source(model_dir, "int4")
    if not llama_lookup.available() or gguf is None:
        why = "not installed (pip install llama-cpp-python)" if gguf else "no GGUF"
        print(f"\nllama.cpp: {why}: not measured")
        return why
    tok = Tokenizer.from_dir(model_dir)
    classes = {
        cls: [tok.encode_chat([{"role": "user", "content": p}]) for p in prompts]
        for cls, prompts in CLASSES.items()
    }
    return llama_lookup.bench_llama(gguf, classes, a)


def amx_flags() -> list[str]:
    with contextlib.suppress(OSError):
        return sorted(set(re.findall(r"\bamx\w*", Path("/proc/cpuinfo").read_text())))
    return []


def verdicts(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's "done when" ratios, each met or not, from this run's figures."""
    rows = []
    print("\ndone when (median ratio spec/off of one run):")
    for place, cls, n, limit in TARGETS:
        row = results.get("places", {}).get(place, {}).get(f"{cls}/{n}")
        if row is None:
            continue
        r = row["ratio_spec_vs_off"]
        met = r["median"] <= limit
        rows.append({"place": place, "class": cls, "streams": n, "limit": limit, **r, "met": met})
        print(
            f"  {place:>10} {cls:>9} {n:>2} stream(s): {r['median']:.3f} "
            f"({r['min']:.3f}-{r['max']:.3f}) <= {limit}: {'met' if met else 'NOT met'}"
        )
    return rows


def same_as_hf(hf: dict[str, Any], texts: dict[str, Any]) -> dict[str, str]:
    """Per place, how many 1-stream answers (without speculation) are HF greedy's text:
    the cluster computes what HF does, so both arms' figures are of the right tokens."""
    out = {}
    for place, keys in texts.items():
        same = total = 0
        for cls, prompts in CLASSES.items():
            got = keys.get(f"{cls}/1")
            if not got:
                continue
            for prompt, want in zip(prompts, hf[cls]["texts"], strict=True):
                total += 1
                same += got[prompt]["off"][:1] == [want]
        out[place] = f"{same}/{total}"
        print(f"{place}: {same}/{total} answers are HF greedy's text")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default", help='"default" or a model directory')
    ap.add_argument("--tokens", type=int, default=64, help="tokens per request (ignore_eos)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--delays", type=float, nargs="+", default=[0.0, 5.0, 20.0])
    ap.add_argument("--max-draft-tokens", type=int, default=6)
    ap.add_argument("--mode", default="lookup", choices=("lookup", "draft"))
    ap.add_argument("--draft-model", default="", help="with --mode draft (default model)")
    ap.add_argument(
        "--peer",
        default="off",
        choices=("off", "auto"),
        help="the workers' peer link across hosts (off: every hop through the delayed links)",
    )
    ap.add_argument("--skip-local", action="store_true")
    ap.add_argument("--skip-hosts", action="store_true")
    ap.add_argument(
        "--skip-hf",
        action="store_true",
        help="no HF or llama.cpp peer (they run on the default model only)",
    )
    ap.add_argument("--out", default="benchmarks/results/speculative.json")
    a = ap.parse_args()
    if a.mode == "draft" and not a.skip_hosts:
        # The test hosts' workers share one set of flags, and a stage that is not the
        # last refuses a draft model.
        ap.error("--mode draft runs on one host: add --skip-hosts")
    torch.set_num_threads(a.threads)
    default = a.model == "default"
    model_dir = prepare_default_model(default_model_dir()) if default else Path(a.model)
    print(f"{model_dir.name}, {cpu_name()}, AMX: {' '.join(amx_flags()) or 'none'}")
    if not default:
        print(
            "random weights: the answers are not text and rarely repeat the prompt, so "
            "lookup's proposals are seldom accepted; these figures show its cost, not its gain"
        )
    results: dict[str, Any] = {"places": {}, "peers": {}}
    texts: dict[str, Any] = {}
    if default and not a.skip_hf:
        results["peers"]["hf_generate"] = bench_hf(model_dir, a)
    if default and not a.skip_hf:
        results["peers"]["llama.cpp"] = bench_llama_peer(model_dir, a)
    n_layers = ModelArgs.from_dir(model_dir).num_layers
    if not a.skip_local:
        with local_place(model_dir, a) as place:
            results["places"]["local"] = measure_place(place, a, n_layers, texts)
    if not a.skip_hosts:
        results["places"].update(bench_hosts(model_dir, a, texts))
    hf = results["peers"].get("hf_generate")
    if hf:
        results["cluster_equals_hf"] = same_as_hf(hf, texts)
    results["done_when"] = verdicts(results)
    results["texts"] = texts
    meta = {
        k: getattr(a, k)
        for k in (
            "tokens",
            "rounds",
            "threads",
            "streams",
            "delays",
            "max_draft_tokens",
            "mode",
            "peer",
        )
    }
    meta.update(model=model_dir.name, cpu=cpu_name(), amx=amx_flags())
    write_json(Path(a.out), {"meta": meta, "results": results})


if __name__ == "__main__":
    main()
