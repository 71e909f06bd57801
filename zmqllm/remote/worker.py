"""A remote worker: a whole model served by forwarding to an OpenAI-compatible API.

``zmqllm worker --remote URL`` registers a *text* model (no layers, no torch, no model
files). Its sessions arrive as ASK (the request's messages or prompt and sampling fields,
JSON) and their answers leave as DELTAs, one per upstream chunk. It is an application on
the worker shell (``worker.shell``: identity, the broker link with its registration,
heartbeats and reconnection, signals, the loop, message dispatch), as the pipeline worker
is; here, instead of the engine, an asyncio loop in a thread of its own runs one
upstream stream per session (``upstream.Upstream``).

Messages cross between the two through ``outbox`` (the stream tasks append, the loop
sends); CLOSE, CANCEL and a broker reset cancel the session's task, which closes its
upstream connection. The upstream key (read from its file by ``main.py``, which starts
this worker) goes only to the upstream, never to a log nor into REGISTER.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import os
import platform
import threading
from collections import deque
from typing import Any

import zmq

from zmqllm.bus.ask_body import AskBodyError, ask_fields, upstream_body
from zmqllm.bus.keys import PeerKeys
from zmqllm.bus.messages import (
    MAX_CONTEXT,
    MAX_DELTA,
    Ask,
    AskKind,
    Delta,
    Error,
    ErrorCode,
    Message,
    Register,
)
from zmqllm.bus.protocol import PROTOCOL_VERSION
from zmqllm.bus.wire_types import ProtocolError, SessionKey
from zmqllm.config.settings import Config
from zmqllm.log import bind_request, get_logger
from zmqllm.remote.upstream import Upstream, UpstreamError, UpstreamSettings, shown_url
from zmqllm.version import __version__
from zmqllm.worker.shell import (
    IDLE_POLL_S,
    MAX_MESSAGES_PER_TURN,
    Handler,
    WorkerShell,
    host_name,
)

__all__ = ["RemoteWorker", "register_message"]

log = get_logger("zmqllm.worker")

# While streams run the loop looks at the outbox this often: a delta waits at most this
# long for the socket (the loop cannot be woken by the other thread's append).
BUSY_POLL_S = 0.002
MAX_KV_TOKENS = 1 << 40  # nothing to hold here: capacity is counted in sessions
# ErrorCode for each UpstreamError code; anything else is an upstream error.
UPSTREAM_CODES = {
    "bad_request": ErrorCode.BAD_REQUEST,
    "busy": ErrorCode.BUSY,
    "timeout": ErrorCode.TIMEOUT,
    "upstream_error": ErrorCode.UPSTREAM_ERROR,
}


def register_message(upstream: UpstreamSettings, served: str, capacity: int) -> Register:
    """What this worker tells the broker it is: never the upstream's URL nor its key."""
    return Register(
        start=0,
        end=1,
        num_layers=1,
        capacity=capacity,
        max_kv_tokens=MAX_KV_TOKENS,
        context=MAX_CONTEXT,
        version=__version__,
        # Replicas of one upstream model agree, whatever URL each one calls.
        fingerprint=f"remote:{upstream.model}"[:128],
        model={"remote_model": upstream.model[:256]},
        host=host_name(),
        pid=os.getpid(),
        device="remote",
        served=served,
        text_model=True,
        build={
            "zmqllm": __version__,
            "protocol": PROTOCOL_VERSION,
            "python": platform.python_version(),
            "device": "remote",
        },
    )


class RemoteWorker(WorkerShell):
    """A whole text model behind an OpenAI-compatible API, on the worker shell."""

    tells_unencodable = True
    kind = "remote worker"

    def __init__(
        self,
        cfg: Config,
        upstream: UpstreamSettings,
        served: str,
        context: zmq.Context[Any] | None = None,
        keys: PeerKeys | None = None,
    ) -> None:
        self.served = served
        self.capacity = cfg.worker.max_sessions
        self.outbox: deque[tuple[SessionKey, Message | _Forget]] = deque()
        self.tasks: dict[SessionKey, concurrent.futures.Future[None]] = {}
        register = register_message(upstream, served, self.capacity)
        super().__init__(cfg, "remote", register, context=context, keys=keys)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="upstream", daemon=True)
        self.upstream = Upstream(upstream)

    def message_handlers(self) -> dict[type[Message], Handler]:
        return {Ask: self.on_ask}

    # -- the loop ----------------------------------------------------------------------
    def sessions(self) -> int:
        return len(self.tasks)

    def close_session(self, key: SessionKey) -> bool:
        future = self.tasks.pop(key, None)
        if future is None:
            return False
        future.cancel()  # the task closes its upstream stream
        return True

    def drop_sessions(self) -> None:
        for future in self.tasks.values():
            future.cancel()
        self.tasks.clear()

    def heartbeat_figures(self) -> dict[str, Any]:
        return {"sessions": len(self.tasks)}

    def run(self) -> int:
        self._thread.start()
        self.link.start()
        log.info(
            "remote worker started",
            worker=self.identity,
            broker=self.cfg.worker.broker,
            model=self.served,
            # Not the URL itself: it may carry a password, or a key in its query.
            upstream=shown_url(self.upstream.settings.url),
            curve=self.link.settings.keys is not None,
        )
        return self.run_turns()

    def _turn(self) -> None:
        self.tend_link()
        with self.link.lock:
            # Pumped on every turn, without waiting when there is work: streams that keep
            # the outbox full must not keep CLOSEs unread and heartbeats unsent (the
            # keeper seldom gets the lock from a loop that takes it back at once).
            busy = self.link.inbox or self.outbox
            self.link.pump(0.0 if busy else BUSY_POLL_S if self.tasks else IDLE_POLL_S)
            self.drain_inbox()
            self.flush_outbox()

    def close(self) -> None:
        for future in list(self.tasks.values()):
            future.cancel()
        self.link.stop()
        if self._thread.is_alive():
            closing = asyncio.run_coroutine_threadsafe(self.upstream.aclose(), self.loop)
            try:
                closing.result(timeout=5)
            except Exception as exc:
                log.debug("upstream client not closed cleanly", error=str(exc))
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=5)
        log.info("worker stopped")

    # -- from the broker ---------------------------------------------------------------
    def unhandled(self, msg: Message) -> None:
        # A worker of layers' messages (OPEN, STEP, ...) mean nothing here.
        self.fail(msg, ErrorCode.BAD_REQUEST, f"a remote worker takes no {msg.TYPE.value}")

    def on_ask(self, msg: Ask) -> None:
        key = SessionKey.of(msg)
        with bind_request(msg.request_id, msg.session):
            if key in self.tasks:
                return  # a duplicate: the first one runs
            if self.draining or len(self.tasks) >= self.capacity:
                self.fail(msg, ErrorCode.FULL, "remote worker has no room")
                return
            try:
                body = upstream_body(msg.kind, ask_fields(msg), msg.max_tokens)
            except (AskBodyError, ProtocolError) as exc:
                self.fail(msg, ErrorCode.BAD_REQUEST, str(exc), "bad_request")
                return
            log.info("session opened", kind=msg.kind.value, max_tokens=msg.max_tokens)
            coro = self._stream(key, msg, body)
            future = asyncio.run_coroutine_threadsafe(coro, self.loop)
            self.tasks[key] = future
            future.add_done_callback(functools.partial(self._done, key))

    def _done(self, key: SessionKey, future: concurrent.futures.Future[None]) -> None:
        # On the upstream thread (or the broker loop's, for a cancel): the broker loop
        # forgets the session once it has sent what the task left in the outbox before
        # this mark. The mark names its task: the key may be taken anew meanwhile.
        if self.tasks.get(key) is future:
            self.outbox.append((key, _Forget(future)))

    # -- to the broker -----------------------------------------------------------------
    def flush_outbox(self) -> None:
        for _ in range(MAX_MESSAGES_PER_TURN):
            if not self.outbox:
                return
            key, msg = self.outbox.popleft()
            if isinstance(msg, _Forget):
                if self.tasks.get(key) is msg.future:
                    del self.tasks[key]
            elif key in self.tasks:  # closed meanwhile: nothing more is sent for it
                self.send(msg, key)

    # -- one session, on the upstream thread -------------------------------------------
    async def _stream(self, key: SessionKey, ask: Ask, body: dict[str, Any]) -> None:
        # The task runs in a context of its own, not on_ask's: bound here, every line it
        # logs (the upstream client's too) names its request.
        with bind_request(ask.request_id, ask.session):
            await self._answer(key, ask, body)

    async def _answer(self, key: SessionKey, ask: Ask, body: dict[str, Any]) -> None:
        def out(msg: Message) -> None:
            self.outbox.append((key, msg))

        def piece_of(step: int, **fields: Any) -> Delta:
            return Delta(
                session=ask.session,
                attempt=ask.attempt,
                request_id=ask.request_id,
                step=step,
                **fields,
            )

        kind = "chat" if ask.kind is AskKind.CHAT else "completion"
        step, finish = 0, None
        usage: tuple[int | None, int | None] = (None, None)
        try:
            pieces = self.upstream.stream(kind, body)
            # An upstream that does not stop at max_tokens is stopped here, by the fewest
            # tokens its text can be: never by its pieces, which may be a character each.
            tokens = TokenFloor()
            most_tokens = ask.max_tokens + TOKENS_MARGIN
            most_chars = ask.max_tokens * MAX_CHARS_PER_TOKEN + CHARS_MARGIN
            async with contextlib.aclosing(pieces):
                async for piece in pieces:
                    if piece.prompt_tokens is not None or piece.completion_tokens is not None:
                        usage = (_count(piece.prompt_tokens), _count(piece.completion_tokens))
                    tokens.add(piece.text, usage[1])
                    # Only text can be held back: a count after the last text cuts nothing.
                    over = tokens.least > most_tokens or tokens.chars > most_chars
                    if piece.text and over:
                        log.warning(
                            "upstream went past max_tokens; its answer cut",
                            max_tokens=ask.max_tokens,
                            tokens_at_least=tokens.least,
                            chars=tokens.chars,
                        )
                        finish = "length"
                        break
                    for start in range(0, len(piece.text), MAX_DELTA):
                        out(piece_of(step, text=piece.text[start : start + MAX_DELTA]))
                        step += 1
                    finish = piece.finish or finish
            # The finish goes last, with the usage that came after it.
            out(
                piece_of(
                    step,
                    finish=(finish or "stop")[:32],
                    prompt_tokens=usage[0],
                    completion_tokens=usage[1],
                )
            )
            log.info("session finished", finish=finish, pieces=step + 1)
        except UpstreamError as exc:
            code = UPSTREAM_CODES.get(exc.code, ErrorCode.UPSTREAM_ERROR)
            log.warning("upstream failed; session failed", code=code.value, status=exc.status)
            out(Error.of(code, exc.message, ask.session, **_ids(ask)))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.faults.report("internal", "upstream stream failed", exc)
            out(Error.of(ErrorCode.INTERNAL, "internal error in the remote worker", **_sid(ask)))


# An upstream's answer past its max_tokens: a few tokens of slack (some servers count a
# token or two more than they were asked for), and at most this much text a token (the
# longest tokens of real vocabularies are under 128 characters).
TOKENS_MARGIN = 16
MAX_CHARS_PER_TOKEN = 128
CHARS_MARGIN = 4096


class TokenFloor:
    """The fewest tokens an answer's text so far can be, without the upstream's tokenizer:
    a token at least for each word (the tokenizers in use split text at whitespace before
    merging, so no token holds parts of two words), and the upstream's own count when it
    sends one along the way. However the text is cut into pieces, the count is the same."""

    def __init__(self) -> None:
        self.words = self.chars = self.reported = 0
        self._in_word = False  # the text so far ends inside a word

    @property
    def least(self) -> int:
        return max(self.words, self.reported)

    def add(self, text: str, reported: int | None = None) -> None:
        if text:
            # A word begun in the last piece and carried on in this one counts once.
            carried = 1 if self._in_word and not text[0].isspace() else 0
            self.words += len(text.split()) - carried
            self.chars += len(text)
            self._in_word = not text[-1].isspace()
        if reported is not None:
            self.reported = max(self.reported, reported)


def _count(value: int | None) -> int | None:
    """An upstream's token count, within what a DELTA carries."""
    return None if value is None else max(0, min(int(value), MAX_CONTEXT))


def _ids(ask: Ask) -> dict[str, Any]:
    return {"attempt": ask.attempt, "request_id": ask.request_id}


def _sid(ask: Ask) -> dict[str, Any]:
    return {"session": ask.session, **_ids(ask)}


class _Forget:
    """Marks the end of a session's task in the outbox."""

    __slots__ = ("future",)

    def __init__(self, future: concurrent.futures.Future[None]) -> None:
        self.future = future
