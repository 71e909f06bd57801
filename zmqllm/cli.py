"""The ``zmqllm`` command line: one sub-command per role.

Heavy imports (torch, transformers) happen inside the sub-commands that need
them, so ``zmqllm --help`` and the front-end roles start without the ML stack.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from zmqllm import __version__
from zmqllm.config import (
    Config,
    ConfigError,
    default_model_dir,
    load_config,
    resolve_model_path,
    with_overrides,
)
from zmqllm.log import configure_logging


def _model_dir(spec: str, prepare: bool = True) -> Path:
    """Resolve "default"/"tiny"/a directory; prepare the default model on first use."""
    path = Path(resolve_model_path(spec))
    if prepare and path == default_model_dir():
        from zmqllm.models import is_prepared, prepare_default_model

        if not is_prepared(path):
            prepare_default_model(path)
    return path


def cmd_prepare_model(ns: argparse.Namespace) -> int:
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
    from zmqllm.sampling_params import SamplingParams
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
        from zmqllm.model_args import ModelArgs

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


# -- roles --------------------------------------------------------------------


def _load(ns: argparse.Namespace, overrides: dict[str, dict[str, object]]) -> Config:
    """The config file (if any) with the command-line flags applied on top."""
    cfg = load_config(ns.config)
    for section, values in overrides.items():
        cfg = with_overrides(cfg, section, values)
    return with_overrides(cfg, "log", {"level": ns.log_level, "format": ns.log_format})


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="TOML config file (see configs/)")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    p.add_argument("--log-format", choices=["auto", "json", "console"])


def _beats(ns: argparse.Namespace) -> dict[str, object]:
    return {
        "heartbeat_interval": ns.heartbeat_interval,
        "heartbeat_liveness": ns.heartbeat_liveness,
    }


def _beat_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--heartbeat-interval", type=float, metavar="S")
    p.add_argument("--heartbeat-liveness", type=int, metavar="N")


def cmd_broker(ns: argparse.Namespace) -> int:
    from zmqllm.broker import serve

    broker = dict(
        frontend=ns.frontend,
        backend=ns.backend,
        queue_size=ns.queue_size,
        queue_timeout=ns.queue_timeout,
        **_beats(ns),
    )
    cfg = _load(ns, {"broker": broker})
    configure_logging("broker", cfg.log.level, cfg.log.format)
    serve(cfg.broker)
    return 0


# OpenMP threads that finished a parallel region spin for a while before they
# sleep. Pipeline stages sharing cores then steal each other's CPU right when the
# next stage starts (measured: +9 ms per hop on 2 cores with libgomp's default).
# A short spin keeps a busy stage's speed and frees the cores within microseconds.
WORKER_THREAD_ENV = {"GOMP_SPINCOUNT": "10000", "KMP_BLOCKTIME": "0"}


def cmd_worker(ns: argparse.Namespace) -> int:
    import os

    for key, value in WORKER_THREAD_ENV.items():
        os.environ.setdefault(key, value)  # before torch (and its OpenMP) loads
    from zmqllm.worker import serve

    layers = ns.layers
    if ns.stage:
        if layers:
            raise ConfigError("give --layers or --stage, not both")
        layers = ns.stage
    worker = dict(
        broker=ns.broker,
        layers=layers,
        threads=ns.threads,
        batch_threads=ns.batch_threads,
        cpu_lock=ns.cpu_lock,
        max_sessions=ns.max_sessions,
        max_kv_tokens=ns.max_kv_tokens,
        max_memory_mb=ns.max_memory_mb,
        prefill_chunk=ns.prefill_chunk,
        name=ns.name,
    )
    model = dict(path=ns.model, dtype=ns.dtype, device=ns.device, revision=ns.revision)
    cfg = _load(ns, {"worker": worker, "model": model, "broker": _beats(ns)})
    configure_logging("worker", cfg.log.level, cfg.log.format)
    if resolve_model_path(cfg.model.path) == str(default_model_dir()):
        _model_dir(cfg.model.path)  # convert the default model on first use
    return serve(cfg)


def cmd_gateway(ns: argparse.Namespace) -> int:
    from zmqllm.gateway.server import serve

    gateway = dict(
        host=ns.host,
        port=ns.port,
        broker=ns.broker,
        max_concurrent=ns.max_concurrent,
        max_queued=ns.max_queued,
        queue_timeout=ns.queue_timeout,
        first_token_timeout=ns.first_token_timeout,
        inter_token_timeout=ns.inter_token_timeout,
    )
    model = dict(path=ns.model, name=ns.model_name)
    cfg = _load(ns, {"gateway": gateway, "model": model, "broker": _beats(ns)})
    serve(cfg)
    return 0


def cmd_status(ns: argparse.Namespace) -> int:
    from zmqllm.messages import SessionError
    from zmqllm.status import fetch_status, format_status

    cfg = _load(ns, {})
    address = ns.broker or cfg.gateway.broker
    try:
        status = fetch_status(address, timeout=ns.timeout)
    except (TimeoutError, SessionError) as exc:  # no answer, or an error / unreadable one
        print(f"zmqllm status: {exc}", file=sys.stderr)
        return 1
    if ns.json:
        print(json.dumps(status, indent=2))
    else:
        print(format_status(status))
    return 0


def cmd_up(ns: argparse.Namespace) -> int:
    from zmqllm.launcher import run_up

    return run_up(ns)


def _add_roles(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("broker", help="route messages between gateways and workers")
    _common(p)
    p.add_argument("--frontend", metavar="ADDR", help="for gateways (tcp://127.0.0.1:5555)")
    p.add_argument("--backend", metavar="ADDR", help="for workers (tcp://127.0.0.1:5556)")
    p.add_argument("--queue-size", type=int)
    p.add_argument("--queue-timeout", type=float, metavar="S")
    _beat_flags(p)
    p.set_defaults(func=cmd_broker)

    p = sub.add_parser("worker", help="serve a range of the model's layers")
    _common(p)
    p.add_argument("--model", help='model directory, Hub repo id, "default" or "tiny"')
    p.add_argument("--revision", help="Hub revision")
    p.add_argument("--layers", help='half-open layer range, e.g. "0:15"')
    p.add_argument("--stage", metavar="K/N", help='stage K of N, layers split evenly, e.g. "1/2"')
    p.add_argument("--device", help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--broker", metavar="ADDR", help="the broker's backend (tcp://HOST:5556)")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument(
        "--batch-threads",
        type=int,
        help="torch threads while several sessions are in flight (stages sharing cores)",
    )
    p.add_argument(
        "--cpu-lock",
        metavar="FILE",
        help="lock file shared by the workers of one machine: forwards take turns",
    )
    p.add_argument("--max-sessions", type=int)
    p.add_argument("--max-kv-tokens", type=int)
    p.add_argument("--max-memory-mb", type=int, help="refuse sessions past this memory use")
    p.add_argument("--prefill-chunk", type=int, metavar="TOKENS")
    p.add_argument("--name", help="a name for logs and status")
    _beat_flags(p)
    p.set_defaults(func=cmd_worker)

    p = sub.add_parser("gateway", help="the HTTP API (/chat, OpenAI-compatible /v1)")
    _common(p)
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--broker", metavar="ADDR", help="the broker's frontend (tcp://HOST:5555)")
    p.add_argument("--model", help="where the tokenizer and config come from")
    p.add_argument("--model-name", help="the model name clients ask for")
    p.add_argument("--max-concurrent", type=int, help="generations at once; more wait in the queue")
    p.add_argument("--max-queued", type=int, help="requests waiting for a slot; past it: 429")
    p.add_argument("--queue-timeout", type=float, metavar="S", help="longest wait in the queue")
    p.add_argument("--first-token-timeout", type=float, metavar="S")
    p.add_argument("--inter-token-timeout", type=float, metavar="S")
    _beat_flags(p)
    p.set_defaults(func=cmd_gateway)

    p = sub.add_parser("status", help="workers, pools, routes and queue of a running broker")
    _common(p)
    p.add_argument("--broker", metavar="ADDR", help="the broker's frontend (tcp://HOST:5555)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--timeout", type=float, default=3.0)
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("up", help="start broker, workers and gateway on this machine")
    _common(p)
    p.add_argument("--port", type=int, help="gateway port (default from the config: 8080)")
    p.add_argument("--model", help='model directory, Hub repo id, "default" or "tiny"')
    p.add_argument("--log-dir", metavar="DIR", help="where each process writes its log")
    p.add_argument("--ready-timeout", type=float, default=600.0, metavar="S")
    p.set_defaults(func=cmd_up)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zmqllm", description="Serve a Mistral LLM split across processes over ZeroMQ."
    )
    parser.add_argument("--version", action="version", version=f"zmqllm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_prepare(sub)
    _add_generate(sub)
    _add_roles(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        return int(ns.func(ns))
    except KeyboardInterrupt:
        return 130
    except ConfigError as exc:
        print(f"zmqllm {ns.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
