"""The gateway's API keys: which bearer tokens may use ``/chat``, ``/v1/*`` and ``/metrics``.

Keys come from a file (one a line, ``#`` comments and blank lines skipped), or, when no
file is configured, from the ``ZMQLLM_API_KEY`` environment variable; with neither the
gateway is open, as before keys existed. The file is re-read when it changes (checked at
most once a second, on the next request), so keys can be rotated without a restart; a
reload that fails (the file gone, unreadable or empty mid-write) keeps the previous keys.

Only SHA-256 digests of the keys are kept in memory, and a presented key is compared with
every allowed digest by ``hmac.compare_digest`` without stopping at a match: neither the
position of a match nor the length of a common prefix shows in the timing. The key text
never reaches a log line or an error message.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from zmqllm.config.settings import ConfigError
from zmqllm.gateway.errors import APIError
from zmqllm.gateway.pages import PAGE_PATHS
from zmqllm.gateway.request_context import record_of
from zmqllm.log import get_logger

if TYPE_CHECKING:
    from zmqllm.gateway.metrics import GatewayMetrics

__all__ = [
    "ENV_VAR",
    "OPEN_PATHS",
    "RELOAD_INTERVAL_S",
    "ApiKeyMiddleware",
    "ApiKeys",
    "load_api_keys",
    "parse_keys",
    "unauthorized",
]

ENV_VAR = "ZMQLLM_API_KEY"
# Paths answered without a key: probes (load balancers, Kubernetes) carry none. Every other
# path needs one, including unknown ones, so a 404 reveals nothing to a caller without a key.
# The chat and cluster pages and their files carry no data: a browser loads them without a
# header, and the page then asks for the key its requests need.
OPEN_PATHS = frozenset({"/health", "/ready", *PAGE_PATHS})
# Seconds between checks of the key file: a stat a second costs nothing, and a rotated key
# takes effect about this long after the file is written.
RELOAD_INTERVAL_S = 1.0

log = get_logger("zmqllm.gateway")

# (inode, size, mtime, ctime) in ns: a rewrite, a replacement by rename, a chmod all show.
_Signature = tuple[int, int, int, int]


def _digest(key: str | bytes) -> bytes:
    raw = key.encode("utf-8", "surrogateescape") if isinstance(key, str) else key
    return hashlib.sha256(raw).digest()


def _usable(key: str) -> bool:
    # A bearer token travels in a header: printable ASCII without spaces (RFC 6750's
    # b64token is narrower still). A key outside that could never be presented, and a
    # line like "KEY # note" is more likely a mistake than a key.
    return key.isascii() and key.isprintable() and not any(c.isspace() for c in key)


def parse_keys(text: str, source: str) -> list[str]:
    """The keys in a key file's ``text``; ``source`` names it in errors (never a key)."""
    keys = []
    for number, line in enumerate(text.splitlines(), start=1):
        key = line.strip()
        if not key or key.startswith("#"):
            continue
        if not _usable(key):
            raise ConfigError(
                f"API key file {source}, line {number}: a key must be printable ASCII "
                "without spaces (comments go on lines of their own, starting with '#')"
            )
        keys.append(key)
    if not keys:
        raise ConfigError(f"API key file {source} holds no keys (one key a line)")
    return keys


def _signature(path: Path) -> _Signature:
    st = path.stat()
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _read_keys(path: Path) -> tuple[list[str], _Signature]:
    try:
        signature = _signature(path)
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
        raise ConfigError(f"API key file {path}: cannot read it ({reason})") from None
    return parse_keys(text, str(path)), signature


@dataclass(frozen=True)
class Verdict:
    """Whether a request may pass, and if not why ("missing", "malformed", "invalid")."""

    allowed: bool
    reason: str = ""
    tenant: str = ""  # the key's digest prefix (allowed only): per-key shares count by it


class ApiKeys:
    """The allowed keys (as digests), reloaded from their file when it changes."""

    def __init__(
        self,
        keys: list[str],
        *,
        path: Path | None = None,
        signature: _Signature | None = None,
        reload_interval: float = RELOAD_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not keys:
            raise ConfigError("an API key set needs at least one key")
        self._digests = [_digest(k) for k in keys]
        self.path = path
        self._signature = signature
        self.reload_interval = reload_interval
        self._clock = clock
        self._checked_at = clock()

    @classmethod
    def from_file(
        cls,
        path: str | Path,
        *,
        reload_interval: float = RELOAD_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> ApiKeys:
        """The keys in ``path``; ConfigError if it cannot be read or holds none."""
        file = Path(path).expanduser()
        keys, signature = _read_keys(file)
        return cls(
            keys, path=file, signature=signature, reload_interval=reload_interval, clock=clock
        )

    @property
    def count(self) -> int:
        return len(self._digests)

    @property
    def source(self) -> str:
        return str(self.path) if self.path is not None else f"${ENV_VAR}"

    def matches(self, key: str) -> bool:
        """Whether ``key`` is one of the allowed keys, in time independent of which."""
        given = _digest(key)
        found = False
        # Every digest is compared, match or not (no short-circuit `or`, no early return).
        for allowed in self._digests:
            found |= hmac.compare_digest(given, allowed)
        return found

    def check(self, authorization: str | None) -> Verdict:
        """The verdict on an ``Authorization`` header's value (None: no header)."""
        self.maybe_reload()
        if authorization is None or not authorization.strip():
            return Verdict(False, "missing")
        scheme, _, token = authorization.strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return Verdict(False, "malformed")
        if not self.matches(token):
            return Verdict(False, "invalid")
        return Verdict(True, tenant=_digest(token).hex()[:16])

    def maybe_reload(self) -> None:
        """Re-read the file if it changed; at most once per ``reload_interval``."""
        if self.path is None:
            return
        now = self._clock()
        if now - self._checked_at < self.reload_interval:
            return
        self._checked_at = now
        try:
            signature: _Signature | None = _signature(self.path)
        except OSError:
            signature = None
        if signature == self._signature:
            return
        # Remembered even when the reload fails, so a broken file is reported once, not
        # every second; fixing it (or a chmod) changes the signature and it is read again.
        self._signature = signature
        try:
            keys, self._signature = _read_keys(self.path)
        except ConfigError as exc:
            log.error("API keys not reloaded; the previous keys stay in force", error=str(exc))
            return
        self._digests = [_digest(k) for k in keys]
        log.info("API keys reloaded", file=str(self.path), keys=len(keys))


def load_api_keys(keys_file: str, environ: Mapping[str, str] | None = None) -> ApiKeys | None:
    """The gateway's keys: from ``keys_file`` if set, else ``$ZMQLLM_API_KEY``, else None
    (no keys: the API is open). A bad file or variable is a ConfigError naming it."""
    if keys_file:
        return ApiKeys.from_file(keys_file)
    env = os.environ if environ is None else environ
    value = env.get(ENV_VAR, "").strip()
    if not value:
        return None
    if not _usable(value):
        raise ConfigError(f"${ENV_VAR}: a key must be printable ASCII without spaces")
    return ApiKeys([value])


_MESSAGES = {
    "missing": "missing API key: send it as the header 'Authorization: Bearer KEY'",
    "malformed": "malformed Authorization header: expected 'Bearer KEY'",
    "invalid": "invalid API key",
}


def unauthorized(reason: str) -> APIError:
    """The 401 for a request without a valid key (OpenAI's shape, type and code)."""
    return APIError(
        401,
        _MESSAGES.get(reason, _MESSAGES["invalid"]),
        type="authentication_error",
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


class ApiKeyMiddleware:
    """Answers 401 to any request but the probes' that lacks a valid bearer key.

    Sits inside RequestContextMiddleware, so a rejection still gets a request id, its
    "request finished" line and its count in the request metrics; it answers before the
    route runs, so an unauthenticated body is never read.
    """

    def __init__(self, app: ASGIApp, keys: ApiKeys, metrics: GatewayMetrics | None = None) -> None:
        self.app = app
        self.keys = keys
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # No route takes a websocket; Starlette refuses those itself.
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        verdict = self.keys.check(Headers(scope=scope).get("authorization"))
        if verdict.allowed:
            if self.keys.count >= 2:  # one key is one tenant: nothing to share
                record_of(Request(scope)).tenant = verdict.tenant
            await self.app(scope, receive, send)
            return
        record_of(Request(scope)).error = "invalid_api_key"
        if self.metrics is not None:
            self.metrics.unauthorized.labels(verdict.reason).inc()
        # The reason, never the key (not even a prefix of it).
        log.info("request refused: no valid API key", reason=verdict.reason, path=scope["path"])
        await unauthorized(verdict.reason).response()(scope, receive, send)
