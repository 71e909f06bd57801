"""Per-token latency of two revisions of zmqllm, measured in alternating rounds.

On a shared machine the speed of the cores drifts by more than a small regression
between two runs made minutes apart, so comparing one run of each hides or invents
one. This script checks the older revision out into a temporary git worktree and
runs the same measurement (a local cluster of the default model split into stages,
streamed over `POST /v1/completions`, inter-token latency p50) for the old and the
working tree in turn, round after round, and reports both medians, their run-to-run
ranges and the ratio of every round's pair.

    python benchmarks/compare_revisions.py --before 8809ed1 [--rounds 6] [--stages 2] [--quant int4]

Writes benchmarks/results/compare_revisions.json. Each round runs in a fresh process
whose `zmqllm` is imported from the tree under test; the older tree must have
`testbed.cluster.Cluster` or, before testbed/ existed, `zmqllm.local_cluster.Cluster`
(every revision since the benchmarks were added has one of them).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # see benchmarks/__init__.py

import argparse
import json
import os
import subprocess
import tempfile

from benchmarks.http_client import RequestInput, run
from benchmarks.paired import alternate, compare, describe
from benchmarks.report import write_json
from benchmarks.stats import ms, pct

REPO = Path(__file__).resolve().parents[1]
# per_token_latency.py's request, made again here: that module imports this tree's
# testbed and zmqllm, which must not load into an older tree's process (the shared
# modules imported above import neither).
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def measure(
    root: Path, stages: int, new_tokens: int, requests: int, threads: int, quant: str = "none"
) -> float:
    """In a fresh process whose sys.path starts at ``root``: ITL p50 in ms."""
    sys.path.insert(0, str(root))

    def stream_once(port: int, n: int) -> list[float]:
        """The inter-token gaps of one streamed completion, the first token's left out."""
        url = f"http://127.0.0.1:{port}/v1/completions"
        body = RequestInput(
            url, prompt=PROMPT, max_tokens=n, ignore_eos=True, temperature=0, timeout=300
        )
        return run(body).itl[1:]

    if (root / "zmqllm" / "config" / "__init__.py").is_file():
        from zmqllm.config.layers import split_layers
        from zmqllm.config.paths import default_model_dir
    else:  # a revision from before the package-by-role layout (zmqllm/config.py)
        from zmqllm.config import default_model_dir  # type: ignore[no-redef]

        try:
            from zmqllm.layers import split_layers  # type: ignore[import-not-found,no-redef]
        except ImportError:  # a revision from before zmqllm/layers.py
            from zmqllm.config import split_layers  # type: ignore[attr-defined,no-redef]

    if (root / "testbed").is_dir():
        from testbed.cluster import Cluster
    else:  # a revision from before testbed/: the cluster lived in the runtime package
        from zmqllm.local_cluster import Cluster  # type: ignore[import-not-found,no-redef]

    text = (default_model_dir() / "config.json").read_text()
    layers = split_layers(json.loads(text)["num_hidden_layers"], stages)
    with tempfile.TemporaryDirectory() as tmp:
        cluster = Cluster(
            Path(tmp),
            default_model_dir(),
            heartbeat=1.0,
            threads=threads,
            batch_threads=max(1, (os.cpu_count() or 1) // stages),
            **({"quant": quant} if quant != "none" else {}),  # older trees: float32 only
        )
        try:
            cluster.start_all(tuple(f"{a}:{b}" for a, b in layers))
            stream_once(cluster.http_port, 16)  # warm-up
            gaps: list[float] = []
            for _ in range(requests):
                gaps += stream_once(cluster.http_port, new_tokens)
            return ms(pct(gaps, 50))
        finally:
            cluster.stop()


def run_round(root: Path, a: argparse.Namespace, cache: Path | None) -> float:
    cmd = [sys.executable, __file__, "--measure", str(root)]
    cmd += ["--stages", str(a.stages), "--new-tokens", str(a.new_tokens)]
    cmd += ["--requests", str(a.requests), "--threads", str(a.threads), "--quant", a.quant]
    env = dict(os.environ, PYTHONPATH=f"{root}{os.pathsep}{REPO}")
    if cache is not None:  # the older tree builds and caches its own native kernel
        env["XDG_CACHE_HOME"] = str(cache)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"measuring {root} failed:\n{done.stderr[-1500:]}")
    return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", help="the older revision (any git rev)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quant", choices=("none", "int8", "int4"), default="none")
    ap.add_argument("--out", default="benchmarks/results/compare_revisions.json")
    ap.add_argument("--measure", metavar="ROOT", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.measure:
        print(measure(Path(a.measure), a.stages, a.new_tokens, a.requests, a.threads, a.quant))
        return
    if not a.before:
        ap.error("--before REV is required")
    from zmqllm.config.paths import default_model_dir
    from zmqllm.models.prepare import prepare_default_model

    prepare_default_model(default_model_dir())
    sha = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--verify", f"{a.before}^{{commit}}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # Kept between runs: a first build of the kernel must not land inside a round.
    cache = Path(tempfile.gettempdir()) / f"zmqllm-compare-{sha[:12]}"
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "before"
        subprocess.run(
            ["git", "-C", str(REPO), "worktree", "add", "--detach", str(old), sha],
            check=True,
            capture_output=True,
        )
        try:
            values = alternate(
                a.rounds,
                ("before", lambda: run_round(old, a, cache)),
                ("after", lambda: run_round(REPO, a, None)),
            )
        finally:
            subprocess.run(
                ["git", "-C", str(REPO), "worktree", "remove", "--force", str(old)],
                capture_output=True,
            )
    result = compare(values, "before", "after")
    result["before"]["rev"] = sha
    print(
        f"\nITL p50 over {len(values['before'])} alternating rounds, {a.stages} stages, "
        f"{a.new_tokens} tokens x {a.requests} requests each; before = {sha[:10]}, "
        "after = the working tree\n" + describe(result, "before", "after", "ms")
    )
    keys = ("rounds", "stages", "new_tokens", "requests", "threads", "quant")
    meta = {k: getattr(a, k) for k in keys}
    write_json(Path(a.out), {"meta": meta, "results": result})


if __name__ == "__main__":
    main()
