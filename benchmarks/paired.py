"""Two variants measured in alternating rounds, compared round by round.

The cores of a shared machine drift by more than a few percent between runs minutes
apart, so two single runs cannot show a small difference. Alternating the variants, the
order flipped every round, and taking each round's ratio cancels most of the drift; the
median and the range of those ratios are the figures to report.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from benchmarks.stats import spread


def alternate(
    rounds: int, base: tuple[str, Callable[[], float]], other: tuple[str, Callable[[], float]]
) -> dict[str, list[float]]:
    """Run both ``rounds`` times, ``base`` first in even rounds and second in odd ones.
    A round in which either run raises is reported and left out, pair and all."""
    out: dict[str, list[float]] = {base[0]: [], other[0]: []}
    for r in range(rounds):
        got: dict[str, float] = {}
        try:
            for name, run in (base, other) if r % 2 == 0 else (other, base):
                got[name] = run()
        except Exception as exc:  # one bad round (a cluster that did not start) costs itself
            print(f"  round {r + 1} left out: {type(exc).__name__}: {str(exc)[:2000]}")
            continue
        for name, value in got.items():
            out[name].append(value)
        print(
            f"  round {r + 1}: " + ", ".join(f"{name} {got[name]:.2f}" for name in out),
            flush=True,
        )
    if not out[base[0]]:
        raise SystemExit("every round failed")
    return out


def against(values: dict[str, list[float]], base: str, measure: str) -> dict[str, Any]:
    """Each variant's runs (rounds in the same order for all), their median and range as
    ``measure``, and their ratio to ``base`` round by round; a line printed for each."""
    rows: dict[str, Any] = {}
    for name, xs in values.items():
        ratios = [x / b for x, b in zip(xs, values[base], strict=True)]
        rows[name] = {measure: spread(xs), f"vs_{base}": spread(ratios), "runs": xs}
        s, q = rows[name][measure], rows[name][f"vs_{base}"]
        print(
            f"  {name:>8}: {s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f})"
            f"   vs {base}: {q['median']:.3f} ({q['min']:.3f}-{q['max']:.3f})"
        )
    return rows


def compare(values: dict[str, list[float]], base: str, other: str) -> dict[str, Any]:
    """Each variant's median and range, and ``other / base`` per round."""
    ratios = [b / a for a, b in zip(values[base], values[other], strict=True)]
    return {
        base: {"values": values[base], **spread(values[base])},
        other: {"values": values[other], **spread(values[other])},
        f"ratio_{other}_vs_{base}": spread(ratios),
    }


def describe(result: dict[str, Any], base: str, other: str, unit: str) -> str:
    r = result[f"ratio_{other}_vs_{base}"]
    lines = [
        f"  {name}: median {result[name]['median']:.2f} {unit} "
        f"(range {result[name]['min']:.2f}-{result[name]['max']:.2f})"
        for name in (base, other)
    ]
    lines.append(
        f"  {other}/{base} per round: median {r['median']:.3f} "
        f"(range {r['min']:.3f}-{r['max']:.3f})"
    )
    return "\n".join(lines)
