"""What every benchmark script does with its figures: a JSON file, and a PNG beside
it where matplotlib is installed."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any


def write_json(out: Path, payload: dict[str, Any]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2))
    print(f"wrote {out}")


def write_plot(out: Path, draw: Callable[[Any], Any]) -> None:
    """``draw(pyplot)`` builds a figure and returns it; it is saved as ``out`` with .png."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install matplotlib)")
        return
    fig = draw(plt)
    fig.tight_layout()
    png = out.with_suffix(".png")
    fig.savefig(png, dpi=120)
    print(f"wrote {png}")


def cpu_name() -> str:
    """The CPU's model name, which every figure names (machines of one kind differ)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown"
