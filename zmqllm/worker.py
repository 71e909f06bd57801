"""The worker process: a DEALER to the broker around one pipeline :class:`Stage`.

Loop: take everything ready on the socket, run one batched forward, send the
results, heartbeat. A broker that stops answering (or restarts) is detected
Paranoid-Pirate style and the worker registers again by itself, with backoff.
SIGTERM drains (no new sessions, finish the running ones, then exit); SIGINT
or a second SIGTERM exits at once.
"""

from __future__ import annotations

import fcntl
import math
import os
import signal
import socket
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import zmq

from zmqllm import __version__
from zmqllm.config import Config, parse_layers, resolve_model_path
from zmqllm.engine import native
from zmqllm.model_args import ModelArgs
from zmqllm.engine.cache import CacheFullError
from zmqllm.engine.frames import payload_to_tensor, tensor_to_payload
from zmqllm.engine.generator import load_shard
from zmqllm.sampling_params import SamplingParams
from zmqllm.engine.stage import Output, Stage, rss_bytes
from zmqllm.engine.weights import model_fingerprint, resolve_checkpoint
from zmqllm.log import bind_request, get_logger
from zmqllm.protocol import Header, MsgType, Payload, ProtocolError, decode, encode, error_header

log = get_logger("zmqllm.worker")

RECONNECT_MAX_S = 30.0
MAX_MESSAGES_PER_TURN = 1024
# cpu_lock: how often a waiting stage looks at the lock, and the quiet time after
# which no more results of another stage's forward are on their way (they come
# worker -> broker -> worker, one message per session, ~0.25 ms apart when the
# broker and gateway share two cores with the workers).
LOCK_POLL_S = 0.001
HOP_GRACE_S = 0.003
# The results of one forward bound for the same next worker form a group, and
# each of their messages says so ("group": [id, size]); a stage waits for the rest
# of a group it has seen part of for at most this long after the last one came
# (a broker or gateway descheduled for a few ms must not split the batch).
GROUP_WAIT_S = 0.025
MAX_GROUPS = 64
# A stage polling the lock for its turn might never see it free if others let go
# only for an instant between forwards: past this, it blocks on the lock instead.
# (Past its own wait bound it keeps the lock as soon as it sees it free, so this
# is only the last resort.)
LOCK_WAIT_MAX_S = 2.0


class WorkerRefused(RuntimeError):
    """The broker refused this worker (different model or version)."""


@dataclass
class Loaded:
    stage: Stage
    fingerprint: dict[str, Any]
    start: int
    end: int
    num_layers: int
    context: int


def load_stage(cfg: Config) -> Loaded:
    """Resolve the checkpoint, read only this shard's tensors, warm it up."""
    w = cfg.worker
    if w.threads:
        torch.set_num_threads(w.threads)
    spec = resolve_model_path(cfg.model.path)

    def layer_range(args: ModelArgs) -> tuple[int, int]:
        return parse_layers(w.layers, args.num_layers)

    # From the Hub: config first, then only the files holding this range's tensors.
    directory = resolve_checkpoint(spec, layer_range, cfg.model.revision)
    args = ModelArgs.from_dir(directory)
    start, end = layer_range(args)

    t0 = time.perf_counter()
    shard = load_shard(directory, start, end, cfg.model.dtype, cfg.model.device, args)
    kernel = shard.use_kernel(native.load()) if w.native_attention else False
    # Resident growth, not the packed tensors' sizes: MKL's buffers are allocated
    # larger than they are filled.
    rss = rss_bytes()
    packed = shard.pack(w.packed_rows)
    packed_mib = (rss_bytes() - rss) >> 20 if packed else 0
    stage = Stage(shard, w.max_sessions, w.max_kv_tokens, w.prefill_chunk, w.max_memory_mb)
    stage.warmup()
    log.info(
        "shard loaded",
        layers=f"{start}:{end}",
        parameters=shard.num_parameters(),
        seconds=round(time.perf_counter() - t0, 2),
        dtype=cfg.model.dtype,
        device=cfg.model.device,
        batched_decode_attention="compiled kernel" if kernel else "pytorch",
        packed_weights_mib=packed_mib,
    )
    fp = model_fingerprint(directory, args, cfg.model.dtype)
    return Loaded(stage, fp, start, end, args.num_layers, args.max_position_embeddings)


class Worker:
    def __init__(self, cfg: Config, loaded: Loaded, context: zmq.Context | None = None) -> None:
        self.cfg = cfg
        self.loaded = loaded
        self.stage = loaded.stage
        self.ctx = context or zmq.Context.instance()
        name = cfg.worker.name or f"{socket.gethostname()}-{os.getpid()}"
        self.identity = f"w-{name}-{loaded.start}-{loaded.end}-{uuid.uuid4().hex[:6]}"
        self.interval = cfg.broker.heartbeat_interval
        self.horizon = cfg.broker.heartbeat_interval * cfg.broker.heartbeat_liveness
        self.sock: zmq.Socket | None = None
        self.registered = False
        self.draining = False
        self._stop = False
        self._last_broker = 0.0
        self._next_beat = 0.0
        self._backoff = self.interval
        self._boot: str | None = None
        self._threads = cfg.worker.threads or torch.get_num_threads()
        self._batch_threads = cfg.worker.batch_threads
        self._threads_now = torch.get_num_threads()
        self._cpu_lock: int | None = None
        if cfg.worker.cpu_lock:
            Path(cfg.worker.cpu_lock).parent.mkdir(parents=True, exist_ok=True)
            self._cpu_lock = os.open(cfg.worker.cpu_lock, os.O_RDWR | os.O_CREAT, 0o644)
        self._lock_busy_at = 0.0  # when another stage was last seen holding cpu_lock
        self._held_at: float | None = None  # we hold cpu_lock while results come in
        self._last_work_at = 0.0  # when the last untagged STEP or ACTIVATION arrived
        # Groups seen in part: id -> [size, arrived, last arrival] (see GROUP_WAIT_S).
        self._groups: dict[str, list[Any]] = {}

    # -- signals ---------------------------------------------------------------
    def on_sigterm(self, *_: object) -> None:
        if self.draining:
            self._stop = True
        else:
            self.draining = True
            log.info(
                "draining: no new sessions; exiting when the running ones finish",
                sessions=len(self.stage.sessions),
            )

    def on_sigint(self, *_: object) -> None:
        self._stop = True

    # -- socket ----------------------------------------------------------------
    def connect(self) -> None:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt_string(zmq.IDENTITY, self.identity)
        sock.setsockopt(zmq.SNDHWM, 10000)
        sock.setsockopt(zmq.RCVHWM, 10000)
        sock.setsockopt(zmq.MAXMSGSIZE, self.cfg.broker.max_message_bytes)
        sock.connect(self.cfg.worker.broker)
        self.sock = sock
        self.registered = False
        self._last_broker = time.monotonic()
        self.send_register()

    def send(self, header: Header, payloads: list[Payload] | None = None) -> None:
        assert self.sock is not None
        try:
            self.sock.send_multipart(encode(header, payloads or []), copy=False, flags=zmq.NOBLOCK)
        except zmq.Again:
            log.warning("send queue to the broker is full; message dropped", type=header.type.value)

    def send_register(self) -> None:
        ld = self.loaded
        info = {
            "fingerprint": ld.fingerprint,
            "max_kv_tokens": self.stage.pool.max_tokens,
            "context": ld.context,
            "dtype": self.cfg.model.dtype,
            "device": self.cfg.model.device,
            "host": socket.gethostname(),
            "pid": os.getpid(),
        }
        fields = {
            "start": ld.start,
            "end": ld.end,
            "num_layers": ld.num_layers,
            "capacity": self.stage.pool.max_sessions,
            "version": __version__,
            "fingerprint": ld.fingerprint["digest"],
            "info": info,
        }
        self.send(Header(MsgType.REGISTER, fields=fields))

    def reconnect(self, why: str) -> None:
        log.warning(
            "reconnecting to the broker",
            reason=why,
            backoff_s=round(self._backoff, 2),
            dropped_sessions=len(self.stage.sessions),
        )
        self.stage.reset()
        if self.sock is not None:
            self.sock.close(linger=0)
        time.sleep(self._backoff)
        self._backoff = min(self._backoff * 2, RECONNECT_MAX_S)
        self.connect()

    # -- main loop -------------------------------------------------------------
    def run(self) -> int:
        self.connect()
        log.info(
            "worker started",
            worker=self.identity,
            broker=self.cfg.worker.broker,
            layers=f"{self.loaded.start}:{self.loaded.end}",
        )
        try:
            while not self._stop:
                busy = self.stage.has_work()
                wait = self._coalesce_wait() if busy else 0.0
                if busy and not wait:
                    timeout = 0.0
                elif busy:
                    timeout = min(wait, max(0.0, self._next_beat - time.monotonic()))
                else:
                    timeout = max(0.0, self._next_beat - time.monotonic())
                assert self.sock is not None
                if self.sock.poll(math.ceil(timeout * 1000) + (0 if busy else 1), zmq.POLLIN):
                    self.drain_socket()
                if self.stage.has_work() and not self._coalesce_wait():
                    self.run_batch()
                elif self._held_at is not None and not self.stage.has_work():
                    self._release_turn()  # the sessions we waited with were closed
                now = time.monotonic()
                if now >= self._next_beat:
                    self.heartbeat(now)
                if self.draining and not self.stage.sessions:
                    log.info("drained; leaving")
                    self._stop = True
        except WorkerRefused as exc:
            log.error("refused by the broker", reason=str(exc))
            return 3
        finally:
            self.close()
        return 0

    def close(self) -> None:
        if self.sock is not None:
            if self.registered:
                self.send(Header(MsgType.DISCONNECT, fields={"reason": "worker shutting down"}))
            self.sock.close(linger=0)
            self.sock = None
        log.info("worker stopped")

    def heartbeat(self, now: float) -> None:
        self._next_beat = now + self.interval
        if now - self._last_broker > self.horizon:
            self.reconnect(f"no word from the broker for {now - self._last_broker:.1f}s")
            return
        if not self.registered:
            # A REGISTER is already on its way on this socket. Sending another makes the
            # broker see a restarted worker and fail the sessions it routed here after the
            # first; if the broker never answers, the liveness check above reconnects.
            return
        load = dict(self.stage.load(), draining=self.draining)
        self.send(Header(MsgType.HEARTBEAT, fields={"load": load}))

    def drain_socket(self) -> None:
        assert self.sock is not None
        for _ in range(MAX_MESSAGES_PER_TURN):
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._last_broker = time.monotonic()
            try:
                header, payloads = decode(frames)
            except ProtocolError as exc:
                log.warning("malformed message dropped", error=str(exc))
                continue
            try:
                self.handle(header, payloads)
            except WorkerRefused:
                raise
            except Exception:  # one bad message must not stop the worker
                log.exception("error handling message", type=header.type.value)

    def handle(self, h: Header, payloads: list[Payload]) -> None:
        t = h.type
        if t is MsgType.ACTIVATION:
            self._note_arrival(h.fields.get("group"))
            self.on_activation(h, payloads)
        elif t is MsgType.STEP:
            self._note_arrival(h.fields.get("group"))
            if not self.stage.step(h.session, h.step, h.fields["token"]):
                log.debug("step for an unknown session dropped", session=h.session)
        elif t is MsgType.OPEN:
            self.on_open(h, payloads)
        elif t in (MsgType.CLOSE, MsgType.CANCEL):
            if self.stage.close(h.session):
                with bind_request(h.request_id, h.session):
                    log.info("session closed", reason=t.value)
        elif t is MsgType.HEARTBEAT:
            boot = h.fields.get("boot")
            # Unregistered, a REGISTER is already pending: one is enough (see heartbeat).
            if (
                self.registered
                and self._boot is not None
                and boot is not None
                and boot != self._boot
            ):
                self.registered = False
                self.stage.reset()
                self.send_register()
        elif t is MsgType.REGISTERED:
            self.registered = True
            self._backoff = self.interval
            self._boot = h.fields.get("boot")
            log.info("registered with the broker", worker=h.fields["worker_id"])
        elif t is MsgType.REFUSED:
            raise WorkerRefused(h.fields["reason"])
        elif t is MsgType.DISCONNECT:
            if not self.registered:
                # It answers a message sent before our pending REGISTER (e.g. a second
                # heartbeat in flight to a restarted broker): that REGISTER suffices.
                return
            log.warning("broker asked to register again", reason=h.fields["reason"])
            self.registered = False
            self.stage.reset()
            self.send_register()
        else:
            log.warning("unexpected message dropped", type=t.value)

    def on_open(self, h: Header, payloads: list[Payload]) -> None:
        with bind_request(h.request_id, h.session):
            f = h.fields
            if self.draining:
                self.send(error_header("full", "worker is draining", h.session, h.request_id))
                return
            try:
                sampling = SamplingParams.from_dict(f["sampling"])
                sampling.validate()
                prompt = None
                if self.stage.shard.is_first:
                    if len(payloads) != 1 or payloads[0].dtype != "int32":
                        raise ValueError("stage 0 needs the prompt as one int32 payload")
                    prompt = payloads[0].array
                    if (
                        prompt.size == 0
                        or int(prompt.max()) >= self.stage.shard.args.vocab_size
                        or int(prompt.min()) < 0
                    ):
                        raise ValueError("prompt token ids must be in [0, vocab_size)")
                state = self.stage.open(
                    h.session,
                    h.request_id,
                    int(f["max_len"]),
                    f["max_tokens"],
                    sampling,
                    frozenset(int(x) for x in f["stop_ids"]),
                    prompt,
                )
                # Where this session's results go next (absent from older brokers).
                state.next_hop = str(f.get("next", ""))
            except CacheFullError as exc:
                self.send(error_header("full", str(exc), h.session, h.request_id))
                return
            except (ValueError, KeyError, TypeError) as exc:
                self.send(error_header("bad_request", str(exc), h.session, h.request_id))
                return
            log.info("session opened", max_len=f["max_len"], stage=f.get("stage"))

    def on_activation(self, h: Header, payloads: list[Payload]) -> None:
        shard = self.stage.shard
        if shard.is_first or len(payloads) != 1:
            log.warning("activation dropped: wrong stage or payload count", session=h.session)
            return
        p = payloads[0]
        if p.array.ndim != 2 or p.array.shape[1] != shard.args.hidden_size:
            log.warning("activation dropped: wrong shape", shape=list(p.array.shape))
            return
        hidden = payload_to_tensor(p, shard.device)
        if not self.stage.activation(h.session, h.step, hidden, bool(h.fields.get("final", True))):
            log.debug("activation for an unknown session dropped", session=h.session)

    def _note_arrival(self, group: Any) -> None:
        """Count a STEP or ACTIVATION towards its group; untagged ones restart the
        quiet time (HOP_GRACE_S) instead. A malformed tag is treated as none."""
        now = time.monotonic()
        if not (
            isinstance(group, list)
            and len(group) == 2
            and isinstance(group[0], str)
            and isinstance(group[1], int)
            and not isinstance(group[1], bool)
        ):
            self._last_work_at = now
            return
        gid, size = group
        g = self._groups.get(gid)
        if g is None:
            if len(self._groups) >= MAX_GROUPS:  # groups that never completed (cancels)
                self._groups = {k: v for k, v in self._groups.items() if v[2] + GROUP_WAIT_S > now}
            g = self._groups[gid] = [size, 0, now]
        g[1] += 1
        g[2] = now
        if g[1] >= g[0]:
            del self._groups[gid]

    def _coalesce_wait(self) -> float:
        """Only stages taking turns on shared cores (cpu_lock) wait to batch more.

        While another stage holds the lock we could not compute anyway: wait, and
        take in what arrives (this time does not count against the stage's bound, or
        a long prefill elsewhere would make us run a fraction of the sessions just
        before the rest come back). Once it lets go, its results for our missing
        sessions are one hop through the broker away, one message per session: wait
        HOP_GRACE_S for the first, then for the rest of every group seen in part
        (GROUP_WAIT_S after the last arrival at most), or, for untagged messages,
        until none has come for HOP_GRACE_S. Within the stage's own bound that wait
        leaves the lock free (the other stage may need a turn to send us its
        sessions); past it, the stage keeps the lock while it waits (GROUP_WAIT_S at
        most), or a third worker sharing the cores could take it back before every
        grace ends, again and again. Two stages waiting for each other's sessions
        both run once that is over.
        """
        if self._cpu_lock is None or not self.stage.others_pending():
            return 0.0
        now = time.monotonic()
        if self._held_at is None:
            try:
                fcntl.flock(self._cpu_lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # another stage is computing
                self._lock_busy_at = now
                if now - self.stage.oldest_ready() > LOCK_WAIT_MAX_S:
                    return 0.0  # queue on the lock like any forward (see LOCK_WAIT_MAX_S)
                return LOCK_POLL_S
            if self.stage.coalesce_wait(now):
                fcntl.flock(self._cpu_lock, fcntl.LOCK_UN)
            else:
                self._held_at = now
        limit = self.stage.coalesce_wait(now, since=self._lock_busy_at)
        if self._held_at is not None:
            limit = min(limit, self._held_at + GROUP_WAIT_S - now)
        wait = max(self._lock_busy_at, self._last_work_at) + HOP_GRACE_S - now
        for size, arrived, last in self._groups.values():
            if arrived < size:
                wait = max(wait, last + GROUP_WAIT_S - now)
        return min(limit, wait) if wait > 0 and limit > 0 else 0.0

    def _release_turn(self) -> None:
        assert self._cpu_lock is not None
        fcntl.flock(self._cpu_lock, fcntl.LOCK_UN)
        self._held_at = None

    def _tag_groups(self, outputs: list[Output]) -> list[list[Any] | None]:
        """[group id, size] per output that travels on (None: a final token)."""
        gid = f"{self.identity}/{self.stage.stats.forwards}"
        hops: list[str | None] = []
        for o in outputs:
            if o.token is not None and o.finish is not None:
                hops.append(None)  # the broker ends it here: no STEP follows
                continue
            s = self.stage.sessions.get(o.session)
            hops.append(s.next_hop if s is not None else "")
        sizes = Counter(h for h in hops if h is not None)
        return [None if h is None else [f"{gid}/{h}", sizes[h]] for h in hops]

    def _pick_threads(self) -> None:
        """One session in flight: stages take turns, so each may use every core. Several:
        all stages compute at once, and sharing cores they need their batch_threads."""
        want = self._threads
        if self._batch_threads and len(self.stage.sessions) > 1:
            want = self._batch_threads
        if want != self._threads_now:
            torch.set_num_threads(want)
            self._threads_now = want

    def run_batch(self) -> None:
        self._pick_threads()
        if self._cpu_lock is not None:
            # Our turn on the shared cores (already ours if we kept it while waiting).
            fcntl.flock(self._cpu_lock, fcntl.LOCK_EX)
        try:
            outputs = self.stage.run()
        except Exception as exc:
            log.exception("forward failed; failing its sessions")
            for sid in list(self.stage.sessions):
                s = self.stage.sessions[sid]
                self.send(error_header("internal", f"forward failed: {exc}", sid, s.request_id))
                self.stage.close(sid)
            return
        finally:
            if self._cpu_lock is not None:
                self._release_turn()
        for sid, rid, reason in self.stage.failed:
            log.warning("session failed", session=sid, request_id=rid, reason=reason)
            self.send(error_header("internal", reason, sid, rid))
            self.stage.close(sid)
        self.stage.failed.clear()
        for o, group in zip(outputs, self._tag_groups(outputs), strict=True):
            fields: dict[str, Any] = {}
            if group is not None:
                fields["group"] = group
            if o.token is not None:
                fields.update(token=o.token, finish=o.finish)
                self.send(Header(MsgType.TOKEN, o.session, o.request_id, o.step, fields))
            else:
                assert o.hidden is not None
                fields["final"] = o.final
                self.send(
                    Header(MsgType.ACTIVATION, o.session, o.request_id, o.step, fields),
                    [tensor_to_payload(o.hidden)],
                )


def serve(cfg: Config) -> int:
    loaded = load_stage(cfg)
    worker = Worker(cfg, loaded)
    signal.signal(signal.SIGTERM, worker.on_sigterm)
    signal.signal(signal.SIGINT, worker.on_sigint)
    return worker.run()
