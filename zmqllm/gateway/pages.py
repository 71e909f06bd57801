"""The pages a person opens in a browser: chat at ``GET /``, the cluster at ``GET /cluster``.

Plain HTML, CSS and JavaScript files inside the package (``static/``): nothing is built
at install time and nothing comes from a CDN. The chat page streams through
``/v1/chat/completions``; the cluster page polls ``GET /cluster/status`` about once a
second. The pages and their files carry no data, so they are served without an API key
(``PAGE_PATHS``); the JSON behind them needs one where keys are required, and the page
asks for it.
"""

from __future__ import annotations

import time
from importlib import resources
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from zmqllm.gateway.errors import APIError
from zmqllm.gateway.metrics import without_prefix_stats

__all__ = ["PAGE_PATHS", "router"]

router = APIRouter()

# name -> content type: the whole set of files served; anything else is a 404.
STATIC_FILES = {
    "chat.html": "text/html; charset=utf-8",
    "cluster.html": "text/html; charset=utf-8",
    "chat.js": "text/javascript; charset=utf-8",
    "cluster.js": "text/javascript; charset=utf-8",
    "page.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}
PAGE_PATHS = frozenset({"/", "/cluster", *(f"/static/{name}" for name in STATIC_FILES)})
# The pages run only their own files: no inline script, nothing from elsewhere.
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def _file(name: str) -> Response:
    if name not in STATIC_FILES:
        raise APIError(404, f"no such file: /static/{name[:64]}", code="not_found")
    body = resources.files("zmqllm.gateway").joinpath("static", name).read_bytes()
    return Response(body, media_type=STATIC_FILES[name], headers=SECURITY_HEADERS)


@router.get("/", include_in_schema=False)
async def chat_page() -> Response:
    return _file("chat.html")


@router.get("/cluster", include_in_schema=False)
async def cluster_page() -> Response:
    return _file("cluster.html")


@router.get("/static/{name}", include_in_schema=False)
async def static_file(name: str) -> Response:
    return _file(name)


@router.get("/cluster/status")
async def cluster_status(request: Request) -> JSONResponse:
    """What the cluster page draws: the broker's status (null while it does not answer),
    the gateway's own queue, and ``at``, the seconds at which the status was taken, so the
    page turns counters (tokens, busy seconds) into rates between two snapshots."""
    cache = request.app.state.broker_status
    status: dict[str, Any] | None = await cache.get()
    service = request.app.state.gateway
    if not service.settings.prefix_stats:
        status = without_prefix_stats(status)
    # cache.fetched_at is monotonic; the page needs differences only, in seconds.
    at = cache.fetched_at if status is not None else time.monotonic()
    body = {
        "at": round(at, 3),
        "model": service.model_name,
        "gateway": {"in_flight": service.in_flight, "queued": service.queued},
        "broker": status,
    }
    return JSONResponse(body, headers={"Cache-Control": "no-store"})
