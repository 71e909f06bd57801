"""``/ready``'s state: a complete route exists and a warm-up token went through it.

A gateway serving only remote (text) models is ready once one of them has a worker: a
warm-up there would cost a call to a paid API.

A route in the broker's table proves that workers registered, not that a token can travel
the whole pipeline (a stage may still be compiling, a link may be wrong), so readiness
also waits for one real generation. A background task keeps the answer current: it polls
the broker quickly while not ready and slowly once ready, and drops readiness when the
route disappears, warming up again when it comes back.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

import anyio

from zmqllm.bus.sampling_params import SamplingParams
from zmqllm.client.request import GenerateRequest
from zmqllm.gateway.backend import BrokerClientLike, broker_error_fields
from zmqllm.gateway.served_models import ModelDirectory, complete_route
from zmqllm.log import bind_request, get_logger, new_request_id

__all__ = ["Readiness", "failing_shown"]

log = get_logger("zmqllm.gateway")

# Seconds. The broker answers status from memory; this bounds a hung broker.
STATUS_TIMEOUT = 2.0


class Readiness:
    def __init__(
        self,
        client: BrokerClientLike,
        warmup_prompt: Sequence[int],
        *,
        poll_interval: float = 0.5,
        ready_poll_interval: float = 2.0,
        warmup_timeout: float = 120.0,
        model: str = "",
        directory: ModelDirectory | None = None,
    ) -> None:
        self._client = client
        self._warmup_prompt = tuple(warmup_prompt)  # empty: no model of our own
        self._model = model
        self._directory = directory
        self._poll_interval = poll_interval
        self._ready_poll_interval = ready_poll_interval
        self._warmup_timeout = warmup_timeout
        self.ready = False
        self.reason = "waiting for the broker's first status"
        # Set when the gateway's own model cannot be served at all (a name taken by a
        # remote model); on_fatal is told it once (serve() stops the server).
        self.fatal: str | None = None
        self.on_fatal: Callable[[str], None] | None = None
        self._boot: object = None  # the broker's boot id: a restart means warm up again

    @property
    def model(self) -> str:
        """The name the gateway's own model has on the bus."""
        return self._directory.route_name if self._directory is not None else self._model

    async def run(self) -> None:
        """Poll forever (until cancelled)."""
        while True:
            await self.check()
            await asyncio.sleep(self._ready_poll_interval if self.ready else self._poll_interval)

    async def check(self) -> None:
        """One poll: update ``ready`` and ``reason``."""
        try:
            status = await self._client.status(timeout=STATUS_TIMEOUT)
        except Exception as exc:
            fields = broker_error_fields(exc)
            if fields is None:
                log.exception("broker status failed")
            self._set(False, f"broker unreachable: {fields[1] if fields else exc}")
            return
        if self._directory is not None:
            self._directory.update(status)
        boot = status.get("boot")
        if boot != self._boot:
            if self._boot is not None and self.ready:
                self._set(False, "the broker restarted")
            self._boot = boot
        if not self._warmup_prompt:
            remote = self._directory is not None and self._directory.remote
            self._set(bool(remote), "ready" if remote else "waiting for a remote worker")
            return
        if not self.ready and (clash := _name_clash(status, self.model)) is not None:
            # Not a wait: no worker of layers may join under a remote model's name. Told
            # once, and the gateway stops (on_fatal) rather than wait for ever.
            if self.fatal is None:
                self.fatal = clash
                log.error("gateway cannot serve its model", reason=clash)
                if self.on_fatal is not None:
                    self.on_fatal(clash)
            self._set(False, clash)
            return
        if not complete_route(status, self.model):
            self._set(False, _no_route_reason(status, self.model))
            return
        if self.ready:
            return
        self._set(False, "warming up")
        if await self._warm_up():
            self._set(True, "ready")

    def _set(self, ready: bool, reason: str) -> None:
        if ready != self.ready:
            (log.info if ready else log.warning)(
                "gateway ready" if ready else "gateway not ready", reason=reason
            )
        self.ready, self.reason = ready, reason

    async def _warm_up(self) -> bool:
        """Generate one token through the whole pipeline; True if it arrived."""
        request_id = "warmup-" + new_request_id()[:16]
        started = time.perf_counter()
        with bind_request(request_id):
            try:
                with anyio.fail_after(self._warmup_timeout):
                    warm_up = GenerateRequest(
                        request_id=request_id,
                        prompt=self._warmup_prompt,
                        max_tokens=1,
                        sampling=SamplingParams(),
                        model=self.model,
                    )
                    stream = self._client.generate(warm_up)
                    async with stream:
                        async for event in stream:
                            if event.finish is not None:
                                break
            except Exception as exc:
                fields = broker_error_fields(exc)
                detail = fields[1] if fields else repr(exc)
                log.warning("warm-up generation failed", error=detail)
                self.reason = f"warm-up failed: {detail}"
                return False
        log.info(
            "warm-up generation finished",
            request_id=request_id,
            duration_ms=round((time.perf_counter() - started) * 1000, 1),
        )
        return True


def _name_clash(status: dict[str, Any], model: str) -> str | None:
    """Why the gateway's own model cannot be served: the broker serves its name as a
    remote (text) model. None when it does not."""
    models = status.get("models")
    for m in models if isinstance(models, list) else []:
        if isinstance(m, dict) and m.get("name") == model and m.get("text_model"):
            return (
                f"the broker serves model {model!r} as a remote model (a worker --remote), "
                "and this gateway has its own model of that name: give one of them another "
                "name (this gateway's --model-name or [model] name, or the remote worker's "
                "--served-name, [[remotes]] served_name in zmqllm up), or start the gateway "
                "with --no-local-model to serve only the remote models"
            )
    return None


def _no_route_reason(status: dict[str, Any], model: str) -> str:
    models = status.get("models")
    names = (
        [m.get("name") for m in models if isinstance(m, dict)] if isinstance(models, list) else []
    )
    if names and model not in names:
        served = ", ".join(repr(n) for n in names[:8])
        return (
            f"no worker serves model {model!r} (the broker has {served}): give the workers "
            "and the gateway the same --model-name"
        )
    return "no complete route: waiting for workers to cover every layer"


# What anyone may see of a failing child of `zmqllm up` on /ready; its exits, exit
# status, next start and log file (an absolute path on the host) only an authorized
# caller sees (failing_shown).
_PUBLIC_CHILD_FIELDS = ("name", "role")


def failing_shown(failing: list[dict[str, Any]], authorized: bool) -> list[dict[str, Any]]:
    """The failing children as /ready shows them to its caller: whole to an authorized
    one (a valid API key; without keys, a caller on the loopback interface), else only
    which children fail. /ready needs no key (a load balancer's probe has none)."""
    if authorized:
        return failing
    return [{k: child.get(k) for k in _PUBLIC_CHILD_FIELDS} for child in failing]
