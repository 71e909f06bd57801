"""The pause a failover adds: SIGKILL the worker serving a stream, time until its next token.

A local cluster on the default model (or ``--tiny``) with two replicas per stage. Each
round streams one greedy completion over HTTP (`POST /v1/completions`, `stream: true`),
SIGKILLs the worker holding it at stage 0 or the last stage (alternating) after
``--kill-after`` tokens, and stamps every token's arrival. Reported per round and as
ranges:

- kill → next token: what the client waits for (detection + reopen + replay prefill);
- the replay's prefill: the time to first token of an undisturbed request whose prompt
  is as long as the history replayed (the prompt plus the tokens before the kill);
- the pause less that prefill: what failover itself costs (the issue's target: ≤ 2 s);
- the stream's median inter-token time, for scale.

    python benchmarks/failover_pause.py [--rounds 6] [--kill-after 32] [--tiny]

Writes benchmarks/results/failover_pause.json and .png.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # see benchmarks/__init__.py

import argparse
import signal
import tempfile
import time
from typing import Any

from benchmarks.http_client import RequestInput, RequestOutput, run
from benchmarks.report import write_json, write_plot
from benchmarks.stats import median, spread_text
from testbed.cluster import Cluster
from zmqllm.config.paths import default_model_dir
from zmqllm.models.model_args import ModelArgs
from zmqllm.models.prepare import prepare_default_model, prepare_tiny_model

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def stream(c: Cluster, prompt: str, tokens: int, kill_after: int, kill: Any) -> dict[str, Any]:
    """One streamed completion, and when the kill was (after ``kill_after`` tokens)."""
    inp = RequestInput(
        f"http://127.0.0.1:{c.http_port}/v1/completions",
        prompt=prompt,
        max_tokens=tokens,
        ignore_eos=True,
        timeout=300,
    )
    killed_at: list[float] = []

    def on_token(out: RequestOutput) -> None:
        if out.generated_tokens == kill_after and kill is not None:
            kill()
            killed_at.append(time.perf_counter())

    return {"out": run(inp, on_token), "killed_at": killed_at[0] if killed_at else None}


def kill_serving(c: Cluster, layers: tuple[int, int]) -> None:
    def serving() -> dict[str, Any] | None:
        for w in c.status()["workers"]:
            if tuple(w["layers"]) == layers and w["sessions"] > 0:
                return w
        return None

    victim = c.wait_for(serving, timeout=60, what=f"a worker of {layers} with a session")
    (proc,) = [p for p in c.procs if p.alive() and p.popen.pid == victim["info"]["pid"]]
    c.kill(proc, signal.SIGKILL)


def run_round(c: Cluster, stage: tuple[int, int], args: argparse.Namespace) -> dict[str, Any]:
    disturbed = stream(c, PROMPT, args.new_tokens, args.kill_after, lambda: kill_serving(c, stage))
    out, killed_at = disturbed["out"], disturbed["killed_at"]
    stamps = out.stamps
    after = [t for t in stamps if t > killed_at]
    if not after:
        raise RuntimeError("the stream ended before the kill took effect; raise --new-tokens")
    # The replay prefills the prompt plus what was streamed up to the failure.
    done = len(stamps) - len(after)
    history = PROMPT + "".join(out.pieces[:done])
    cold = stream(c, history, 1, 0, None)["out"]
    return {
        "stage": f"{stage[0]}:{stage[1]}",
        "replayed_tokens": done,
        "kill_to_next_s": after[0] - killed_at,
        "gap_s": after[0] - stamps[done - 1],
        "replay_prefill_s": cold.latency,  # its one token may have no text of its own
        "itl_median_s": median(out.itl),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--kill-after", type=int, default=32, help="tokens streamed before the kill")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--tiny", action="store_true", help="the tiny random model (quick check)")
    ap.add_argument("--out", default="benchmarks/results/failover_pause.json")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="zmqllm-failover-") as tmp:
        if args.tiny:
            model = prepare_tiny_model(Path(tmp) / "tiny")
        else:
            model = prepare_default_model(default_model_dir())
        layers = ModelArgs.from_dir(model).num_layers
        half = layers // 2
        stages = [(0, half), (half, layers)]
        c = Cluster(Path(tmp) / "cluster", model)
        rounds = []
        try:
            c.start_broker()
            for start, end in stages * 2:
                c.start_worker(f"{start}:{end}")
            c.start_gateway()
            c.wait_ready(300)
            c.wait_for(lambda: len(c.status()["workers"]) == 4, timeout=300, what="4 workers")
            stream(c, PROMPT, 8, 0, None)  # warm-up
            for r in range(args.rounds):
                stage = stages[r % 2]
                row = run_round(c, stage, args)
                rounds.append(row)
                print(
                    f"round {r + 1}: stage {row['stage']}  kill->next {row['kill_to_next_s']:.3f} s"
                    f"  replay prefill {row['replay_prefill_s']:.3f} s"
                    f"  ITL {row['itl_median_s'] * 1e3:.1f} ms"
                )
                c.start_worker(f"{stage[0]}:{stage[1]}")
                c.wait_for(lambda: len(c.status()["workers"]) == 4, timeout=300, what="4 again")
        finally:
            c.stop()

    kill = [r["kill_to_next_s"] for r in rounds]
    prefill = [r["replay_prefill_s"] for r in rounds]
    net = [k - p for k, p in zip(kill, prefill, strict=True)]
    itl = [r["itl_median_s"] for r in rounds]
    print(f"\nmodel {'tiny' if args.tiny else 'default'}, {len(rounds)} rounds: median (range)")
    print(f"  kill -> next token        {spread_text(kill)} s")
    print(f"  replay prefill            {spread_text(prefill)} s")
    print(f"  pause less the prefill    {spread_text(net)} s")
    print(f"  inter-token (undisturbed) {spread_text([x * 1e3 for x in itl])} ms")
    out = Path(args.out)
    write_json(out, {"model": "tiny" if args.tiny else "default", "rounds": rounds})

    def draw(plt: Any) -> Any:
        fig, ax = plt.subplots(figsize=(7, 4))
        xs = range(1, len(rounds) + 1)
        ax.bar(xs, prefill, label="replay prefill")
        ax.bar(xs, net, bottom=prefill, label="detection + reopen")
        ax.set_xlabel("round (stage killed alternates)")
        ax.set_ylabel("kill to next token (s)")
        ax.legend()
        return fig

    write_plot(out, draw)


if __name__ == "__main__":
    main()
