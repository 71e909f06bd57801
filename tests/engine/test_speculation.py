"""Speculative decoding through Stage objects, driven by hand without sockets: the last
stage proposes by prompt lookup, stage 0 runs the proposals as more rows of a step, and
the tokens must be exactly those of the in-process Generator (no speculation), greedy or
sampled, one stage or two, beside sessions that do not speculate, whatever ends them."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from zmqllm.bus.sampling_params import SamplingParams  # noqa: E402
from zmqllm.engine import runner  # noqa: E402
from zmqllm.engine.batching import draft_room  # noqa: E402
from zmqllm.engine.generator import Generator, load_shard  # noqa: E402
from zmqllm.engine.model import MistralShard  # noqa: E402
from zmqllm.engine.stage import BadWork, Stage  # noqa: E402

pytestmark = pytest.mark.torch

GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, seed=7)


@pytest.fixture(scope="module")
def shards(tiny_model_dir: Path) -> dict[tuple[int, int], MistralShard]:
    return {r: load_shard(tiny_model_dir, *r) for r in [(0, 2), (2, 4), (0, 4)]}


@pytest.fixture(scope="module")
def generator(tiny_model_dir: Path) -> Generator:
    return Generator(tiny_model_dir)


def echo(gen: Generator, seed: int, n: int = 32, m: int = 24) -> list[int]:
    """A prompt whose answer repeats what it holds, the text prompt lookup is for: ``x``,
    the model's greedy answer to ``x``, then ``x`` again. A random model's answers do not
    repeat their prompts, but this one's window (8 tokens, 4 layers: each position sees
    at most 28 back) and rotary positions make its answer to the second ``x`` the first's."""
    x = np.random.default_rng(seed).integers(3, 200, n).tolist()
    return x + list(gen.generate(x, m)) + x


def plain(seed: int, n: int = 9) -> list[int]:
    return np.random.default_rng(100 + seed).integers(3, 200, n).tolist()


@dataclass
class Req:
    session: str
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams = GREEDY
    stop_ids: frozenset[int] = frozenset()
    speculative: bool = True


@dataclass
class SpecPipeline:
    """Plays the broker: activations on, a pass's tokens back to the test, its last
    token (with the proposals) to stage 0 as the next step."""

    stages: list[Stage]
    tokens: dict[str, list[int]] = field(default_factory=dict)
    finishes: dict[str, str | None] = field(default_factory=dict)
    passes: dict[str, int] = field(default_factory=dict)
    # Sessions that ended on a later token of a pass (after accepted proposals).
    ended_inside: set[str] = field(default_factory=set)
    _inside: dict[str, int] = field(default_factory=dict)

    def watch_stage_0(self) -> list[tuple[int, int]]:
        """From now on, for each forward of stage 0: (its decode steps, its proposed
        rows), appended to the list returned."""
        forwards: list[tuple[int, int]] = []
        runner = self.stages[0].runner
        run = runner.run

        def counting(batch, refused):  # type: ignore[no-untyped-def]
            steps = sum(1 for w in batch if w.final and w.step)
            forwards.append((steps, sum(w.draft for w in batch)))
            return run(batch, refused)

        runner.run = counting  # type: ignore[method-assign]
        return forwards

    def open(self, req: Req) -> None:
        n = len(self.stages)
        ids = np.asarray(req.prompt, np.int32)
        for i in reversed(range(n)):
            self.stages[i].open(
                req.session,
                f"req-{req.session}",
                len(req.prompt) + req.max_tokens,
                req.max_tokens,
                req.sampling,
                req.stop_ids,
                ids if i == 0 else None,
                stages=n,
                prompt_len=len(req.prompt),
                history=ids if i == n - 1 and i > 0 else None,
                speculative=req.speculative,
            )
        self.tokens[req.session] = []
        self.passes[req.session] = 0

    def turn(self) -> None:
        last = len(self.stages) - 1
        for i, st in enumerate(self.stages):
            for out in st.run():
                if i < last:
                    assert out.hidden is not None
                    self.stages[i + 1].activation(
                        out.session, out.step, out.hidden, out.final, out.prefix
                    )
                    continue
                got = self.tokens[out.session]
                assert out.token is not None and out.step == len(got)
                got.append(out.token)
                if out.more:
                    assert out.finish is None and not out.draft
                    self._inside[out.session] = self._inside.get(out.session, 0) + 1
                    continue
                self.passes[out.session] += 1
                if out.finish is not None and self._inside.get(out.session):
                    self.ended_inside.add(out.session)
                self._inside[out.session] = 0
                if out.finish is None:
                    self.stages[0].step(out.session, out.step + 1, out.token, out.draft)
                else:
                    self.finishes[out.session] = out.finish.value
                    for s in self.stages:
                        s.close(out.session)

    def run_staggered(self, reqs: list[Req]) -> None:
        """Five sessions joining over three turns, so speculating and plain rows share
        forwards at different steps; then everything to the end."""
        self.open(reqs[0])
        self.open(reqs[1])
        self.turn()
        self.open(reqs[2])
        self.turn()
        self.open(reqs[3])
        self.open(reqs[4])
        self.run_until_idle()

    def run_until_idle(self, max_turns: int = 2000) -> None:
        for _ in range(max_turns):
            if not any(st.has_work() for st in self.stages):
                return
            self.turn()
        raise AssertionError("pipeline still busy")


def pipeline(
    shards: dict[tuple[int, int], MistralShard], stages: int, **kw: object
) -> SpecPipeline:
    ranges = [(0, 4)] if stages == 1 else [(0, 2), (2, 4)]
    return SpecPipeline([Stage(shards[r], speculative="lookup", **kw) for r in ranges])


def expected(gen: Generator, req: Req) -> list[int]:
    return list(gen.generate(req.prompt, req.max_tokens, req.sampling, sorted(req.stop_ids)))


@pytest.mark.parametrize("stages", [1, 2])
def test_greedy_tokens_are_the_same_with_fewer_passes(
    shards: dict[tuple[int, int], MistralShard], generator: Generator, stages: int
) -> None:
    reqs = [Req(f"r{i}", echo(generator, i), 40) for i in range(3)]
    reqs += [Req(f"p{i}", plain(i), 24) for i in range(2)]
    p = pipeline(shards, stages)
    for r in reqs:
        p.open(r)
    p.run_until_idle()
    for r in reqs:
        assert p.tokens[r.session] == expected(generator, r), r.session
    spec = p.stages[-1].runner.spec
    assert spec.accepted > 0, "no proposal was ever accepted"
    total = sum(len(p.tokens[r.session]) for r in reqs)
    assert sum(p.passes.values()) < total  # some passes gave several tokens
    figures = p.stages[-1].heartbeat_figures()
    assert figures["spec_proposed"] >= figures["spec_accepted"] > 0
    assert figures["spec_tokens_per_pass"] > 1.0
    assert all(not st.sessions and len(st.pool) == 0 for st in p.stages)


@pytest.mark.parametrize("stages", [1, 2])
def test_sampled_tokens_are_the_same_as_without(
    shards: dict[tuple[int, int], MistralShard], generator: Generator, stages: int
) -> None:
    reqs = [
        Req(f"s{i}", echo(generator, 10 + i), 32, SamplingParams(temperature=0.7, seed=i))
        for i in range(3)
    ]
    p = pipeline(shards, stages)
    for r in reqs:
        p.open(r)
    p.run_until_idle()
    for r in reqs:
        assert p.tokens[r.session] == expected(generator, r), r.session


def test_batched_beside_sessions_that_do_not_speculate(
    shards: dict[tuple[int, int], MistralShard], generator: Generator
) -> None:
    reqs = [
        Req("on-0", echo(generator, 20), 36),
        Req("off-0", echo(generator, 20), 36, speculative=False),
        Req("on-1", plain(3), 20),
        Req("off-1", echo(generator, 21), 30, speculative=False),
        Req("on-2", echo(generator, 22), 30, SAMPLED),
    ]
    p = pipeline(shards, 2)
    p.run_staggered(reqs)
    for r in reqs:
        assert p.tokens[r.session] == expected(generator, r), r.session
    # The sessions that do not speculate took a pass per token.
    assert p.passes["off-0"] == len(p.tokens["off-0"])
    assert p.passes["off-1"] == len(p.tokens["off-1"])
    assert p.passes["on-0"] < len(p.tokens["on-0"])
    assert all(st.stats.max_batch > 1 for st in p.stages)


@pytest.mark.parametrize("stages", [1, 2])
def test_stop_ids_and_max_tokens_inside_a_window(
    shards: dict[tuple[int, int], MistralShard],
    generator: Generator,
    stages: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Thirty sessions in one forward: busy (runner.BUSY_SESSIONS), where proposals need
    # longer matches, and past the shard's row steps, where stage 0 cuts them
    # (batching.draft_room); this test is about windows, not what they cost.
    monkeypatch.setattr(runner, "BUSY_SESSIONS", 100)
    base = Req("x", echo(generator, 30), 30)
    full = expected(generator, base)
    # Every token of the answer as a stop id, and every budget: most end inside a pass
    # that proposed past them.
    reqs = [Req(f"stop{t}", base.prompt, 30, stop_ids=frozenset({t})) for t in sorted(set(full))]
    reqs += [Req(f"len{m}", base.prompt, m) for m in range(1, 16)]
    p = pipeline(shards, stages)
    # Nor does stage 0 cut their proposals for what rows cost (batching.draft_room).
    p.stages[0].scheduler.row_steps = tuple
    p.stages[0].scheduler.draft_rows = 16 * len(reqs)
    for r in reqs:
        p.open(r)
    p.run_until_idle()
    for r in reqs:
        want = expected(generator, r)
        assert p.tokens[r.session] == want, r.session
        if r.session.startswith("len"):
            assert p.finishes[r.session] == ("stop" if want[-1] in r.stop_ids else "length")
        else:
            assert p.finishes[r.session] in ("stop", "length")
    stops = {r.session for r in reqs if r.session.startswith("stop")}
    assert p.ended_inside & stops and p.ended_inside - stops  # both kinds, inside a pass


def test_a_cap_on_proposed_rows_per_forward_keeps_the_tokens(
    shards: dict[tuple[int, int], MistralShard], generator: Generator
) -> None:
    reqs = [Req(f"c{i}", echo(generator, 40 + i), 30) for i in range(4)]
    p = pipeline(shards, 2, max_draft_tokens=8)
    p.stages[0].scheduler.draft_rows = 3  # fewer than one session would propose
    forwards = p.watch_stage_0()
    for r in reqs:
        p.open(r)
    p.run_until_idle()
    for r in reqs:
        assert p.tokens[r.session] == expected(generator, r), r.session
    assert max(d for _, d in forwards) <= 3


@pytest.mark.parametrize(
    ("rows", "steps", "room"),
    [
        (1, (8, 32), 7),  # one stream: its proposals stay in the few-row path
        (4, (8, 32), 4),
        (8, (8, 32), 0),  # a ninth row would leave it: none
        (9, (8, 32), 16),  # already past it: up to the next step, at most 16
        (20, (8, 32), 12),
        (32, (8, 32), 0),
        (40, (8, 32), 0),  # past the last step rows cost what they add
        (40, (), 16),  # a shard that names no steps (a GPU's)
    ],
)
def test_proposed_rows_never_cross_a_step_of_the_forward_s_cost(
    rows: int, steps: tuple[int, ...], room: int
) -> None:
    assert draft_room(rows, steps, 16) == room


def test_stage_0_cuts_proposals_that_would_cross_a_row_step(
    shards: dict[tuple[int, int], MistralShard], generator: Generator
) -> None:
    """Stage 0 gives a forward's proposals only the rows left before the shard's next
    row step: with 3 sessions decoding and a step at 4 rows, one proposed row a forward;
    the tokens are the same."""
    reqs = [Req(f"c{i}", echo(generator, 50 + i), 24) for i in range(3)]
    p = pipeline(shards, 1, max_draft_tokens=6)  # one stage: one forward of all three
    p.stages[0].scheduler.row_steps = lambda: (4, 32)
    drafts = p.watch_stage_0()
    for r in reqs:
        p.open(r)
    p.run_until_idle()
    for r in reqs:
        assert p.tokens[r.session] == expected(generator, r), r.session
    assert all(n + d <= 4 for n, d in drafts if n == 3)
    assert any(d == 1 for n, d in drafts if n == 3)  # proposals did run, one a forward
    assert any(d > 1 for n, d in drafts if n == 1)  # alone, a session proposes more
    assert p.stages[-1].runner.spec.accepted > 0


def test_steps_outside_the_window_and_foreign_proposals_are_refused(
    shards: dict[tuple[int, int], MistralShard], generator: Generator
) -> None:
    p = pipeline(shards, 1)
    r = Req("w", echo(generator, 50), 20)
    p.open(r)
    st = p.stages[0]
    outs = st.run()
    (out,) = outs
    assert out.draft  # the prompt's end occurred before in it
    with pytest.raises(BadWork, match="did not make"):
        st.step("w", 1, out.token, [(out.draft[0] + 1) % 200])
    with pytest.raises(BadWork, match="expected 1"):
        st.step("w", 2, out.token, out.draft)
    st.step("w", 1, out.token, out.draft)
    st.run()
    s = st.sessions["w"]
    assert s.window == len(out.draft)
    with pytest.raises(BadWork, match="expected 2 to"):
        st.step("w", 3 + s.window, 5)


def test_a_later_stage_refuses_proposals_its_last_stage_did_not_make(
    shards: dict[tuple[int, int], MistralShard],
) -> None:
    last = Stage(shards[(2, 4)], speculative="off")
    last.open("q", "", 16, 8, GREEDY, frozenset(), stages=2, prompt_len=4)
    hidden = torch.zeros(4, shards[(2, 4)].args.hidden_size)
    last.activation("q", 0, hidden, True)
    last.run()
    with pytest.raises(BadWork, match="proposed nothing"):
        last.activation("q", 1, hidden[:3], True)


def test_draft_mode_needs_its_model_and_the_draft_length_a_bound(
    shards: dict[tuple[int, int], MistralShard],
) -> None:
    # The draft model's own tests: tests/engine/test_draft.py.
    with pytest.raises(ValueError, match="needs a draft model"):
        Stage(shards[(0, 4)], speculative="draft")
    with pytest.raises(ValueError, match="max_draft_tokens"):
        Stage(shards[(0, 4)], speculative="lookup", max_draft_tokens=0)
