"""The ``zmqllm`` command line: one sub-command per role.

Heavy imports (torch, transformers) happen inside the sub-commands that need
them, so ``zmqllm --help`` and the front-end roles start without the ML stack.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from zmqllm import __version__


def _model_dir(spec: str, prepare: bool = True) -> Path:
    """Resolve "default"/"tiny"/a directory; prepare the default model on first use."""
    from zmqllm.config import default_model_dir, resolve_model_path

    path = Path(resolve_model_path(spec))
    if prepare and path == default_model_dir():
        from zmqllm.models import is_prepared, prepare_default_model

        if not is_prepared(path):
            prepare_default_model(path)
    return path


def cmd_prepare_model(ns: argparse.Namespace) -> int:
    from zmqllm.config import default_model_dir
    from zmqllm.models import prepare_default_model, prepare_tiny_model

    if ns.tiny:
        path = prepare_tiny_model(Path(ns.tiny), seed=ns.seed, sharded=ns.sharded)
    else:
        path = prepare_default_model(Path(ns.output) if ns.output else default_model_dir())
    # Last line of stdout is the directory, so scripts can capture it.
    print(path)
    return 0


def cmd_generate(ns: argparse.Namespace) -> int:
    import torch

    from zmqllm.config import split_layers
    from zmqllm.engine.generator import Generator
    from zmqllm.engine.sampling import SamplingParams
    from zmqllm.tokenizer import Tokenizer

    if ns.threads:
        torch.set_num_threads(ns.threads)
    model_dir = _model_dir(ns.model)
    tok = Tokenizer.from_dir(model_dir)
    text = " ".join(ns.prompt)
    if not text.strip():
        print("zmqllm generate: the prompt is empty", file=sys.stderr)
        return 2
    if ns.raw:
        ids = tok.encode(text, add_special_tokens=True)
    else:
        ids = tok.encode_chat([{"role": "user", "content": text}])
    params = SamplingParams(
        temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k, seed=ns.seed
    )
    try:
        params.validate()
    except ValueError as exc:
        print(f"zmqllm generate: {exc}", file=sys.stderr)
        return 2
    bounds = None
    if ns.stages > 1:
        from zmqllm.engine.args import ModelArgs

        bounds = split_layers(ModelArgs.from_dir(model_dir).num_layers, ns.stages)
    gen = Generator(model_dir, bounds, dtype=ns.dtype, device=ns.device)
    context = gen.args.max_position_embeddings
    max_tokens = ns.max_tokens
    if len(ids) >= context:
        print(
            f"zmqllm generate: the prompt has {len(ids)} tokens, the context is {context}",
            file=sys.stderr,
        )
        return 2
    max_tokens = min(max_tokens, context - len(ids))
    decoder = tok.incremental_decoder()
    out = sys.stdout
    for token in gen.generate(ids, max_tokens, params, stop_ids=sorted(tok.eos_token_ids)):
        if token in tok.eos_token_ids:
            break
        piece = decoder.push(token)
        if piece:
            out.write(piece)
            out.flush()
    out.write(decoder.flush() + "\n")
    out.flush()
    return 0


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text with the whole model in this process")
    p.add_argument("prompt", nargs="+", help="the user message (or raw text with --raw)")
    p.add_argument("--model", default="default", help='model directory, "default" or "tiny"')
    p.add_argument("--raw", action="store_true", help="no chat template: continue the text")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--stages", type=int, default=1, help="split into N shards in-process")
    p.set_defaults(func=cmd_generate)


def _add_prepare(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "prepare-model",
        help="convert the default model (SmolLM2-135M-Instruct) once; print its directory",
    )
    p.add_argument("--tiny", metavar="DIR", help="write a tiny random test model to DIR instead")
    p.add_argument("--sharded", action="store_true", help="tiny: split weights over files")
    p.add_argument("--seed", type=int, default=0, help="tiny: random seed")
    p.add_argument("--output", metavar="DIR", help="default model: write here instead")
    p.set_defaults(func=cmd_prepare_model)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zmqllm", description="Serve a Mistral LLM split across processes over ZeroMQ."
    )
    parser.add_argument("--version", action="version", version=f"zmqllm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_prepare(sub)
    _add_generate(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        return int(ns.func(ns))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
