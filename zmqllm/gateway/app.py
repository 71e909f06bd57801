"""``create_app``: the gateway's FastAPI application, built around one broker client.

Everything a request needs hangs off the app (``app.state.gateway``), never a module
global, so tests build as many apps as they like, each with its own fake client.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from zmqllm.config.machine import is_loopback_host
from zmqllm.config.settings import GatewaySettings
from zmqllm.config.up_state import STATE_ENV, failing_children, read_state
from zmqllm.gateway import openai_routes, pages, plain_routes
from zmqllm.gateway.api_keys import ApiKeyMiddleware, ApiKeys
from zmqllm.gateway.backend import BrokerClientLike
from zmqllm.gateway.browser_guard import BrowserGuardMiddleware
from zmqllm.gateway.errors import RETRY_AFTER_S, install_error_handlers
from zmqllm.gateway.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from zmqllm.gateway.metrics import GatewayMetrics, StatusCache
from zmqllm.gateway.readiness import Readiness, failing_shown
from zmqllm.gateway.request_context import RequestContextMiddleware
from zmqllm.gateway.service import GatewayService
from zmqllm.models.tokenizer import Tokenizer
from zmqllm.version import __version__

# Seconds a scrape waits for the broker's figures before reporting it down.
METRICS_STATUS_TIMEOUT = 1.0

__all__ = ["create_app"]

# What the warm-up generation feeds the pipeline; any short text does.
_WARMUP_TEXT = "Hello"


def _warmup_prompt(tokenizer: Tokenizer) -> list[int]:
    ids = tokenizer.encode(_WARMUP_TEXT, add_special_tokens=True)
    if not ids and tokenizer.bos_token_id is not None:
        ids = [tokenizer.bos_token_id]
    return ids or [0]


def create_app(
    client: BrokerClientLike,
    settings: GatewaySettings,
    tokenizer: Tokenizer | None,
    model_name: str,
    context_length: int,
    *,
    api_keys: ApiKeys | None = None,
    manage_client: bool = True,
    ready_poll_interval: float = 0.5,
    ready_recheck_interval: float = 2.0,
) -> FastAPI:
    """The HTTP gateway in front of ``client``.

    With ``manage_client`` the app's lifespan starts and closes the client. Readiness is
    polled every ``ready_poll_interval`` seconds until ready, then every
    ``ready_recheck_interval`` seconds.

    ``api_keys`` (or, without it, the keys in ``settings.api_keys_file``) are required on
    every path but /health and /ready; with neither the API is open. The environment
    (``ZMQLLM_API_KEY``) is read by ``serve``, not here: an app built in a test never
    depends on the shell it runs in.
    """
    if api_keys is None and settings.api_keys_file:
        api_keys = ApiKeys.from_file(settings.api_keys_file)
    gateway_metrics = GatewayMetrics(prefix_stats=settings.prefix_stats)
    service = GatewayService(
        client,
        settings,
        tokenizer,
        model_name,
        context_length,
        on_failover=gateway_metrics.failover,
    )
    readiness = Readiness(
        client,
        _warmup_prompt(tokenizer) if tokenizer is not None else [],
        poll_interval=ready_poll_interval,
        ready_poll_interval=ready_recheck_interval,
        warmup_timeout=settings.request_timeout,
        model=model_name,
        directory=service.models,
    )

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        if manage_client:
            await client.start()
        monitor = asyncio.create_task(readiness.run(), name="zmqllm-readiness")
        try:
            yield
        finally:
            monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await monitor
            if manage_client:
                await client.close()

    app = FastAPI(
        title="zmqllm gateway",
        version=__version__,
        lifespan=lifespan,
        # Interactive docs are for people; the API's shape is OpenAI's, documented there.
        docs_url=None,
        redoc_url=None,
    )
    app.state.gateway = service
    app.state.readiness = readiness
    install_error_handlers(app)
    app.state.metrics = gateway_metrics
    app.state.api_keys = api_keys
    if api_keys is not None:
        # Added first, so it runs inside RequestContextMiddleware (the last added is the
        # outermost): a refused request still has its id, log line and metrics.
        app.add_middleware(ApiKeyMiddleware, keys=api_keys, metrics=app.state.metrics)
    # Outside the key check (a preflight has no key), inside the request context.
    app.add_middleware(BrowserGuardMiddleware, settings=settings)
    app.add_middleware(RequestContextMiddleware)
    app.include_router(pages.router)
    app.include_router(plain_routes.router)
    app.include_router(openai_routes.router)

    app.state.broker_status = StatusCache(lambda: client.status(timeout=METRICS_STATUS_TIMEOUT))

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        """Prometheus text: the gateway's figures and, through the broker, the cluster's."""
        status = await request.app.state.broker_status.get()
        service: GatewayService = request.app.state.gateway
        body = request.app.state.metrics.render(
            status,
            service.in_flight,
            service.queued,
            service.client.dropped,
            history_tokens=service.history_tokens,
        )
        return Response(body, media_type=METRICS_CONTENT_TYPE)

    @app.get("/health")
    async def health() -> dict[str, str]:
        # Alive means this process answers; whether it can generate is /ready's question.
        return {"status": "ok"}

    @app.get("/ready")
    async def ready(request: Request) -> JSONResponse:
        state: Readiness = request.app.state.readiness
        # Under `zmqllm up`: the children it cannot keep up (a worker, a remote model),
        # while the rest serves.
        failing = failing_children(read_state(os.environ.get(STATE_ENV)))
        detail = {"failing": failing_shown(failing, _may_see_details(request))} if failing else {}
        if state.ready:
            return JSONResponse({"status": "ready", **detail})
        return JSONResponse(
            {"status": "not ready", "reason": state.reason, **detail},
            status_code=503,
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )

    def _may_see_details(request: Request) -> bool:
        """Whether the caller may see the launcher's details: it holds a valid API key, or,
        with none configured, it calls from this machine's loopback interface."""
        if api_keys is not None:
            return api_keys.check(request.headers.get("authorization")).allowed
        host = request.client.host if request.client is not None else ""
        return is_loopback_host(host)

    return app
