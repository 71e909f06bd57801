"""llama.cpp's prompt lookup decoding, a peer of benchmarks/speculative.py.

llama-cpp-python's ``LlamaPromptLookupDecoding`` (its ``draft_model``: the next tokens
after the latest earlier match of the text's last tokens, verified in one batch) against
the same ``Llama`` without it, on the GGUF the default model was converted from (Q4_1),
greedy, the same chat prompt ids as the cluster and HF, one stream, in alternating rounds.
Figures as speculative.py's: decode ms/token (a prompt's last token time less its first,
over its tokens less one), the ratio with/without per round, tokens per pass (tokens over
the model's ``eval`` calls after the prompt's), and whether the texts are identical.

It runs in a child process: on some AMX machines ggml's AMX buffer type faults in
``ldtilecfg`` on a batch of more than one token, which every lookup pass is. A child that
dies of a signal is run again with the model parameter ``use_extra_bufts`` false, and the
result says so.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # see benchmarks/__init__.py

import importlib.util
import json
import subprocess
import time
from typing import Any

from benchmarks.paired import alternate, compare, describe
from benchmarks.stats import median, ms

ARMS = ("off", "spec")


def available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def _llama(gguf: str, threads: int, ctx: int, lookup: int, extra_bufts: bool) -> Any:
    import llama_cpp.llama_cpp as lib
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    if not extra_bufts:  # Llama() takes no such argument: its model parameters' default
        defaults = lib.llama_model_default_params

        def params() -> Any:
            p = defaults()
            p.use_extra_bufts = False
            return p

        lib.llama_model_default_params = params
    return Llama(
        gguf,
        n_threads=threads,
        n_threads_batch=threads,
        n_ctx=ctx,
        n_batch=512,
        verbose=False,
        draft_model=LlamaPromptLookupDecoding(num_pred_tokens=lookup) if lookup else None,
    )


def _measure(job: dict[str, Any]) -> dict[str, Any]:
    """In the child: both arms on each class's prompts, ``rounds`` rounds."""
    ctx = max(len(p) for ids in job["classes"].values() for p in ids) + job["tokens"] + 32
    models = {
        arm: _llama(job["gguf"], job["threads"], ctx, most, job["extra_bufts"])
        for arm, most in (("off", 0), ("spec", job["max_draft_tokens"]))
    }
    evals = {arm: 0 for arm in ARMS}
    for arm, llm in models.items():
        inner = llm.eval

        def counted(tokens: Any, arm: str = arm, inner: Any = inner) -> None:
            evals[arm] += 1
            inner(tokens)

        llm.eval = counted
    out: dict[str, Any] = {}
    for cls, prompts in job["classes"].items():
        texts: dict[str, list[list[int]]] = {}
        passes: dict[str, list[float]] = {arm: [] for arm in ARMS}

        def once(
            arm: str, prompts: list[list[int]] = prompts, texts: dict = texts, passes: dict = passes
        ) -> float:
            llm = models[arm]
            spans, tokens, calls, got = 0.0, 0, 0, []
            for ids in prompts:
                llm.reset()
                stamps: list[float] = []
                answer: list[int] = []
                evals[arm] = 0
                for token in llm.generate(ids, top_k=1, temp=0.0, reset=True):
                    if not stamps:
                        calls -= evals[arm]  # the prompt's eval calls
                    stamps.append(time.perf_counter())
                    answer.append(int(token))
                    if len(answer) == job["tokens"]:
                        break
                calls += evals[arm]
                spans += stamps[-1] - stamps[0]
                tokens += len(answer) - 1
                got.append(answer)
            texts.setdefault(arm, got)
            passes[arm].append(tokens / max(calls, 1))
            return ms(spans) / tokens

        print(f"\nllama.cpp (Q4_1), {cls} prompts, 1 stream, {job['tokens']} tokens each:")
        once("off")  # warm-up
        once("spec")
        values = alternate(job["rounds"], *((arm, lambda arm=arm: once(arm)) for arm in ARMS))
        row = compare(values, "off", "spec")
        row["tokens_per_pass"] = {arm: median(v) for arm, v in passes.items()}
        row["identical_texts"] = texts["off"] == texts["spec"]
        print(describe(row, "off", "spec", "ms/token"))
        print(f"  tokens per pass with lookup {row['tokens_per_pass']['spec']:.2f}")
        print("  texts identical" if row["identical_texts"] else "  texts differ")
        out[cls] = row
    return out


def bench_llama(gguf: Path, classes: dict[str, list[list[int]]], a: Any) -> dict[str, Any] | str:
    """Both arms in a child process (see the module's text); a string says why not."""
    job = {
        "gguf": str(gguf),
        "classes": classes,
        "tokens": a.tokens,
        "rounds": a.rounds,
        "threads": a.threads,
        "max_draft_tokens": a.max_draft_tokens,
        "extra_bufts": True,
    }
    for extra_bufts in (True, False):
        job["extra_bufts"] = extra_bufts
        child = subprocess.run(
            [sys.executable, __file__],
            input=json.dumps(job),
            capture_output=True,
            text=True,
            check=False,
        )
        lines = child.stdout.splitlines()
        print("\n".join(lines[:-1]))
        if child.returncode == 0:
            result = json.loads(lines[-1])
            result["use_extra_bufts"] = extra_bufts
            return result
        why = child.stderr.strip().splitlines()[-1:] or [f"exit {child.returncode}"]
        if child.returncode >= 0 or not extra_bufts:
            return f"llama.cpp failed: {why[0]}"
        print(
            f"\nllama.cpp died of signal {-child.returncode} (ggml's AMX buffer type on a "
            "batch of more than one token): run again with use_extra_bufts=False"
        )
    return "llama.cpp failed"


if __name__ == "__main__":
    print(json.dumps(_measure(json.loads(sys.stdin.read()))))
