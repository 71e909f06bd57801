"""Which build computed a stream's tokens, so that a failover replay keeps to it.

Replicas of a pool may differ in what decides their numbers (drift.py refuses only
another quant or dtype): a torch release, the compiled kernel, the CPU's or GPU's kernels,
the dtype activations travel in. A stream continued on such a replica would be text of two
builds. So each worker gets a short **build key**, a digest of the fields of its REGISTER's
``build`` that decide its numbers (``numeric_fields``), and a route's build is its hops'
layers and keys ("0:2:1f0c9a7e3b2d", "2:4:…"). The broker reports it with a stream's first
TOKEN; a replay's OPEN names it again and is routed only onto workers whose range and key
match a hop of it (``RouteBuild.admits``): the same layers on the same builds, or it waits
and fails (docs/failover.md).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = [
    "HOP_PATTERN",
    "KEY_LEN",
    "NUMERIC_FIELDS",
    "RouteBuild",
    "build_key",
    "numeric_fields",
    "route_build",
]

# The build fields (worker/build_info.py) that decide a worker's numbers. Not python,
# numpy or protocol: the same tokens come out whichever of those runs the stage.
NUMERIC_FIELDS = (
    "zmqllm",
    "torch",
    "kernel",  # the compiled kernel's key ("none": torch's own)
    "capability",  # torch's CPU kernel path, or the GPU
    "cpu",  # the instruction sets our kernel (-march=native) was built for
    "quant",
    "dtype",
    "wire_dtype",
    "device",
    "matrix_units",  # the units several rows' products run on (int8 activations or not)
)
KEY_LEN = 12  # hex digits: 48 bits, a collision among one cluster's few builds is negligible
# One hop of a route's build as it travels (at most 22 characters, the wire's bound).
HOP_PATTERN = re.compile(r"([0-9]{1,4}):([0-9]{1,4}):([0-9a-f]{12})")
SHOWN = 200  # characters of a route build that an error message shows


class Hop(Protocol):
    """What a route's build needs of a worker: its layers and its build key."""

    @property
    def start(self) -> int: ...

    @property
    def end(self) -> int: ...

    @property
    def build_key(self) -> str: ...


def numeric_fields(build: Mapping[str, Any], *, last_stage: bool) -> dict[str, Any]:
    """The fields of ``build`` that decide the numbers, put so that workers that compute
    alike have equal ones. A field a worker did not send (an older one) stays out."""
    out = {f: build[f] for f in NUMERIC_FIELDS if f in build}
    device = out.get("device")
    if isinstance(device, str):
        # cuda:0 and cuda:1 compute alike; on a GPU the host CPU computes nothing (the
        # GPU is named by "capability").
        out["device"] = device.partition(":")[0]
        if out["device"] != "cpu":
            out.pop("cpu", None)
    wire = out.pop("wire_dtype", None)
    if not last_stage:
        # "auto" sends activations in the model's dtype: as if it were named. The last
        # stage sends none (tokens only), so its wire dtype is no part of its numbers.
        out["wire_dtype"] = out.get("dtype") if wire in (None, "auto") else wire
    return out


def build_key(build: Mapping[str, Any], *, last_stage: bool) -> str:
    """The worker's build key: KEY_LEN hex digits of a digest of its numeric fields.
    Values are told apart by type as well as text (2 and "2" are not one build)."""
    fields = numeric_fields(build, last_stage=last_stage)
    raw = json.dumps(fields, sort_keys=True, default=repr, separators=(",", ":"))
    return hashlib.sha256(raw.encode()).hexdigest()[:KEY_LEN]


def route_build(route: Sequence[Hop]) -> tuple[str, ...]:
    """The build of a route: "START:END:KEY" per hop, in stage order (the TOKEN field)."""
    return tuple(f"{w.start}:{w.end}:{w.build_key}" for w in route)


@dataclass(frozen=True)
class RouteBuild:
    """A replay's route build, read from its OPEN: the key each hop's layers must have."""

    hops: tuple[str, ...]
    keys: Mapping[tuple[int, int], str]  # (start, end) -> build key
    end: int  # the layer the last hop ends at: the model's num_layers

    @classmethod
    def parse(cls, hops: Sequence[str]) -> RouteBuild:
        """ValueError unless ``hops`` chain from layer 0, each starting where the last
        ended (the wire checked each one's form)."""
        if not hops:
            raise ValueError("a route build names at least one hop")
        keys: dict[tuple[int, int], str] = {}
        pos = 0
        for hop in hops:
            m = HOP_PATTERN.fullmatch(hop)
            if m is None:
                raise ValueError(f"hop {hop[:40]!r} is not START:END:KEY")
            start, end = int(m[1]), int(m[2])
            if start != pos or end <= start:
                raise ValueError(f"hop {hop} does not go on from layer {pos}")
            keys[start, end] = m[3]
            pos = end
        return cls(tuple(hops), keys, pos)

    def admits(self, w: Hop) -> bool:
        """Whether ``w`` may serve a hop of a route of this build: the same layers, the
        same build key. (A chain of such workers from 0 is then this very route shape.)"""
        return self.keys.get((w.start, w.end)) == w.build_key

    def describe(self) -> str:
        """The hops, as a person reads them in an error message (cut at SHOWN chars)."""
        text = " ".join(self.hops)
        return text if len(text) <= SHOWN else text[: SHOWN - 3] + "..."

    def no_route(self, waited: float) -> str:
        """What a replay that found no route of this build in ``waited`` seconds is told."""
        return (
            f"no capacity: no route of the stream's build ({self.describe()}) after "
            f"{waited:g}s: a replay goes only onto workers of the build the stream started "
            "on, so that its text is one build's"
        )
