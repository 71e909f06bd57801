"""Layer specs: which half-open range of a model's decoder layers a worker serves.

A spec is a range ``"start:end"`` (either side may be left out), a stage ``"k/n"`` (the
k-th of n contiguous shares of about equal cost, 1-based), ``""`` (all layers) or
``"auto"`` (chosen from measured figures: by the broker for a worker, by the launcher's
weighted split for ``[[stages]]``; see weighted_split.py).
``check_layer_spec`` checks what can be checked without the model (for flags and config files);
``parse_layers`` turns a spec into the range for a model's layer count, and
``split_layers`` is the split behind ``"k/n"``. Mistakes raise ``ConfigError``.

Torch-free: every process checks the layer specs in its config (loading.py).
"""

from __future__ import annotations

import re

from zmqllm.config.settings import ConfigError

__all__ = ["AUTO", "check_layer_spec", "parse_layers", "split_layers"]

AUTO = "auto"

_RANGE_RE = re.compile(r"([0-9]*)\s*:\s*([0-9]*)")
_STAGE_RE = re.compile(r"([0-9]+)\s*/\s*([0-9]+)")


def split_layers(num_layers: int, stages: int, head_cost: float = 0.0) -> list[tuple[int, int]]:
    """Contiguous half-open ranges covering ``[0, num_layers)``, each stage of about equal
    cost. The last stage also runs the output layer, which costs ``head_cost`` layers
    (ModelArgs.head_cost: 8 for the default model, whose 49,152-token vocabulary makes
    the head as big as 8 of its layers), so it takes that many fewer; the others share
    the rest evenly, earlier ones taking the remainder (30 layers in 4 stages with no
    head cost -> 8, 8, 7, 7; with a head of 8 -> 10, 9, 9, 2)."""
    if num_layers < 1:
        raise ConfigError(f"a model needs at least one layer, got {num_layers}")
    if not 1 <= stages <= num_layers:
        raise ConfigError(f"cannot split {num_layers} layers into {stages} stages")
    if head_cost > 0 and stages > 1:
        # Round half up, the same on every machine (round() goes to even).
        last = int((num_layers + head_cost) / stages - head_cost + 0.5)
        last = min(max(last, 1), num_layers - stages + 1)
    else:
        last = num_layers // stages
    base, extra = divmod(num_layers - last, stages - 1) if stages > 1 else (0, 0)
    sizes = [base + (1 if i < extra else 0) for i in range(stages - 1)] + [last]
    ranges = []
    start = 0
    for size in sizes:
        ranges.append((start, start + size))
        start += size
    return ranges


def _parse_layer_form(spec: str) -> tuple[str, int | None, int | None]:
    """Check a layer spec's syntax and whatever can be checked without the model.

    Returns ("all", None, None), ("auto", None, None), ("range", start | None, end |
    None) or ("stage", k, n).
    """
    text = spec.strip()
    if not text:
        return ("all", None, None)
    if text == AUTO:
        return ("auto", None, None)
    stage = _STAGE_RE.fullmatch(text)
    if stage:
        k, n = int(stage[1]), int(stage[2])
        if n < 1 or not 1 <= k <= n:
            raise ConfigError(f"layer spec {spec!r}: stage k/n needs 1 <= k <= n (1-based)")
        return ("stage", k, n)
    span = _RANGE_RE.fullmatch(text)
    if span:
        start = int(span[1]) if span[1] else None
        end = int(span[2]) if span[2] else None
        if start is not None and end is not None and start >= end:
            raise ConfigError(f"layer spec {spec!r}: start must be below end (half-open)")
        return ("range", start, end)
    raise ConfigError(
        f"bad layer spec {spec!r}: expected 'start:end' (half-open, either side may be "
        "omitted), 'k/n' (stage k of n, 1-based), 'auto' (from measured figures) or '' "
        "(all layers)"
    )


def check_layer_spec(spec: str) -> None:
    """Reject a layer spec that is wrong for any model ("3/2", "5:1", "half").

    For checking flags before the model's layer count is known; parse_layers still checks
    the spec against the model.
    """
    _parse_layer_form(spec)


def parse_layers(spec: str, num_layers: int, head_cost: float = 0.0) -> tuple[int, int]:
    """The half-open layer range ``(start, end)`` a layer spec selects in a model
    (``head_cost``: see split_layers)."""
    if num_layers < 1:
        raise ConfigError(f"layer spec {spec!r}: a model needs at least one layer")
    kind, a, b = _parse_layer_form(spec)
    if kind == "auto":
        raise ConfigError(
            'layer spec "auto" is resolved from measured figures before the layers load '
            "(the broker answers a worker, the launcher splits [[stages]])"
        )
    if kind == "all":
        return (0, num_layers)
    if kind == "stage":
        assert a is not None and b is not None
        if b > num_layers:
            raise ConfigError(
                f"layer spec {spec!r}: {b} stages but the model has only {num_layers} layers"
            )
        return split_layers(num_layers, b, head_cost)[a - 1]
    start = 0 if a is None else a
    end = num_layers if b is None else b
    if not 0 <= start < end <= num_layers:
        raise ConfigError(
            f"layer spec {spec!r}: range [{start}, {end}) is outside the model's "
            f"{num_layers} layers"
        )
    return (start, end)
