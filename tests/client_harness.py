"""A scripted broker for the BrokerClient tests: a ROUTER on zmq.asyncio (no tests here).

There is no pytest-asyncio in the environments, so each test body is a coroutine that
``run`` runs with asyncio.run under an overall bound, with a started client and a fake.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

from zmqllm.bus.messages import Finish, Heartbeat, Message, MsgType, StatusReply, Token
from zmqllm.bus.protocol import decode, encode
from zmqllm.bus.sampling_params import SamplingParams
from zmqllm.client.broker_client import BrokerClient
from zmqllm.client.request import GenerateRequest
from zmqllm.client.streams import TokenEvent, TokenStream

TIMEOUT = 10.0  # bound on any single wait; a correct client is far quicker
INTERVAL = 0.1  # client heartbeat interval


@dataclass
class Received:
    identity: bytes
    msg: Any  # the decoded message; Any so a test reads an OPEN's fields without casts
    frames: list[bytes]


class FakeBroker:
    """Records what the client sends; answers heartbeats (unless silent) and, unless told
    otherwise, STATUS. Everything else the test answers by hand."""

    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        # A ROUTER drops what it cannot queue: at the default high-water mark (1000) a test
        # that sends MAX_UNREAD_EVENTS + 1 tokens in one burst lost some on a loaded CI
        # machine, and the client never saw the overrun it waited for.
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.bind("tcp://127.0.0.1:0")
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.boot = "boot-a"
        self.silent = False
        self.answer_status = True
        self.status_body: dict[str, Any] = {"queue": 0, "workers": []}
        self.heartbeats = 0
        self.inbox: asyncio.Queue[Received] = asyncio.Queue()
        self._task = asyncio.create_task(self._serve())

    async def _serve(self) -> None:
        while True:
            frames = await self.sock.recv_multipart()
            identity, body = frames[0], frames[1:]
            msg = decode(body)
            if isinstance(msg, Heartbeat):
                self.heartbeats += 1
                if not self.silent:
                    await self.send(identity, Heartbeat(boot=self.boot))
                continue
            if msg.TYPE is MsgType.STATUS and self.answer_status:
                reply = StatusReply.of(self.status_body, request_id=msg.request_id)
                await self.send(identity, reply)
            await self.inbox.put(Received(identity, msg, body))

    async def send(self, identity: bytes, msg: Message) -> None:
        await self.sock.send_multipart([identity, *encode(msg)])

    async def send_raw(self, identity: bytes, frames: list[bytes]) -> None:
        await self.sock.send_multipart([identity, *frames])

    async def expect(self, msg_type: MsgType) -> Received:
        got = await asyncio.wait_for(self.inbox.get(), TIMEOUT)
        assert got.msg.TYPE is msg_type, f"expected {msg_type.value}, got {got.msg}"
        return got

    async def skip_to(self, msg_type: MsgType, session: str) -> Received:
        """The next ``msg_type`` for ``session``, skipping whatever comes before it."""
        while True:
            got = await asyncio.wait_for(self.inbox.get(), TIMEOUT)
            if got.msg.TYPE is msg_type and getattr(got.msg, "session", None) == session:
                return got

    async def token(
        self,
        to: Received,
        step: int,
        token: int,
        finish: str | None = None,
        **extra: Any,
    ) -> None:
        msg = Token(
            session=to.msg.session,
            request_id=to.msg.request_id,
            step=step,
            token=token,
            finish=Finish(finish) if finish else None,
            **extra,
        )
        await self.send(to.identity, msg)

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self.sock.close(linger=0)


Body = Callable[[BrokerClient, FakeBroker], Awaitable[None]]


def run(body: Body, *, silent: bool = False, liveness: int = 3, **client_kw: Any) -> None:
    """Run ``body(client, fake)`` with a started client, then tear everything down."""

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        fake = FakeBroker(ctx)
        fake.silent = silent
        client = BrokerClient(fake.address, INTERVAL, liveness, context=ctx, **client_kw)
        try:
            await client.start()
            await asyncio.wait_for(body(client, fake), 3 * TIMEOUT)
        finally:
            await client.close()
            await fake.close()
            ctx.term()

    asyncio.run(main())


def generate(client: BrokerClient, prompt: list[int] | None = None, **kw: Any) -> TokenStream:
    args: dict[str, Any] = dict(
        request_id="req-1",
        prompt=(5, 6, 7) if prompt is None else tuple(prompt),
        max_tokens=8,
        sampling=SamplingParams(temperature=0.5, seed=3),
        stop_ids=(2,),
    )
    args.update(kw)
    return client.generate(GenerateRequest(**args))


async def collect(stream: TokenStream) -> list[TokenEvent]:
    return [ev async for ev in stream]
