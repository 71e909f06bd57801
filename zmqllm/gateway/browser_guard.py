"""What a web page can make a browser send to the gateway: refused unless it was meant.

Two attacks need no access to the gateway's network, only a user who visits a page:

- DNS rebinding: a page on ``attacker.example`` re-points that name at 127.0.0.1 and, as
  the same origin, reads the answers (``/v1/...``, ``/cluster/status``, ``/metrics``). The
  browser still sends ``Host: attacker.example``. Only the hosts the gateway is served as
  are accepted (``allowed_hosts``); an IP address is never rebound, so a gateway bound to
  every interface also accepts any address as its host.
- Cross-site requests: any page may POST to ``http://127.0.0.1:8080`` (a form, or fetch in
  no-cors mode); it cannot read the answer, but the generation runs (and is billed, for a
  remote model). Browsers mark such requests with ``Origin``: one from another origin is
  refused unless ``cors_origins`` names it, and a named one gets CORS headers (and its
  preflights answered) so its scripts may read the answers.

A request without ``Origin`` is not from a cross-site page (curl, the SDKs, the gateway's
own pages loading); the JSON routes also insist on ``application/json``
(``zmqllm.gateway.body``), a type no page can send cross-site without a preflight.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable
from urllib.parse import urlsplit

from starlette.datastructures import Headers, MutableHeaders
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from zmqllm.config.settings import GatewaySettings
from zmqllm.gateway.errors import APIError
from zmqllm.gateway.request_context import REQUEST_ID_HEADER, record_of
from zmqllm.log import get_logger

__all__ = ["BrowserGuardMiddleware", "HostRule", "OriginRule", "split_list"]

log = get_logger("zmqllm.gateway")

WILDCARD_BINDS = frozenset({"", "0.0.0.0", "::"})
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
# What a cross-origin script may send and read (besides the CORS-safelisted ones).
ALLOWED_HEADERS = "Authorization, Content-Type, X-Request-ID"
EXPOSED_HEADERS = f"{REQUEST_ID_HEADER}, Retry-After"
PREFLIGHT_MAX_AGE_S = 600
DEFAULT_PORTS = {"http": 80, "https": 443}


def split_list(text: str) -> list[str]:
    """A comma-separated setting's items, trimmed, empty ones left out."""
    return [part.strip() for part in text.split(",") if part.strip()]


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def host_name(header: str) -> str:
    """The host of a Host header, lower case, without its port or brackets."""
    host = header.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    if host.count(":") == 1:
        host = host.partition(":")[0]
    return host.rstrip(".")


class HostRule:
    """Which Host headers the gateway answers: ``allowed_hosts``, or by default the bind
    address and the loopback names (and, bound to every interface, any IP address and
    this machine's own names)."""

    def __init__(self, allowed_hosts: str, bind_host: str) -> None:
        listed = [host_name(h) for h in split_list(allowed_hosts)]
        self.any = "*" in listed
        self.any_ip = False
        if listed:
            self.names = frozenset(listed)
            return
        names = {host_name(bind_host), *LOOPBACK_NAMES}
        if bind_host in WILDCARD_BINDS:
            self.any_ip = True
            names |= {socket.gethostname().lower(), socket.getfqdn().lower()}
        self.names = frozenset(n for n in names if n)

    def allows(self, host: str) -> bool:
        return self.any or host in self.names or (self.any_ip and _is_ip(host))


def _origin_key(origin: str) -> tuple[str, str, int | None] | None:
    try:
        # urlsplit raises on a stray bracket ("https://x].example"), .port on a bad port.
        parts = urlsplit(origin.strip().lower())
        if not parts.scheme or not parts.hostname:
            return None
        port = parts.port or DEFAULT_PORTS.get(parts.scheme)
    except ValueError:
        return None
    return parts.scheme, parts.hostname.rstrip("."), port


class OriginRule:
    """The origins whose scripts may use the gateway (``cors_origins``; ``*`` = any)."""

    def __init__(self, cors_origins: Iterable[str]) -> None:
        listed = list(cors_origins)
        self.any = "*" in listed
        self.keys = {k for o in listed if (k := _origin_key(o)) is not None}
        self.null = "null" in listed

    def allows(self, origin: str) -> bool:
        if self.any:
            return True
        if origin == "null":  # sandboxed frames and file:// pages
            return self.null
        return _origin_key(origin) in self.keys


def same_origin(origin: str, scope: Scope, host: str | None) -> bool:
    """Whether ``origin`` is the gateway itself as this request reached it (its own
    pages' requests)."""
    if host is None:
        return False
    own = _origin_key(f"{scope.get('scheme', 'http')}://{host}")
    return own is not None and _origin_key(origin) == own


class BrowserGuardMiddleware:
    """400 for a Host the gateway is not served as, 403 for a cross-origin request from
    an origin not in ``cors_origins``; CORS headers and preflight answers for those in it.

    Sits inside RequestContextMiddleware (a refusal has its id and log line) and outside
    the API-key check (a preflight carries no key)."""

    def __init__(self, app: ASGIApp, settings: GatewaySettings) -> None:
        self.app = app
        self.hosts = HostRule(settings.allowed_hosts, settings.host)
        self.origins = OriginRule(split_list(settings.cors_origins))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        host = headers.get("host")
        # HTTP/1.0 may omit Host; no browser does.
        if host is not None and not self.hosts.allows(host_name(host)):
            await self._refuse(scope, receive, send, 400, "host_not_allowed", host)
            return
        origin = headers.get("origin")
        if origin is None or same_origin(origin, scope, host):
            await self.app(scope, receive, send)
            return
        if not self.origins.allows(origin):
            await self._refuse(scope, receive, send, 403, "origin_not_allowed", origin)
            return
        if scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
            await self._preflight(origin)(scope, receive, send)
            return

        async def send_with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                out = MutableHeaders(scope=message)
                out["Access-Control-Allow-Origin"] = origin
                out["Access-Control-Expose-Headers"] = EXPOSED_HEADERS
                out.add_vary_header("Origin")
            await send(message)

        await self.app(scope, receive, send_with_cors)

    def _preflight(self, origin: str) -> Response:
        return Response(
            status_code=204,
            headers={
                "Access-Control-Allow-Origin": origin,
                "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
                "Access-Control-Allow-Headers": ALLOWED_HEADERS,
                "Access-Control-Max-Age": str(PREFLIGHT_MAX_AGE_S),
                "Vary": "Origin",
            },
        )

    async def _refuse(
        self, scope: Scope, receive: Receive, send: Send, status: int, code: str, given: str
    ) -> None:
        record_of(Request(scope)).error = code
        shown = given[:200]
        if code == "host_not_allowed":
            log.info("request refused: Host not allowed", host=shown, path=scope["path"])
            message = (
                f"the gateway is not served as host {shown!r}; an operator can add it to "
                "[gateway] allowed_hosts"
            )
        else:
            log.info("request refused: cross-origin", origin=shown, path=scope["path"])
            message = (
                f"cross-origin requests from {shown!r} are not allowed; an operator can "
                "add the origin to [gateway] cors_origins"
            )
        await APIError(status, message, code=code).response()(scope, receive, send)
