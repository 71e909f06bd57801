"""Grammar libraries for constrained decoding, measured on this CPU with the default
model's tokenizer (49,152 tokens): llguidance, xgrammar and outlines-core.

For each JSON schema (and for "any JSON object", what ``json_object`` asks for): the time
to compile it against the vocabulary, then the time per token to compute the mask of
allowed tokens and advance, walking the tokens of a valid document. The last stage
computes one mask per sampled token, so the mask time adds to every token's latency.

    python benchmarks/grammar_libs.py [--repeats 5]

Each library is optional (``pip install llguidance xgrammar outlines-core``); one that
is missing or fails is reported as such. Writes benchmarks/results/grammar_libs.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # see benchmarks/__init__.py

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.report import write_json
from benchmarks.stats import median
from zmqllm.config.paths import default_model_dir
from zmqllm.models.prepare import prepare_default_model

SCHEMAS: dict[str, tuple[dict[str, Any] | None, Any]] = {
    "json_object": (None, {"name": "Ada", "tags": ["math", "engines"], "age": 36}),
    "flat": (
        {
            "type": "object",
            "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
            "required": ["city", "population"],
            "additionalProperties": False,
        },
        {"city": "Lyon", "population": 522969},
    ),
    "nested_enum": (
        {
            "type": "object",
            "properties": {
                "title": {"type": "string"},
                "rating": {"type": "integer", "minimum": 1, "maximum": 5},
                "genre": {"enum": ["drama", "comedy", "horror"]},
                "cast": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "name": {"type": "string"},
                            "lead": {"type": "boolean"},
                        },
                        "required": ["name", "lead"],
                        "additionalProperties": False,
                    },
                },
            },
            "required": ["title", "rating", "genre", "cast"],
            "additionalProperties": False,
        },
        {
            "title": "The Lighthouse",
            "rating": 4,
            "genre": "drama",
            "cast": [{"name": "Ann", "lead": True}, {"name": "Bo", "lead": False}],
        },
    ),
}


def byte_vocab(hf: Any) -> list[bytes]:
    """Each token id's bytes (byte-level BPE: the GPT-2 character map undone)."""
    # GPT-2's map: printable bytes stand for themselves, the other 68 bytes for the
    # characters from U+0100 on, in byte order.
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    shifted = [b for b in range(256) if b not in printable]
    back = {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(shifted)}
    out = []
    for i in range(len(hf)):
        piece = hf.convert_ids_to_tokens(i)
        try:
            out.append(bytes(back[c] for c in piece))
        except KeyError:  # a special token: its text as it is
            out.append(piece.encode())
    return out


class Lib:
    """compile(schema) -> state; then per token: mask(state), advance(state, token)."""

    compile: Callable[[dict[str, Any] | None], Any]
    mask: Callable[[Any], Any]
    advance: Callable[[Any, int], Any]


def llguidance_lib(hf: Any, vocab: int) -> Lib:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    tok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)
    lib = Lib()

    def compile_(schema: dict[str, Any] | None) -> Any:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema if schema is not None else {"type": "object"}
        )
        m = llguidance.LLMatcher(tok, grammar)
        return m, llguidance.torch.allocate_token_bitmask(1, vocab)

    lib.compile = compile_
    lib.mask = lambda st: llguidance.torch.fill_next_token_bitmask(st[0], st[1], 0)
    lib.advance = lambda st, t: st[0].consume_token(t)
    return lib


def xgrammar_lib(hf: Any, vocab: int) -> Lib:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    lib = Lib()

    def compile_(schema: dict[str, Any] | None) -> Any:
        g = (
            compiler.compile_builtin_json_grammar()
            if schema is None
            else compiler.compile_json_schema(json.dumps(schema))
        )
        return xgr.GrammarMatcher(g), xgr.allocate_token_bitmask(1, vocab)

    lib.compile = compile_
    lib.mask = lambda st: st[0].fill_next_token_bitmask(st[1])
    lib.advance = lambda st, t: st[0].accept_token(t)
    return lib


def outlines_lib(hf: Any, vocab: int) -> Lib:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    pieces: dict[bytes, list[int]] = {}
    eos = hf.convert_tokens_to_ids("<|im_end|>")
    for i, b in enumerate(byte_vocab(hf)):
        if i != eos:
            pieces.setdefault(b, []).append(i)
    voc = Vocabulary(eos, pieces)
    lib = Lib()

    def compile_(schema: dict[str, Any] | None) -> Any:
        if schema is None:  # outlines-core has no "any JSON": a free object of scalars
            schema = {"type": "object", "additionalProperties": True}
        return Guide(Index(build_regex_from_schema(json.dumps(schema)), voc))

    lib.compile = compile_
    lib.mask = lambda g: g.get_tokens()
    lib.advance = lambda g, t: g.advance(t)
    return lib


def measure(lib: Lib, schema: dict[str, Any] | None, ids: list[int], repeats: int) -> dict:
    compiles, per_token = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        state = lib.compile(schema)
        compiles.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for t in ids:
            lib.mask(state)
            lib.advance(state, t)
        per_token.append((time.perf_counter() - t0) / len(ids))
    return {
        "compile_ms": round(median(compiles) * 1e3, 2),
        "compile_ms_range": [round(min(compiles) * 1e3, 2), round(max(compiles) * 1e3, 2)],
        "mask_us_per_token": round(median(per_token) * 1e6, 1),
        "mask_us_range": [round(min(per_token) * 1e6, 1), round(max(per_token) * 1e6, 1)],
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--repeats", type=int, default=5, help="compiles and walks per schema")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args()
    from transformers import PreTrainedTokenizerFast

    model = default_model_dir()
    prepare_default_model(model)
    hf = PreTrainedTokenizerFast(tokenizer_file=str(model / "tokenizer.json"))
    vocab = len(hf)
    results: dict[str, Any] = {"vocab": vocab, "threads": torch.get_num_threads(), "libs": {}}
    for name, make in (
        ("llguidance", llguidance_lib),
        ("xgrammar", xgrammar_lib),
        ("outlines-core", outlines_lib),
    ):
        try:
            t0 = time.perf_counter()
            lib = make(hf, vocab)
            setup = time.perf_counter() - t0
        except Exception as exc:  # not installed, or its API moved
            results["libs"][name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            print(f"{name:14s} unavailable: {exc}")
            continue
        row: dict[str, Any] = {"tokenizer_setup_ms": round(setup * 1e3, 1)}
        for sname, (schema, doc) in SCHEMAS.items():
            ids = hf.encode(json.dumps(doc))
            try:
                row[sname] = measure(lib, schema, ids, args.repeats)
            except Exception as exc:
                row[sname] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            r = row[sname]
            if "error" in r:
                print(f"{name:14s} {sname:12s} failed: {r['error']}")
            else:
                print(
                    f"{name:14s} {sname:12s} compile {r['compile_ms']:9.2f} ms  "
                    f"mask+advance {r['mask_us_per_token']:8.1f} us/token "
                    f"({r['mask_us_range'][0]}-{r['mask_us_range'][1]})"
                )
        print(f"{name:14s} tokenizer setup {row['tokenizer_setup_ms']} ms")
        results["libs"][name] = row
    write_json(args.out / "grammar_libs.json", results)


if __name__ == "__main__":
    main()
