"""`zmqllm worker --layers auto`: measure this machine, ask the broker which layers to load.

Before anything of the checkpoint but its config is read, the worker times a probe
(self_measure.py), then asks the broker on a connection of its own (the same keys as
its link; closed before the link opens): a few PLACE without ``hold`` time the round
trip to the broker, then one with ``hold`` and the round trip among the figures gets
the range (broker/placement.py says how it is chosen). The worker then loads that range
and registers with the figures, which `zmqllm status` shows.
"""

from __future__ import annotations

import statistics
import sys
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import zmq

from zmqllm.bus.keys import PeerKeys, as_client
from zmqllm.bus.messages import MAX_STATUS_BYTES, Place, Placed, Refused
from zmqllm.bus.protocol import MAX_FRAMES, decode, encode
from zmqllm.bus.sockets import recv_bounded
from zmqllm.bus.wire_types import ProtocolError
from zmqllm.config.loading import with_overrides
from zmqllm.config.paths import worker_served_name
from zmqllm.config.settings import Config
from zmqllm.config.weighted_split import Figures
from zmqllm.log import get_logger
from zmqllm.models.model_args import ModelArgs
from zmqllm.worker.broker_link import WorkerRefused
from zmqllm.worker.self_measure import measure, measure_dir

__all__ = ["PLACE_TIMEOUT_S", "RTT_PROBES", "ask_placement", "placed_config", "placement_failed"]

log = get_logger("zmqllm.worker")

PLACE_TIMEOUT_S = 30.0  # for each answer: a broker still starting gets this long
RTT_PROBES = 3


def _ask(sock: zmq.Socket[Any], msg: Place, timeout: float) -> Placed:
    sock.send_multipart(encode(msg))
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        if not sock.poll(int(left * 1000) + 1):
            break
        frames = recv_bounded(sock, MAX_FRAMES)
        try:
            reply = decode(frames, max_payload_bytes=MAX_STATUS_BYTES) if frames else None
        except ProtocolError:
            continue
        if isinstance(reply, Refused):
            raise WorkerRefused(reply.reason)
        if isinstance(reply, Placed) and reply.request_id == msg.request_id:
            return reply
    raise TimeoutError(f"no answer to --layers auto from the broker within {timeout:g}s")


def ask_placement(
    address: str,
    keys: PeerKeys | None,
    served: str,
    num_layers: int,
    figures: Figures,
    timeout: float = PLACE_TIMEOUT_S,
) -> tuple[Placed, Figures]:
    """The range the broker at ``address`` gives a worker of these figures, and the
    figures with the round trip to it measured."""
    ctx: zmq.Context[Any] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_STATUS_BYTES)
        if keys is not None:
            as_client(sock, keys)
        sock.connect(address)
        trips: list[float] = []
        for hold in [False] * RTT_PROBES + [True]:
            if hold:
                figures = replace(figures, rtt_ms=round(statistics.median(trips[1:]), 3))
            msg = Place(
                request_id=uuid.uuid4().hex,
                served=served,
                num_layers=num_layers,
                figures=figures.to_dict(),
                hold=hold,
            )
            t = time.perf_counter()
            placed = _ask(sock, msg, timeout)
            # The first trip also makes the connection (and the CURVE handshake).
            trips.append((time.perf_counter() - t) * 1000)
        return placed, figures
    finally:
        sock.close(linger=0)
        ctx.term()


def placed_config(cfg: Config, keys: PeerKeys | None) -> tuple[Config, Figures]:
    """``cfg`` with the layers the broker gives this worker, and what it measured."""
    directory: Path = measure_dir(cfg)
    num_layers = ModelArgs.from_dir(directory).num_layers
    t = time.perf_counter()
    figures = measure(cfg, directory)
    probe_s = time.perf_counter() - t
    served = worker_served_name(cfg)
    placed, figures = ask_placement(cfg.worker.broker, keys, served, num_layers, figures)
    layers = f"{placed.start}:{placed.end}"
    log.info(
        "layers placed by the broker",
        layers=layers,
        why=placed.why,
        probe_s=round(probe_s, 2),
        **figures.to_dict(),
    )
    return with_overrides(cfg, "worker", {"layers": layers}), figures


def placement_failed(exc: WorkerRefused | TimeoutError) -> int:
    """Say once in the log and once on stderr why no range was placed; the exit status
    (3: the broker refused, e.g. no range fits this worker's memory; 1: no answer)."""
    if isinstance(exc, WorkerRefused):
        log.error("refused by the broker", reason=str(exc))
        print(f"zmqllm worker: refused by the broker: {exc}", file=sys.stderr)
        return 3
    log.error("no placement", reason=str(exc))
    print(f"zmqllm worker: {exc}", file=sys.stderr)
    return 1
