"""The ``zmqllm`` command line: one sub-command per role.

Heavy imports (torch, transformers) happen inside the sub-commands that need
them, so ``zmqllm --help`` and the front-end roles start without the ML stack.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from zmqllm.bus.keys_cli import add_keys_command
from zmqllm.client.ticket_cli import add_ticket_command
from zmqllm.config.flags import add_setting_flags, apply_flags
from zmqllm.config.loading import kv_dtype_of, load_config
from zmqllm.config.paths import default_model_dir, resolve_model_path, worker_served_name
from zmqllm.config.settings import QUANTS, Config, ConfigError
from zmqllm.launch.split import add_plan_command
from zmqllm.log import configure_logging
from zmqllm.version import __version__
from zmqllm.worker.measure_cli import add_measure_command


def _model_dir(spec: str, prepare: bool = True) -> Path:
    """Resolve "default"/"tiny"/a directory; prepare the default model on first use."""
    path = Path(resolve_model_path(spec))
    if prepare and path == default_model_dir():
        from zmqllm.models.prepare import is_prepared, prepare_default_model

        if not is_prepared(path):
            prepare_default_model(path)
    return path


def cmd_prepare_model(ns: argparse.Namespace) -> int:
    from zmqllm.models.prepare import prepare_default_model, prepare_tiny_model

    if ns.random:
        from zmqllm.models.random_model import prepare_random_model

        if not ns.output:
            print("zmqllm prepare-model: --random needs --output DIR", file=sys.stderr)
            return 2
        try:
            path = prepare_random_model(
                Path(ns.output), ns.random, ns.layers, ns.seed, gguf=not ns.no_gguf
            )
        except ValueError as exc:
            print(f"zmqllm prepare-model: {exc}", file=sys.stderr)
            return 2
    elif ns.tiny:
        path = prepare_tiny_model(Path(ns.tiny), seed=ns.seed, sharded=ns.sharded)
    else:
        path = prepare_default_model(Path(ns.output) if ns.output else default_model_dir())
    # Last line of stdout is the directory, so scripts can capture it.
    print(path)
    return 0


def cmd_generate(ns: argparse.Namespace) -> int:
    import torch

    from zmqllm.bus.sampling_params import SamplingParams
    from zmqllm.engine.generator import GenerationStats, Generator
    from zmqllm.models.tokenizer import Tokenizer

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
        from zmqllm.models.model_args import ModelArgs

        args = ModelArgs.from_dir(model_dir)
        bounds = args.stage_ranges(ns.stages)
    if ns.quant != "none" and (ns.dtype != "float32" or ns.device != "cpu"):
        print("zmqllm generate: --quant needs --dtype float32 on the cpu", file=sys.stderr)
        return 2
    gen = Generator(model_dir, bounds, dtype=ns.dtype, device=ns.device, quant=ns.quant)
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
    stats = GenerationStats()
    stop_ids = sorted(tok.eos_token_ids)
    for token in gen.generate(ids, max_tokens, params, stop_ids=stop_ids, stats=stats):
        if token in tok.eos_token_ids:
            continue  # the last one: generate ends after it (and completes the stats)
        piece = decoder.push(token)
        if piece:
            out.write(piece)
            out.flush()
    out.write(decoder.flush() + "\n")
    out.flush()
    if ns.stats:
        # Decode time per token after the first (the first comes with the prefill).
        per = stats.decode_s / max(1, stats.generated_tokens - 1) * 1e3
        print(
            f"prompt {stats.prompt_tokens} tokens, prefill {stats.prefill_s * 1e3:.1f} ms; "
            f"{stats.generated_tokens} tokens, decode {per:.2f} ms/token",
            file=sys.stderr,
        )
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
    p.add_argument(
        "--quant",
        default="none",
        choices=QUANTS,
        help="int8 or int4 matmul weights (see `zmqllm worker --help`)",
    )
    p.add_argument("--stats", action="store_true", help="timings on stderr at the end")
    p.add_argument("--stages", type=int, default=1, help="split into N shards in-process")
    p.set_defaults(func=cmd_generate)


def _add_prepare(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "prepare-model",
        help="convert the default model (SmolLM2-135M-Instruct) once; print its directory",
    )
    p.add_argument("--tiny", metavar="DIR", help="write a tiny random test model to DIR instead")
    p.add_argument("--sharded", action="store_true", help="tiny: split weights over files")
    p.add_argument(
        "--random",
        metavar="KIND",
        choices=["mistral-7b"],
        help="write random weights of a real geometry (mistral-7b) to --output, "
        "as bf16 safetensors and as Q4_1 and BF16 GGUF files",
    )
    p.add_argument("--layers", type=int, help="random: this many of the geometry's layers")
    p.add_argument("--no-gguf", action="store_true", help="random: no GGUF files")
    p.add_argument("--seed", type=int, default=0, help="tiny and random: random seed")
    p.add_argument("--output", metavar="DIR", help="write here (default model: instead)")
    p.set_defaults(func=cmd_prepare_model)


# -- roles --------------------------------------------------------------------


def _load(ns: argparse.Namespace) -> Config:
    """The config file (if any), then what a ticket gives (--join), then the role's
    command-line flags on top."""
    if getattr(ns, "stage", None):  # a worker's --stage K/N is --layers K/N
        if ns.layers:
            raise ConfigError("give --layers or --stage, not both")
        ns.layers = ns.stage
    cfg = load_config(ns.config)
    if ns.command in ("worker", "gateway"):  # --join, or the file's join: client/join.py
        value = ns.join if ns.join is not None else getattr(cfg, ns.command).join
        ns.join = None  # what the ticket gives stands, not the ticket
        if value:
            from zmqllm.client.join import joined_config

            cfg = joined_config(cfg, value, "worker" if ns.command == "worker" else "client")
    return apply_flags(cfg, ns.command, ns)


def cmd_broker(ns: argparse.Namespace) -> int:
    from zmqllm.broker.main import serve

    cfg = _load(ns)
    configure_logging("broker", cfg.log.level, cfg.log.format)
    serve(cfg.broker, cfg.security)
    return 0


# OpenMP threads that finished a parallel region spin for a while before they
# sleep. Pipeline stages sharing cores then steal each other's CPU right when the
# next stage starts (the README's per-token latency section has the figure).
# A short spin keeps a busy stage's speed and frees the cores within microseconds.
WORKER_THREAD_ENV = {"GOMP_SPINCOUNT": "10000", "KMP_BLOCKTIME": "0"}


def cmd_worker(ns: argparse.Namespace) -> int:
    import os

    cfg = _load(ns)
    configure_logging("worker", cfg.log.level, cfg.log.format)
    if cfg.worker.discover:  # the broker's address by mDNS, checked against its key
        from zmqllm.bus.discovery import discovered_config

        cfg = discovered_config(cfg, worker_served_name(cfg))
    if cfg.worker.remote:
        # A whole model behind an HTTP API: no torch, no model files.
        from zmqllm.remote.main import serve as serve_remote

        return serve_remote(cfg)
    worker_served_name(cfg)  # a name the bus cannot carry is told before the model loads
    kv_dtype_of(cfg.worker.kv_dtype, cfg.model.dtype)  # and a cache dtype it cannot keep
    for key, value in WORKER_THREAD_ENV.items():
        os.environ.setdefault(key, value)  # before torch (and its OpenMP) loads
    from zmqllm.engine.draft import DraftModelError
    from zmqllm.engine.memory_plan import StageDoesNotFit
    from zmqllm.log import get_logger
    from zmqllm.worker.main import serve

    drafts = cfg.worker.speculative == "draft"
    for spec in (cfg.model.path, *([cfg.worker.draft_model] if drafts else [])):
        if resolve_model_path(spec) == str(default_model_dir()):
            _model_dir(spec)  # convert the default model on first use
    try:
        return serve(cfg)
    except (StageDoesNotFit, DraftModelError) as exc:
        # Refused before the weights load: said once in the log, once on stderr.
        what = "stage does not fit" if isinstance(exc, StageDoesNotFit) else "draft model refused"
        get_logger("zmqllm.worker").error(what, reason=str(exc))
        print(f"zmqllm worker: {exc}", file=sys.stderr)
        return 2


def cmd_gateway(ns: argparse.Namespace) -> int:
    from zmqllm.gateway.main import serve

    return serve(_load(ns))


def cmd_status(ns: argparse.Namespace) -> int:
    from zmqllm.bus.keys import keys_dir, load_peer_keys
    from zmqllm.bus.messages import SessionError
    from zmqllm.client.node_view import (
        drift_lines,
        format_children,
        format_drift,
        format_resources,
    )
    from zmqllm.client.status import fetch_status, format_status
    from zmqllm.config.paths import log_dir
    from zmqllm.config.up_state import STATE_ENV, STATE_FILE, read_state
    from zmqllm.log import printable

    def show(text: str, err: bool = False) -> None:
        # Names, builds and reasons in a status are what peers sent: no escapes get through
        # to the terminal (JSON escapes control characters by itself).
        print(printable(text, keep_newlines=True), file=sys.stderr if err else sys.stdout)

    cfg = _load(ns)
    folder = keys_dir(cfg.security)
    keys = load_peer_keys(folder, "client") if folder is not None else None
    # The children of this machine's `zmqllm up`, if one runs with this config's log folder.
    up = read_state(os.environ.get(STATE_ENV) or log_dir(cfg.log) / STATE_FILE)
    try:  # --broker is [gateway] broker: the frontend a gateway would connect to
        status = fetch_status(cfg.gateway.broker, timeout=ns.timeout, keys=keys)
    except (TimeoutError, SessionError) as exc:  # no answer, or an error / unreadable one
        show(f"zmqllm status: {exc}", err=True)
        if up is not None:
            show(format_children(up), err=True)
        return 1
    if up is not None:
        status["up"] = up
    if ns.drift:  # for scripts and CI: only the differences, and 1 when there are any
        drift = status.get("drift") or []
        show(json.dumps(drift, indent=2) if ns.json else format_drift(status))
        return 1 if drift_lines(status) else 0
    if ns.json:
        show(json.dumps(status, indent=2))
    else:
        show(format_status(status))
        show("\n" + format_resources(status))
        show("\n" + format_drift(status))
        if up is not None:
            show("\n" + format_children(up))
    return 0


def cmd_up(ns: argparse.Namespace) -> int:
    from zmqllm.launch.launcher import run_up

    return run_up(ns)


def _role(
    sub: argparse._SubParsersAction, name: str, help: str, func: Callable[[argparse.Namespace], int]
) -> argparse.ArgumentParser:
    """A role's parser: --config, then a flag for every setting the role takes."""
    p: argparse.ArgumentParser = sub.add_parser(name, help=help)
    p.add_argument("--config", metavar="FILE", help="TOML config file (see configs/)")
    add_setting_flags(p, name)
    p.set_defaults(func=func)
    return p


def _add_roles(sub: argparse._SubParsersAction) -> None:
    _role(sub, "broker", "route messages between gateways and workers", cmd_broker)

    p = _role(
        sub,
        "worker",
        "serve a range of the model's layers, or (--remote URL) a model behind an HTTP API",
        cmd_worker,
    )
    p.add_argument(
        "--stage", metavar="K/N", help='stage K of N, of about equal cost (--layers "K/N")'
    )

    _role(sub, "gateway", "the HTTP API (/chat, OpenAI-compatible /v1)", cmd_gateway)

    p = _role(sub, "status", "workers, pools, routes and queue of a running broker", cmd_status)
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument(
        "--drift",
        action="store_true",
        help="print only the build fields on which replicas of a pool differ; exit 1 if any",
    )
    p.add_argument("--timeout", type=float, default=3.0, metavar="S", help="wait for an answer")

    _add_ray(sub)

    p = _role(sub, "up", "start broker, workers and gateway on this machine", cmd_up)
    p.add_argument(
        "--ready-timeout", type=float, default=600.0, metavar="S", help="wait for /ready"
    )


def cmd_ray(ns: argparse.Namespace) -> int:
    from zmqllm.onray.commands import run_ray

    return run_ray(ns)


def _add_ray(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("ray", help="run the roles as actors on a Ray cluster (zmqllm[ray])")
    ray_sub = p.add_subparsers(dest="ray_command", required=True, metavar="RAY_COMMAND")
    for name, help in (
        ("up", "start broker, workers and gateway as detached actors; return once ready"),
        ("status", "every actor: its state, node, restarts, and its role running or failing"),
        ("down", "stop every actor and remove the stages' placement group"),
    ):
        q = ray_sub.add_parser(name, help=help)
        q.add_argument("--config", metavar="FILE", help="TOML config file (see configs/)")
        add_setting_flags(q, "ray")
        q.set_defaults(func=cmd_ray, command="ray")
        if name == "status":
            q.add_argument("--json", action="store_true", help="print JSON instead of a table")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zmqllm", description="Serve a Mistral LLM split across processes over ZeroMQ."
    )
    parser.add_argument("--version", action="version", version=f"zmqllm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_prepare(sub)
    _add_generate(sub)
    add_keys_command(sub)
    add_ticket_command(sub)
    _add_roles(sub)
    add_measure_command(sub, add_setting_flags, WORKER_THREAD_ENV)
    add_plan_command(sub, add_setting_flags)
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
