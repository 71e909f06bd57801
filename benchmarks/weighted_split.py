"""The weighted split against the equal split, on a pair of test hosts of unequal speed.

Two test hosts (network namespaces on one bridge, testbed/netns.py) each run one stage of
the default model on one thread; host 2's processes get half a core (a cgroup CPU quota,
testbed/cpu_limit.py), host 3's a whole one. `zmqllm measure` runs on each host as its
worker would; `zmqllm plan --figures` splits the layers by those figures. Then, for the
equal split ("1/2", "2/2") and the weighted one in turn, ``--rounds`` times each: both
workers start with that split, 16 streams ask for ``--new-tokens`` tokens each at once
(``ignore_eos``, through the gateway on host 1), and the aggregate tokens/s is timed.
Printed: each split's median tokens/s with its min-max over the rounds, the plan's
expected figures beside them, and the ratio weighted / equal. Needs root.

    python benchmarks/weighted_split.py [--rounds 3] [--streams 16] [--new-tokens 32]
        [--model DIR --dtype bfloat16]

``--model``: another model (default: the default one). On the default 135M model a step's
fixed costs (the broker, the gateway and both hosts share this machine's cores) weigh as
much as the layers; a Mistral-7B-shaped model of a few layers shows the split itself:

    zmqllm prepare-model --random mistral-7b --layers 8 --output DIR --no-gguf
    python benchmarks/weighted_split.py --model DIR --dtype bfloat16

Writes benchmarks/results/weighted_split.json (with --model: weighted_split_NAME.json).
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
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from benchmarks.report import cpu_name, write_json
from benchmarks.stats import median, spread_text
from testbed.cpu_limit import CpuLimit, cpu_limit_unusable
from testbed.hosts import HostCluster, _env, zmqllm_command
from testbed.netns import Testbed, unusable_reason
from zmqllm.config.paths import default_model_dir
from zmqllm.launch.child_process import ChildProcess, spawn

SLOW, FULL = 2, 3  # the hosts of stage 1 (half a core) and stage 2 (a whole one)


def model_flags(c: HostCluster, dtype: str) -> list[str]:
    return ["--model", str(c.model_dir), *(["--dtype", dtype] if dtype else [])]


def measure(c: HostCluster, index: int, limit: CpuLimit | None, dtype: str) -> dict[str, Any]:
    args = ["measure", "--json", *model_flags(c, dtype), "--threads", "1"]
    cmd = c.bed.host(index).command(*zmqllm_command(), *args)
    if limit is not None:
        cmd = limit.command(*cmd)  # joined before `ip netns exec` (see cpu_limit.py)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=_env())
    if done.returncode != 0:
        raise RuntimeError(f"zmqllm measure on host {index}: {done.stderr[-1000:]}")
    figures: dict[str, Any] = json.loads(done.stdout)
    return figures


def plan(c: HostCluster, folder: Path, slow: dict, full: dict) -> dict[str, Any]:
    (folder / "slow.json").write_text(json.dumps(slow))
    (folder / "full.json").write_text(json.dumps(full))
    config = folder / "pair.toml"
    stage = '\n[[stages]]\nlayers = "auto"\n'
    config.write_text(f'[model]\npath = "{c.model_dir}"\n' + stage + stage)
    args = ["plan", "--config", str(config), "--json", "--figures"]
    args += [str(folder / "slow.json"), str(folder / "full.json")]
    done = c.head.run(*zmqllm_command(), *args)
    if done.returncode != 0:
        raise RuntimeError(f"zmqllm plan: {done.stderr[-1000:]}")
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def start_pair(
    c: HostCluster, ranges: list[str], limit: CpuLimit, dtype: str
) -> list[ChildProcess]:
    procs = []
    for index, layers in zip((SLOW, FULL), ranges, strict=True):
        args = ["worker", *model_flags(c, dtype), "--layers", layers, "--broker", c.backend]
        args += ["--threads", "1", "--name", f"host-{index}", *c.beats()]
        args += ["--keys", str(c.folder(index) / "keys"), "--log-format", "json"]
        cmd = c.bed.host(index).command(*zmqllm_command(), *args)
        if index == SLOW:
            cmd = limit.command(*cmd)
        log = c.folder(index) / f"worker-{layers.replace(':', '-').replace('/', 'of')}.log"
        procs.append(spawn(f"worker-{index}", cmd, log, env=_env()))
    c.procs.extend(procs)
    c.wait_for(lambda: len(c.status()["workers"]) == 2, 600, "both workers", pause=1.0)
    c.wait_ready(timeout=600)
    return procs


def stop_pair(c: HostCluster, procs: list[ChildProcess]) -> None:
    for p in procs:
        p.popen.kill()
        p.popen.wait(timeout=30)
        c.procs.remove(p)
    c.wait_for(lambda: not c.status()["workers"], 60, "the workers to leave", pause=0.5)


def tokens_per_s(c: HostCluster, streams: int, new_tokens: int) -> float:
    body = {
        "prompt": "Tell me about rivers.",
        "max_tokens": new_tokens,
        "ignore_eos": True,
        "temperature": 0,
    }

    def one(_: int) -> int:
        status, raw = c.post_json("/v1/completions", body)
        if status != 200:
            raise RuntimeError(f"/v1/completions: {status} {raw[:200]!r}")
        return int(json.loads(raw)["usage"]["completion_tokens"])

    with ThreadPoolExecutor(streams) as pool:
        list(pool.map(one, range(2)))  # warm: first forwards of each row count
        t = time.perf_counter()
        total = sum(pool.map(one, range(streams)))
        return total / (time.perf_counter() - t)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--model", default="", help="a model directory (default: the default model)")
    p.add_argument("--dtype", default="", help="the workers' --dtype (default: the config's)")
    ns = p.parse_args()
    reason = unusable_reason() or cpu_limit_unusable()
    if reason:
        sys.exit(f"weighted_split: {reason}")
    model = Path(ns.model).resolve() if ns.model else default_model_dir()
    if not ns.model and not (model / "config.json").is_file():
        subprocess.run([*zmqllm_command(), "prepare-model"], check=True)
    bed = Testbed(3)
    root = Path(tempfile.mkdtemp(prefix="zmqllm-weighted-"))
    c = HostCluster(bed, root, model, {"a": SLOW, "b": FULL})
    limit = CpuLimit(f"{bed.tag}-half", cores=0.5)
    try:
        bed.up()
        c.make_keys()
        c.start_broker()
        c.start_gateway()
        slow, full = measure(c, SLOW, limit, ns.dtype), measure(c, FULL, None, ns.dtype)
        planned = plan(c, root, slow, full)
        weighted = [f"{a}:{b}" for a, b in planned["weighted"]["split"]]
        splits = {"equal": ["1/2", "2/2"], "weighted": weighted}
        rates: dict[str, list[float]] = {name: [] for name in splits}
        for _ in range(ns.rounds):
            for name, ranges in splits.items():
                procs = start_pair(c, ranges, limit, ns.dtype)
                try:
                    rates[name].append(tokens_per_s(c, ns.streams, ns.new_tokens))
                finally:
                    stop_pair(c, procs)
    finally:
        c.stop()
        limit.close()
        bed.close()
        shutil.rmtree(root, ignore_errors=True)
    print(
        f"{cpu_name()}; {model.name}; stage 1 on half a core, stage 2 on one; {ns.streams} streams"
    )
    print(f"figures: stage 1 {slow['ms_16']:.2f} ms/layer at 16 rows, stage 2 {full['ms_16']:.2f}")
    print(f"{'split':<9} {'layers':<14} {'tokens/s (median, min-max)':<30} {'plan':>8}")
    for name in splits:
        shown = " ".join(f"{a}:{b}" for a, b in planned[name]["split"])
        expected = planned[name]["tokens_per_s"]
        print(f"{name:<9} {shown:<14} {spread_text(rates[name], 1):<30} {expected:>8.1f}")
    ratio = median(rates["weighted"]) / median(rates["equal"])
    print(f"weighted / equal: {ratio:.2f}x (median of {ns.rounds} rounds each, interleaved)")
    stem = f"weighted_split_{model.name}" if ns.model else "weighted_split"
    write_json(
        Path(__file__).parent / "results" / f"{stem}.json",
        {
            "cpu": cpu_name(),
            "model": model.name,
            "dtype": ns.dtype,
            "streams": ns.streams,
            "new_tokens": ns.new_tokens,
            "figures": {"stage1_half_core": slow, "stage2_full_core": full},
            "plan": planned,
            "tokens_per_s": rates,
            "ratio": ratio,
        },
    )


if __name__ == "__main__":
    main()
