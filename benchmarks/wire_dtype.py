"""Activations as bfloat16 or float16 on the wire (`--wire-dtype`): what they cost in
greedy agreement, and what they save on a slow link.

1. Agreement. A 2-stage cluster on 127.0.0.1 per wire dtype, the tiny test model and the
   default model: each test prompt (tests/e2e/test_cluster.py PROMPTS, chat template)
   generated greedily, token ids compared with the float32 cluster's (which equals HF's).
2. Prefill across a slow link (root): the default model's 2-stage cluster across three
   network namespaces, links rate limited and the workers' delayed; time to first token
   of a long prompt (its prefill activations cross two links) with stage 0 sending
   float32 and bfloat16, in alternating rounds (stage 0 restarted with the other flag).

    python benchmarks/wire_dtype.py [--tokens 64] [--link-rate 100mbit] [--link-delay-ms 5]
        [--rounds 4] [--skip-agreement] [--skip-link]

Writes benchmarks/results/wire_dtype.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # see benchmarks/__init__.py

import argparse
import asyncio
import statistics
import tempfile
from typing import Any

import torch

from benchmarks.http_client import RequestInput, netns_socket, run
from benchmarks.links import across_hosts
from benchmarks.paired import alternate, compare, describe
from benchmarks.report import write_json
from benchmarks.stats import median, ms
from testbed.cluster import Cluster
from tests.e2e.test_cluster import PROMPTS
from zmqllm.bus.sampling_params import SamplingParams
from zmqllm.client.broker_client import BrokerClient
from zmqllm.client.request import GenerateRequest
from zmqllm.config.paths import default_model_dir
from zmqllm.launch.child_process import ChildProcess
from zmqllm.models.model_args import ModelArgs
from zmqllm.models.prepare import prepare_default_model, prepare_tiny_model
from zmqllm.models.tokenizer import Tokenizer

WIRES = ("float32", "bfloat16", "float16")
LONG_PROMPT = " ".join(
    ["The keeper climbed the stairs of the lighthouse, counted the steps, and wrote"] * 80
)


class WireCluster(Cluster):
    """A loopback Cluster whose workers send activations in ``wire``."""

    wire = "float32"

    def _start(self, name: str, args: list[str]) -> ChildProcess:
        if args[0] == "worker":
            args = [*args, "--wire-dtype", self.wire]
        return super()._start(name, args)


def stages(model_dir: Path) -> tuple[str, str]:
    (a0, b0), (a1, b1) = ModelArgs.from_dir(model_dir).stage_ranges(2)
    return f"{a0}:{b0}", f"{a1}:{b1}"


async def greedy_ids(frontend: str, prompts: list[list[int]], n: int, eos: list[int]) -> list:
    client = BrokerClient(frontend)
    await client.start()
    out = []
    try:
        for i, ids in enumerate(prompts):
            request = GenerateRequest(
                request_id=f"wire-{i}",
                prompt=tuple(ids),
                max_tokens=n,
                sampling=SamplingParams(temperature=0.0),
                stop_ids=tuple(eos),
            )
            stream = client.generate(request)
            async with stream as s:
                out.append([event.token async for event in s])
    finally:
        await client.close()
    return out


def agreement(model_dir: Path, n: int, threads: int) -> dict[str, Any]:
    """Per wire dtype: prompts whose whole answer equals float32's, and the share of
    float32's tokens each answer repeats before its first difference."""
    tok = Tokenizer.from_dir(model_dir)
    prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    answers: dict[str, list[list[int]]] = {}
    for wire in WIRES:
        with tempfile.TemporaryDirectory() as tmp:
            c = WireCluster(Path(tmp), model_dir, threads=threads)
            c.wire = wire
            try:
                c.start_all(stages(model_dir))
                eos = sorted(tok.eos_token_ids)
                answers[wire] = asyncio.run(greedy_ids(c.frontend, prompts, n, eos))
            finally:
                c.stop()
    result: dict[str, Any] = {}
    for wire in WIRES[1:]:
        same, shares = 0, []
        for ref, got in zip(answers["float32"], answers[wire], strict=True):
            same += ref == got
            prefix = next(
                (i for i, (a, b) in enumerate(zip(ref, got, strict=False)) if a != b), None
            )
            prefix = min(len(ref), len(got)) if prefix is None else prefix
            shares.append(prefix / max(len(ref), len(got), 1))
        result[wire] = {
            "identical": same,
            "prompts": len(PROMPTS),
            "tokens_before_first_difference": statistics.fmean(shares),
        }
        print(
            f"  {model_dir.name} {wire}: {same}/{len(PROMPTS)} answers identical to float32's; "
            f"{100 * statistics.fmean(shares):.1f}% of tokens before the first difference",
            flush=True,
        )
    return result


def prefill_on_link(model_dir: Path, a: argparse.Namespace) -> dict[str, Any]:
    """TTFT of LONG_PROMPT (and ITL) with stage 0 sending float32 or bfloat16."""
    first, _ = stages(model_dir)
    n_prompt = len(Tokenizer.from_dir(model_dir).encode(LONG_PROMPT))
    out: dict[str, Any] = {"prompt_tokens": n_prompt}
    with across_hosts(
        model_dir,
        stages(model_dir),
        delay_ms=a.link_delay_ms,
        rate=a.link_rate,
        threads=a.threads,
        worker_flags=("--wire-dtype", "float32"),
    ) as c:
        itls: dict[str, list[float]] = {"float32": [], "bfloat16": []}
        body = RequestInput(
            "http://127.0.0.1/v1/completions",
            prompt=LONG_PROMPT,
            max_tokens=16,
            ignore_eos=True,
            temperature=0,
            timeout=300,
            connect=lambda: netns_socket(c.http(300)),
        )

        def ttft_ms(wire: str) -> float:
            c.restart_worker(first, ("--wire-dtype", wire))
            run(body)  # warm-up
            ttfts = []
            for _ in range(a.requests):
                out = run(body)
                ttfts.append(ms(out.ttft))
                itls[wire].append(ms(median(out.itl)))
            return median(ttfts)

        values = alternate(
            a.rounds,
            ("float32", lambda: ttft_ms("float32")),
            ("bfloat16", lambda: ttft_ms("bfloat16")),
        )
    out["ttft_ms"] = compare(values, "float32", "bfloat16")
    out["itl_ms_p50"] = {w: median(v) for w, v in itls.items() if v}
    print(
        f"prefill of {n_prompt} tokens across links of {a.link_rate}, "
        f"{a.link_delay_ms:g} ms each way:"
    )
    print(describe(out["ttft_ms"], "float32", "bfloat16", "ms"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--link-rate", default="100mbit")
    ap.add_argument("--link-delay-ms", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--requests", type=int, default=2, help="timed prefills per round")
    ap.add_argument("--skip-agreement", action="store_true")
    ap.add_argument("--skip-link", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/wire_dtype.json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    default = prepare_default_model(default_model_dir())
    results: dict[str, Any] = {}
    if not a.skip_agreement:
        with tempfile.TemporaryDirectory() as tmp:
            tiny = prepare_tiny_model(Path(tmp) / "tiny")
            print(f"greedy agreement with float32, {len(PROMPTS)} prompts x {a.tokens} tokens:")
            results["agreement"] = {
                "tiny": agreement(tiny, a.tokens, a.threads),
                default.name: agreement(default, a.tokens, a.threads),
            }
    if not a.skip_link:
        results["prefill_on_link"] = prefill_on_link(default, a)
    meta = {
        k: getattr(a, k)
        for k in ("tokens", "threads", "link_rate", "link_delay_ms", "rounds", "requests")
    }
    write_json(Path(a.out), {"meta": meta, "results": results})


if __name__ == "__main__":
    main()
