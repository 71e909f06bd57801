"""``layers = "auto"`` in ``[[stages]]``, and `zmqllm plan`: split the layers by what each
stage's worker measured, not by equal cost.

Each stage's figures (config/weighted_split.Figures) come from a file `zmqllm measure` wrote
on the machine that will run it (``--figures``, in the order of the stages), else from
`zmqllm measure` run here, in a process of its own (the launcher imports no torch), with
the threads and memory the stage's worker will have:

- under `zmqllm up` every worker of this machine takes turns on all its cores
  (``cpu_lock``) and gets an equal share of its free memory (launch/plan.py), so one
  probe serves every stage, each with that share;
- under `zmqllm ray up` a stage asks for ``cpus`` and ``memory`` of some node: the
  probe runs with that many threads (at least one) and that memory, here, standing for
  a node of this machine's kind.

``weighted_split`` then gives each stage a share of the compute proportional to its rate,
within its memory, the head's cost counted on the last stage. `zmqllm plan` prints that
split and the equal-cost one ("k/n") side by side with what each should give.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from zmqllm.config.flags import apply_flags
from zmqllm.config.layers import AUTO, split_layers
from zmqllm.config.loading import load_config, parse_size
from zmqllm.config.settings import Config, ConfigError, StageSpec
from zmqllm.config.weighted_split import Expected, Figures, expected, weighted_split
from zmqllm.launch.plan import memory_share_mb, stages_of

__all__ = ["add_plan_command", "auto_stages", "measure_here", "stage_figures", "uses_auto"]

MEASURE_TIMEOUT_S = 600.0  # converting the default model on first use included


def uses_auto(cfg: Config) -> bool:
    """Whether the config's stages ask for a measured split; ConfigError when only some do."""
    auto = [s.layers.strip() == AUTO for s in stages_of(cfg)]
    if any(auto) and not all(auto):
        raise ConfigError(
            'layers = "auto" splits all [[stages]] together: give it to every stage or to none'
        )
    return all(auto) and bool(cfg.stages)


def measure_here(config_path: Path | None, flags: Sequence[str] = ()) -> tuple[Figures, int]:
    """`zmqllm measure` in a process of its own: this machine's figures, and the model's
    layer count."""
    cmd = [sys.executable, "-m", "zmqllm.cli", "measure", "--json"]
    if config_path is not None:
        cmd += ["--config", str(config_path)]
    done = subprocess.run(
        [*cmd, *flags], capture_output=True, text=True, timeout=MEASURE_TIMEOUT_S, check=False
    )
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-3:]
        raise ConfigError(f"`zmqllm measure` failed: {' / '.join(tail)[:400]}")
    raw = json.loads(done.stdout)
    return Figures.from_dict(raw), int(raw["num_layers"])


def _stage_flags(cfg: Config, stage: StageSpec, ray: bool) -> list[str]:
    flags = ["--model", cfg.model.path, "--quant", cfg.model.quant, "--dtype", cfg.model.dtype]
    if ray:
        flags += ["--threads", str(max(1, math.floor(stage.cpus)))]
        if stage.memory:
            flags += ["--max-memory-mb", str(parse_size(stage.memory) >> 20)]
    elif not cfg.worker.max_memory_mb and (share := memory_share_mb(cfg)):
        flags += ["--max-memory-mb", str(share)]
    return flags


def stage_figures(
    cfg: Config,
    config_path: Path | None,
    files: Sequence[str] = (),
    ray: bool = False,
) -> tuple[list[Figures], int]:
    """Each stage's figures (one entry per stage, replicas alike) and the model's layers."""
    stages = stages_of(cfg)
    if len(files) > len(stages):
        raise ConfigError(f"{len(files)} --figures files for {len(stages)} stages")
    out: list[Figures] = []
    num_layers = 0
    probed: dict[tuple[str, ...], tuple[Figures, int]] = {}
    for i, stage in enumerate(stages):
        if i < len(files):
            raw = json.loads(Path(files[i]).expanduser().read_text())
            out.append(Figures.from_dict(raw))
            num_layers = num_layers or int(raw.get("num_layers", 0))
            continue
        flags = tuple(_stage_flags(cfg, stage, ray))
        if flags not in probed:
            probed[flags] = measure_here(config_path, flags)
        figures, num_layers = probed[flags]
        out.append(figures)
    if not num_layers:
        raise ConfigError("the --figures files do not say the model's num_layers")
    return out, num_layers


def auto_stages(
    cfg: Config, config_path: Path | None, ray: bool = False, say: Any = None
) -> Config:
    """``cfg`` with each ``layers = "auto"`` stage given its range of the weighted split."""
    if not uses_auto(cfg):
        return cfg
    figures, num_layers = stage_figures(cfg, config_path, ray=ray)
    split = weighted_split(num_layers, figures)
    stages = [replace(s, layers=f"{a}:{b}") for s, (a, b) in zip(cfg.stages, split, strict=True)]
    if say is not None:
        shown = ", ".join(f"{a}:{b}" for a, b in split)
        say(f"layers split by measured speed and memory: {shown}")
    return replace(cfg, stages=stages)


def _row(name: str, split: list[tuple[int, int]], exp: Expected) -> str:
    ranges = " ".join(f"{a}:{b}" for a, b in split)
    return (
        f"{name:<9} {ranges:<28} {exp.bottleneck_ms:>10.2f} {exp.ms_per_token:>11.2f} "
        f"{exp.tokens_per_s:>9.1f}"
    )


def cmd_plan(ns: argparse.Namespace) -> int:
    path = Path(ns.config).expanduser().resolve() if ns.config else None
    cfg = apply_flags(load_config(path), "plan", ns)
    figures, num_layers = stage_figures(cfg, path, ns.figures or (), ray=ns.ray)
    k = len(figures)
    equal = split_layers(num_layers, k, figures[-1].head_cost)
    weighted = weighted_split(num_layers, figures)
    e_equal = expected(equal, figures, num_layers)
    e_weighted = expected(weighted, figures, num_layers)
    if ns.json:
        print(
            json.dumps(
                {
                    "num_layers": num_layers,
                    "figures": [f.to_dict() for f in figures],
                    "equal": {"split": equal, **e_equal.__dict__},
                    "weighted": {"split": weighted, **e_weighted.__dict__},
                },
                indent=2,
            )
        )
        return 0
    print(
        f"{num_layers} layers, {k} stages; per stage, ms per layer (and the head) at 1 / 16 rows:"
    )
    for i, f in enumerate(figures, 1):
        print(
            f"  stage {i}: {f.ms_1:.3f} / {f.ms_16:.3f} ms, head {f.head_ms(1):.2f} / "
            f"{f.head_ms():.2f} ms, memory {f.memory_bytes >> 20} MiB, round trip "
            f"{f.rtt_ms:.2f} ms"
        )
    print(f"\n{'split':<9} {'layers':<28} {'slowest ms':>10} {'ms/token':>11} {'tokens/s':>9}")
    print(_row("equal", equal, e_equal))
    print(_row("weighted", weighted, e_weighted))
    gain = e_weighted.tokens_per_s / e_equal.tokens_per_s if e_equal.tokens_per_s else 0.0
    print(
        f"\nweighted / equal: {gain:.2f}x tokens/s at 16 streams (slowest stage's 16-row "
        "forward; stages overlapping), ms/token for one stream as shown"
    )
    return 0


def add_plan_command(sub: Any, add_flags: Any) -> None:
    """Add ``plan`` to the ``zmqllm`` parser's sub-parsers."""
    p = sub.add_parser(
        "plan", help="split [[stages]] by measured speed and memory, beside the equal split"
    )
    p.add_argument("--config", metavar="FILE", help="TOML config file with [[stages]]")
    add_flags(p, "plan")
    p.add_argument(
        "--figures",
        nargs="+",
        metavar="FILE",
        help="figures `zmqllm measure --json` wrote on each stage's machine, in stage order "
        "(stages past the files are measured here)",
    )
    p.add_argument(
        "--ray",
        action="store_true",
        help="measure each stage with its [[stages]] cpus and memory, as `ray up` does",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_plan)
