"""Fuzzing the bus at scale: hostile messages on both broker sockets while real streams run.

A local cluster of the tiny test model (real broker, two workers for layers 0:2 and 2:4,
a remote worker serving a second model from a fake upstream in this process, and the
gateway, as processes on 127.0.0.1). While greedy client streams (whose session
ids the fuzzer names: foreign CANCELs, CLOSEs, STEPs, TOKENs) and /chat streams run one
after another, hostile DEALER peers send ``--messages`` messages from ``testbed.fuzz`` to
each broker socket (non-blocking, dropped at the high-water mark). Reports messages/s
per socket, the broker's (and every process's) RSS before and after, whether the same
processes survived, whether every stream equalled HF greedy, and how STATUS answered.

    python benchmarks/fuzz_bus.py [--messages 100000] [--seed 0] [--max-tokens 24]

Writes benchmarks/results/fuzz_bus.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # see benchmarks/__init__.py

import argparse
import tempfile
import time
import urllib.request
from typing import Any

import torch
import zmq
from transformers import MistralForCausalLM

from benchmarks.report import write_json
from testbed.cluster import Cluster
from testbed.fake_upstream import FakeUpstream
from testbed.fuzz_messages import REMOTE_MODEL
from testbed.fuzz_peers import ChatStreams, StatusPoller, VictimStreams, blast
from zmqllm.models.prepare import prepare_tiny_model
from zmqllm.models.tokenizer import Tokenizer

PROMPTS = [
    "Hello there!",
    "What is the capital of France?",
    "Tell me a story about a robot.",
    "List three colours.",
    "Why is the sky blue?",
    "Count to five.",
    # Longer than a few prefix-cache blocks: repeated, it is taken from the stages' caches
    # while the fuzzer runs.
    "Write a story about a lighthouse keeper who finds a message in a bottle on a stormy "
    "night, and tell who wrote it, where it came from and what the keeper did next.",
]
OUT = Path(__file__).parent / "results" / "fuzz_bus.json"


def rss_mib(pid: int) -> float | None:
    """Resident set size from /proc (None once the process is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


class Greedy:
    """HF greedy text on the same weights, stopping at EOS (what the cluster must equal)."""

    def __init__(self, model_dir: Path) -> None:
        self.model = MistralForCausalLM.from_pretrained(model_dir).eval()
        self.tok = Tokenizer.from_dir(model_dir)
        self._texts: dict[tuple[tuple[int, ...], int], str] = {}

    def ids(self, prompt_ids: tuple[int, ...], max_tokens: int) -> str:
        key = (prompt_ids, max_tokens)
        if key not in self._texts:
            self._texts[key] = self._generate(prompt_ids, max_tokens)
        return self._texts[key]

    def _generate(self, prompt_ids: tuple[int, ...], max_tokens: int) -> str:
        x = torch.tensor([prompt_ids])
        with torch.no_grad():
            out = self.model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=max_tokens,
                do_sample=False,
                eos_token_id=sorted(self.tok.eos_token_ids),
                pad_token_id=0,
            )[0, len(prompt_ids) :].tolist()
        return str(self.tok.decode(out))

    def chat(self, prompt: str, max_tokens: int) -> str:
        ids = self.tok.encode_chat([{"role": "user", "content": prompt}])
        return self.ids(tuple(ids), max_tokens)


def run(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    model_dir = prepare_tiny_model(root / "tiny", seed=0)
    greedy = Greedy(model_dir)
    tok = greedy.tok
    c = Cluster(root / "cluster", model_dir)
    upstream = FakeUpstream()
    upstream.start()
    try:
        # A second model, remote: the fuzzer's ASKs name it (fuzz_messages.REMOTE_MODEL).
        c.start_all(("0:2", "2:4"), upstream.url, "--served-name", REMOTE_MODEL)
        procs = {p.name: p.popen.pid for p in c.procs}
        workers_before = sorted(w["id"] for w in c.status()["workers"])
        sessions: list[str] = []
        victims = VictimStreams(
            c.frontend,
            [tok.encode(p) for p in PROMPTS],
            max_tokens=args.max_tokens,
            stop_ids=sorted(tok.eos_token_ids),
            sessions=sessions,
            model=model_dir.name,
        )
        chats = ChatStreams(c.http_port, PROMPTS, max_tokens=args.max_tokens)
        poller = StatusPoller(c.frontend, deadline=args.status_deadline)
        for part in (victims, chats, poller):
            part.start()
        ctx = zmq.Context()
        try:
            victims.wait_for(1, timeout=120)
            chats.wait_for(1, timeout=120)
            rss_before = {name: rss_mib(pid) for name, pid in procs.items()}
            print(f"fuzzing: {args.messages} messages on each broker socket ...", flush=True)
            fuzz_start = time.monotonic()
            stats = blast(
                ctx,
                c.frontend,
                c.backend,
                messages=args.messages,
                sessions=sessions,
                seed=args.seed,
                peers=args.peers,
            )
            fuzz_end = time.monotonic()
            rss_after = {name: rss_mib(pid) for name, pid in procs.items()}
            done = len(victims.results), len(chats.results)
            victims.wait_for(done[0] + 2, timeout=120)
            chats.wait_for(done[1] + 2, timeout=120)
            time.sleep(args.settle)
            rss_settled = {name: rss_mib(pid) for name, pid in procs.items()}
        finally:
            victims.stop(120)
            chats.stop(120)
            poller.stop()
            ctx.term()

        survived = all(p.alive() and p.popen.pid == procs[p.name] for p in c.procs)
        final = c.status() if survived else {}
        remote_ok = remote_answers(c) if survived else False
        victim_ok = [
            r.error is None and tok.decode(r.tokens) == greedy.ids(tuple(r.prompt), args.max_tokens)
            for r in victims.results
        ]
        # /chat leaves out a character cut by max_tokens and ends with a newline.
        chat_ok = [
            r.status == 200
            and r.text == greedy.chat(r.prompt, args.max_tokens).rstrip("\ufffd") + "\n"
            for r in chats.results
        ]
        during = sum(
            1
            for r in [*victims.results, *chats.results]
            if r.started < fuzz_end and r.ended > fuzz_start
        )
        return {
            "messages_per_socket": args.messages,
            "seed": args.seed,
            "peers_per_socket": args.peers,
            "fuzz_seconds": round(fuzz_end - fuzz_start, 2),
            "sockets": {
                side: {
                    **vars(st),
                    "seconds": round(st.seconds, 2),
                    "messages_per_s": round((st.sent + st.dropped) / st.seconds, 1),
                }
                for side, st in stats.items()
            },
            "rss_mib": {"before": rss_before, "after": rss_after, "settled": rss_settled},
            "survived": survived,
            "same_workers": sorted(w["id"] for w in final.get("workers", [])) == workers_before,
            "streams": {
                "client": len(victim_ok),
                "client_exact": sum(victim_ok),
                "chat": len(chat_ok),
                "chat_exact": sum(chat_ok),
                "during_fuzz": during,
                "errors": [r.error for r in victims.results if r.error][:10]
                + [f"{r.status}: {r.text[:200]}" for r in chats.results if r.status != 200][:10],
            },
            "exact": all(victim_ok) and all(chat_ok) and bool(victim_ok) and bool(chat_ok),
            "remote_model_answers_after": remote_ok,
            # ASKs of the fuzzer's that the remote worker found whole and forwarded.
            "upstream_calls": len(upstream.requests),
            "status": {
                "polls": len(poller.latencies),
                "max_s": round(max(poller.latencies, default=0.0), 3),
                "failures": poller.failures[:10],
                "longest_unheard_worker_s": poller.heartbeat_ages,
            },
            "broker_dropped": final.get("dropped", {}),
        }
    finally:
        c.stop()
        upstream.stop()


def remote_answers(c: Cluster) -> bool:
    """The remote model still answers, and right, after the fuzzing."""
    body = b"still there?"
    with urllib.request.urlopen(
        urllib.request.Request(f"{c.url}/chat?model={REMOTE_MODEL}", data=body), timeout=30
    ) as r:
        return r.status == 200 and r.read().decode() == "echo: still there?\n"


def _mib(x: float | None) -> str:
    return "gone" if x is None else f"{x:.1f}"


def print_table(r: dict[str, Any]) -> None:
    print(f"\nfuzz_bus: {r['messages_per_socket']} messages per socket, seed {r['seed']}")
    print(f"{'socket':<10}{'sent':>10}{'dropped':>10}{'replies':>10}{'seconds':>10}{'msgs/s':>10}")
    for side, s in r["sockets"].items():
        print(
            f"{side:<10}{s['sent']:>10}{s['dropped']:>10}{s['replies']:>10}"
            f"{s['seconds']:>10}{s['messages_per_s']:>10}"
        )
    print(f"\n{'process':<14}{'RSS before':>12}{'after':>10}{'settled':>10}  (MiB)")
    rss = r["rss_mib"]
    for name in rss["before"]:
        print(
            f"{name:<14}{_mib(rss['before'][name]):>12}{_mib(rss['after'][name]):>10}"
            f"{_mib(rss['settled'][name]):>10}"
        )
    st, s = r["streams"], r["status"]
    print(f"\nprocesses survived (same pids): {'yes' if r['survived'] else 'NO'}")
    print(f"real workers still registered:  {'yes' if r['same_workers'] else 'NO'}")
    print(
        f"streams exact: {'yes' if r['exact'] else 'NO'}  (client {st['client_exact']}/"
        f"{st['client']}, /chat {st['chat_exact']}/{st['chat']}, "
        f"{st['during_fuzz']} during the fuzz)"
    )
    print(
        f"remote model answers after:     {'yes' if r['remote_model_answers_after'] else 'NO'}"
        f"  ({r['upstream_calls']} fuzzed ASKs forwarded upstream)"
    )
    print(f"status: {s['polls']} polls, slowest {s['max_s']}s, {len(s['failures'])} failed")
    for err in st["errors"] + s["failures"]:
        print("  ", err)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--messages", type=int, default=100_000, help="per broker socket")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--peers", type=int, default=8, help="hostile peers per socket")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--status-deadline", type=float, default=10.0)
    ap.add_argument("--settle", type=float, default=5.0, help="seconds before the last RSS")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="zmqllm-fuzz-bus-") as tmp:
        result = run(args, Path(tmp))
    print_table(result)
    write_json(args.out, result)


if __name__ == "__main__":
    main()
