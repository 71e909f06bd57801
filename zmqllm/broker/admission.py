"""Who may register what: a REGISTER's admission, without sockets.

The registry decides whether a REGISTER fits the models served (registry.py); this adds
what the CURVE key it came with allows. A worker key may be scoped (`zmqllm keys add
worker NAME --model M --layers A:B --digest D --num-layers N --kind layers|text`, its
claims in keys.py): each of its REGISTERs must then stay inside every claim, and one
outside is refused with OUT_OF_SCOPE and the claim it breaks, except the digest: the
reply never holds the pinned digest, so probing a key teaches its holder nothing.

A model is what its first worker said it is (its digest, layer count, kind, context),
until its last worker leaves. So a scoped key defines a model only when it pins all of
DEFINING_CLAIMS: else, while the model it names has no worker (still loading, or after a
broker restart), its REGISTER is not answered (``Verdict.waits``), and the worker
registers again after its backoff until a worker of an unscoped key has defined the
model. A REFUSED instead would make the worker exit, and after a broker restart scoped
workers on other hosts often register before the local ones.

Each key holds at most ``max_key_workers`` registrations at once (without keys,
``max_workers`` alone bounds them): what one key can add to STATUS and to the route
search is that many times what one registration adds (status.py bounds that).
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from dataclasses import dataclass

from zmqllm.broker.registry import Registry
from zmqllm.bus.keys import DEFINING_CLAIMS, claim_refusal
from zmqllm.bus.messages import MAX_TEXT, Refused, Register

__all__ = [
    "MAX_KEY_WORKERS",
    "OUT_OF_SCOPE",
    "Admission",
    "Verdict",
    "may_define",
    "scope_refusal",
]

# Registrations one worker key holds at once: a host's workers, with room to spare.
MAX_KEY_WORKERS = 64
OUT_OF_SCOPE = "registration outside this key's scope"
_KINDS = {"layers": "a model of layers", "text": "a remote (text) model"}


def _pin_refusal(claims: Mapping[str, str], reg: Register) -> str | None:
    """Why ``reg`` does not say of its model what the key pins (never the digest)."""
    kind = "text" if reg.text_model else "layers"
    pinned_kind = claims.get("kind")
    if pinned_kind is not None and pinned_kind != kind:
        issued = _KINDS.get(pinned_kind, "another kind")
        return f"the key was issued for {issued}, not {_KINDS[kind]}"
    pinned_layers = claims.get("num_layers")
    if pinned_layers is not None and (
        not pinned_layers.isdigit() or int(pinned_layers) != reg.num_layers
    ):
        return f"the key was issued for a model of {pinned_layers:.8} layers, not {reg.num_layers}"
    pinned_digest = claims.get("digest")
    # Constant time: how much of the digest matched must not show either.
    if pinned_digest is not None and not hmac.compare_digest(
        pinned_digest.encode(), reg.fingerprint.encode()
    ):
        return "the model's digest is not the one the key was issued for"
    return None


def scope_refusal(claims: Mapping[str, str], reg: Register) -> str | None:
    """Why a worker whose key has these ``claims`` may not send ``reg``, or None."""
    if not claims:
        return None
    why = claim_refusal(claims, reg.served, reg.start, reg.end) or _pin_refusal(claims, reg)
    return None if why is None else f"{OUT_OF_SCOPE}: {why}"[:MAX_TEXT]


def may_define(claims: Mapping[str, str]) -> bool:
    """Whether a key with these claims may define the model it registers: unscoped, or
    pinning all it would define."""
    return not claims or all(c in claims for c in DEFINING_CLAIMS)


@dataclass(frozen=True)
class Verdict:
    """What becomes of one REGISTER: admitted (both empty), ``refused`` (REFUSED with
    that reason), or ``waits`` (no answer now, and why, for the log)."""

    refused: str = ""
    waits: str = ""

    @property
    def admitted(self) -> bool:
        return not self.refused and not self.waits

    @property
    def reply(self) -> Refused | None:
        return Refused(reason=self.refused) if self.refused else None


class Admission:
    """The checks a REGISTER passes before the registry adds it, in order: its key's
    scope, the registry's own refusal, the key's share of registrations, and whether its
    key may define the model it names."""

    def __init__(
        self, registry: Registry, version: str, max_key_workers: int = MAX_KEY_WORKERS
    ) -> None:
        if max_key_workers < 1:
            raise ValueError("max_key_workers must be at least 1")
        self.registry = registry
        self.version = version
        self.max_key_workers = max_key_workers

    def check(
        self,
        identity: bytes,
        reg: Register,
        key: str = "",
        claims: Mapping[str, str] | None = None,
    ) -> Verdict:
        """The verdict on ``reg`` from the peer ``identity`` that holds the CURVE ``key``
        ("" without keys) whose ``claims`` are these. Changes nothing."""
        claims = claims or {}
        # The scope first: a registry refusal may name the served model's digest, which
        # for a scoped key can be its pinned one.
        why = scope_refusal(claims, reg) or self.registry.refusal(reg, self.version, identity)
        if why:
            return Verdict(refused=why)
        if key and self.held(key, identity) >= self.max_key_workers:
            return Verdict(
                refused=f"this worker's key holds {self.max_key_workers} registrations, "
                "the most one key may"
            )
        if not may_define(claims) and self.registry.defines(reg, identity):
            return Verdict(
                waits=f"model {reg.served!r:.80} has no worker, and a key scoped without "
                "--digest, --num-layers and --kind may not define it: waiting for a "
                "worker of an unscoped key"
            )
        return Verdict()

    def held(self, key: str, identity: bytes | None = None) -> int:
        """Registrations of ``key``, but the one of ``identity`` (it would be replaced)."""
        return sum(
            1 for w in self.registry.workers.values() if w.key == key and w.identity != identity
        )
