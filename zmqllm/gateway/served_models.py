"""Which models a gateway serves, and which one a request means.

Two kinds: the gateway's own model of tokens (its tokenizer and config are here; its
workers run layers), and the remote (text) models that remote workers registered with the
broker, learnt from the broker's status (every readiness poll, and at once when a request
names a model not seen yet). A request naming no model gets ``default_model``, else the
gateway's own model, else the only one served.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from zmqllm.gateway.errors import RETRY_AFTER_S, APIError
from zmqllm.log import get_logger

__all__ = ["ModelDirectory", "ServedModel", "complete_route"]

log = get_logger("zmqllm.gateway")

# A request naming an unknown model asks the broker again at most this often.
REFRESH_MIN_S = 0.5
# How long a remote model whose workers left is answered 503 (it may be restarting)
# before it is unknown (404); and how many such names are kept.
GONE_GRACE_S = 60.0
MAX_GONE = 256
MAX_NAMES_SHOWN = 8


@dataclass(frozen=True)
class ServedModel:
    name: str
    text_model: bool
    context: int
    created: int


def complete_route(status: dict[str, Any], name: str) -> bool:
    """Whether the broker's ``status`` shows a whole route for model ``name``."""
    models = status.get("models")
    if not isinstance(models, list):  # a broker of one model: its own flag
        return bool(status.get("complete_route"))
    for m in models:
        if isinstance(m, dict) and m.get("name") in (name, ""):
            return bool(m.get("complete_route"))
    return False


class ModelDirectory:
    def __init__(
        self,
        local: ServedModel | None,
        default: str = "",
        fetch_status: Callable[[], Awaitable[dict[str, Any]]] | None = None,
    ) -> None:
        self.local = local
        self.default = default
        self._fetch_status = fetch_status
        self.remote: dict[str, ServedModel] = {}
        # Remote models seen lately whose workers are gone for now: 503, not 404.
        self.gone: dict[str, float] = {}
        # The name the gateway's own model's workers registered under: its own name,
        # unless they call it otherwise and it is the only model of layers the broker has
        # (a gateway given a Hub id, workers a local copy of it).
        self.route_name = local.name if local is not None else ""
        self._refreshed = -float("inf")
        self.last_status: dict[str, Any] | None = None  # the latest broker status seen

    def update(self, status: dict[str, Any]) -> None:
        """Take the remote models from a broker status (those with a whole route)."""
        self._refreshed = now = time.monotonic()
        self.last_status = status
        seen: dict[str, ServedModel] = {}
        models = status.get("models")
        entries = [m for m in models if isinstance(m, dict)] if isinstance(models, list) else []
        self._follow_workers(entries)
        for m in entries:
            if not isinstance(m, dict) or not m.get("text_model") or not m.get("complete_route"):
                continue
            name = m.get("name")
            if not isinstance(name, str) or not name or name == self.name_of_local:
                continue
            known = self.remote.get(name)
            created = known.created if known is not None else int(time.time())
            seen[name] = ServedModel(name, True, int(m.get("context") or 0), created)
        for name in self.remote.keys() - seen.keys():
            self.gone[name] = now
        self.gone = {n: t for n, t in self.gone.items() if now - t < GONE_GRACE_S and n not in seen}
        while len(self.gone) > MAX_GONE:
            self.gone.pop(next(iter(self.gone)))
        self.remote = seen

    def _follow_workers(self, entries: list[dict[str, Any]]) -> None:
        if self.local is None:
            return
        layered = [m.get("name") for m in entries if not m.get("text_model")]
        name = self.local.name
        if name not in layered and len(layered) == 1 and isinstance(layered[0], str):
            name = layered[0]
        if name != self.route_name and name != self.local.name:
            log.warning(
                "this gateway's model goes by another name on the bus",
                model=self.local.name,
                workers_call_it=name,
            )
        self.route_name = name

    @property
    def name_of_local(self) -> str:
        return self.local.name if self.local is not None else ""

    def listed(self) -> list[ServedModel]:
        local = [self.local] if self.local is not None else []
        return local + sorted(self.remote.values(), key=lambda m: m.name)

    async def find(self, name: str | None) -> ServedModel:
        """The model a request names (or the default); 404 model_not_found if none is."""
        wanted = name or self.default
        if not wanted:
            return await self._default()
        found = self._lookup(wanted)
        if found is None and await self._refresh():
            found = self._lookup(wanted)
        if found is None and wanted in self.gone:
            raise APIError(
                503,
                f"the model {wanted!r} has no worker right now; retry shortly",
                code="no_capacity",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        if found is None:
            served = ", ".join(repr(m.name) for m in self.listed()[:MAX_NAMES_SHOWN]) or "none yet"
            raise APIError(
                404,
                f"the model {wanted!r} does not exist; this server serves {served}",
                param="model",
                code="model_not_found",
            )
        return found

    def _lookup(self, name: str) -> ServedModel | None:
        if self.local is not None and name == self.local.name:
            return self.local
        return self.remote.get(name)

    async def _default(self) -> ServedModel:
        if self.local is not None:
            return self.local
        if not self.remote:
            await self._refresh()
        if len(self.remote) == 1:
            return next(iter(self.remote.values()))
        if not self.remote:
            raise APIError(
                503,
                "no model is served yet: no remote worker has registered with the broker",
                code="no_model",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        names = ", ".join(repr(n) for n in sorted(self.remote)[:MAX_NAMES_SHOWN])
        raise APIError(
            400, f"several models are served ({names}): name one", param="model", code="no_model"
        )

    async def _refresh(self) -> bool:
        """Ask the broker now (at most every REFRESH_MIN_S); True if it answered."""
        if self._fetch_status is None or time.monotonic() - self._refreshed < REFRESH_MIN_S:
            return False
        self._refreshed = time.monotonic()
        try:
            status = await self._fetch_status()
        except Exception:  # the broker's trouble is the request's 404 or 503, not a crash
            return False
        self.update(status)
        return True
