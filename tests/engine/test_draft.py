"""Speculative decoding with a draft model, through Stage objects driven by hand without
sockets (tests/engine/test_speculation.py's pipeline): the last stage's draft model
proposes, stage 0 runs the proposals as more rows of a step, and the tokens must be
exactly those of the in-process Generator (no speculation), greedy or sampled, whichever
model drafts. A model drafting for itself has every proposal accepted; another one (the
tiny model of another seed) few. The draft's caches follow its sessions, and a draft of
another vocabulary, or on a stage that does not sample, is refused."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from tests.engine.test_speculation import Req, SpecPipeline, echo, expected, plain  # noqa: E402
from zmqllm.bus.sampling_params import SamplingParams  # noqa: E402
from zmqllm.config.settings import Config  # noqa: E402
from zmqllm.engine import runner  # noqa: E402
from zmqllm.engine.draft import DraftModel, DraftModelError, DraftProposer, load_draft  # noqa: E402
from zmqllm.engine.generator import Generator, load_shard  # noqa: E402
from zmqllm.engine.model import MistralShard  # noqa: E402
from zmqllm.engine.stage import Stage  # noqa: E402
from zmqllm.models.model_args import ModelArgs  # noqa: E402
from zmqllm.models.prepare import prepare_tiny_model  # noqa: E402
from zmqllm.worker.shard_loader import load_stage  # noqa: E402

pytestmark = pytest.mark.torch

SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, seed=7)


@pytest.fixture(scope="module")
def shards(tiny_model_dir: Path) -> dict[tuple[int, int], MistralShard]:
    return {r: load_shard(tiny_model_dir, *r) for r in [(0, 2), (2, 4), (0, 4)]}


@pytest.fixture(scope="module")
def generator(tiny_model_dir: Path) -> Generator:
    return Generator(tiny_model_dir)


@pytest.fixture(scope="module")
def other_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """The tiny model of another seed: the same tokenizer, other weights."""
    return prepare_tiny_model(tmp_path_factory.mktemp("models") / "tiny-s1", seed=1)


@pytest.fixture(scope="module")
def itself(tiny_model_dir: Path) -> MistralShard:
    return load_draft(tiny_model_dir, tiny_model_dir, ModelArgs.from_dir(tiny_model_dir), True)


@pytest.fixture(scope="module")
def other(other_dir: Path, tiny_model_dir: Path) -> MistralShard:
    return load_draft(other_dir, tiny_model_dir, ModelArgs.from_dir(tiny_model_dir), True)


def pipeline(
    shards: dict[tuple[int, int], MistralShard], stages: int, draft: MistralShard, **kw: object
) -> SpecPipeline:
    """Stage 0 of two does not draft: a draft model is for the last stage only."""
    ranges = [(0, 4)] if stages == 1 else [(0, 2), (2, 4)]
    last = len(ranges) - 1
    return SpecPipeline(
        [
            Stage(shards[r], speculative="draft", draft=draft, **kw)
            if i == last
            else Stage(shards[r], **kw)
            for i, r in enumerate(ranges)
        ]
    )


def draft_of(p: SpecPipeline) -> DraftModel:
    model = p.stages[-1].speculation.draft
    assert model is not None
    return model


def prompts(generator: Generator) -> list[Req]:
    """Ordinary prompts of a few lengths, and one that repeats itself."""
    reqs = [Req(f"p{i}", plain(i, 5 + 7 * i), 24) for i in range(3)]
    return [*reqs, Req("echo", echo(generator, 1), 30)]


@pytest.mark.parametrize("stages", [1, 2])
def test_a_model_drafting_for_itself_has_every_proposal_accepted(
    shards: dict[tuple[int, int], MistralShard],
    generator: Generator,
    itself: MistralShard,
    stages: int,
) -> None:
    reqs = prompts(generator)
    p = pipeline(shards, stages, itself, max_draft_tokens=6)
    for r in reqs:
        p.open(r)
    p.run_until_idle()
    for r in reqs:
        assert p.tokens[r.session] == expected(generator, r), r.session
    spec = p.stages[-1].runner.spec
    assert spec.proposed > 0 and spec.accepted == spec.proposed
    total = sum(len(p.tokens[r.session]) for r in reqs)
    assert sum(p.passes.values()) * 3 < total  # up to 7 tokens a pass
    figures = p.stages[-1].heartbeat_figures()
    assert figures["spec_tokens_per_pass"] > 3.0
    assert all(not st.sessions and len(st.pool) == 0 for st in p.stages)
    assert len(draft_of(p).pool) == 0 and draft_of(p).pool.reserved == 0


@pytest.mark.parametrize("stages", [1, 2])
@pytest.mark.parametrize("sampling", [SamplingParams(), SAMPLED], ids=["greedy", "sampled"])
def test_another_model_drafting_proposes_its_own_greedy_tokens_and_changes_none(
    shards: dict[tuple[int, int], MistralShard],
    generator: Generator,
    other: MistralShard,
    other_dir: Path,
    stages: int,
    sampling: SamplingParams,
) -> None:
    """Few proposals of the other model are accepted; each is the draft's own greedy
    continuation of the text so far (its cache cut back right after each rejection)."""
    reqs = [Req(r.session, r.prompt, r.max_tokens, sampling) for r in prompts(generator)]
    p = pipeline(shards, stages, other, max_draft_tokens=4)
    made: list[tuple[list[int], list[int]]] = []
    model = draft_of(p)
    run = model.draft

    def recording(asks: list[tuple[DraftProposer, int]]) -> None:
        before = [list(d.tokens) for d, _ in asks]
        run(asks)
        made.extend((t, list(d.pending)) for t, (d, k) in zip(before, asks, strict=True) if k)

    model.draft = recording  # type: ignore[method-assign]
    for r in reqs:
        p.open(r)
    p.run_until_idle()
    for r in reqs:
        assert p.tokens[r.session] == expected(generator, r), r.session
    spec = p.stages[-1].runner.spec
    assert spec.proposed > 0 and spec.accepted < spec.proposed / 2  # random weights
    assert len(made) > 4
    plain_draft = Generator(other_dir, compiled=False)
    for tokens, pending in made:
        assert list(plain_draft.generate(tokens, len(pending))) == pending


def test_batched_beside_sessions_that_do_not_speculate(
    shards: dict[tuple[int, int], MistralShard], generator: Generator, itself: MistralShard
) -> None:
    reqs = [
        Req("on-0", plain(20, 12), 30),
        Req("off-0", plain(20, 12), 30, speculative=False),
        Req("on-1", echo(generator, 3), 20, SAMPLED),
        Req("off-1", plain(21, 30), 26, SAMPLED, speculative=False),
        Req("on-2", plain(22, 7), 28),
    ]
    p = pipeline(shards, 2, itself)
    p.run_staggered(reqs)
    for r in reqs:
        assert p.tokens[r.session] == expected(generator, r), r.session
    assert p.passes["off-0"] == len(p.tokens["off-0"])
    assert p.passes["off-1"] == len(p.tokens["off-1"])
    assert p.passes["on-0"] < len(p.tokens["on-0"])
    assert all(st.stats.max_batch > 1 for st in p.stages)


def test_a_busy_forward_drafts_nothing(
    shards: dict[tuple[int, int], MistralShard], generator: Generator, itself: MistralShard
) -> None:
    """More than BUSY_SESSIONS sessions decoding in one forward: no draft forwards and no
    proposed rows while they do (each would cost every session's step), the same tokens;
    once few are left, those draft again."""
    reqs = [Req(f"s{i}", plain(40 + i, 6), 8 if i else 30) for i in range(runner.BUSY_SESSIONS + 2)]
    p = pipeline(shards, 1, itself, max_draft_tokens=6)
    for r in reqs:
        p.open(r)
    p.turn()  # the prompts: one forward of them all
    p.turn()  # their first decode pass, still all together: busy
    spec = p.stages[-1].runner.spec
    assert spec.proposed == 0
    p.run_until_idle()
    for r in reqs:
        assert p.tokens[r.session] == expected(generator, r), r.session
    assert spec.proposed > 0 and p.passes["s0"] < len(p.tokens["s0"])  # alone, it drafted


@pytest.mark.parametrize("stages", [1, 2])
def test_stop_ids_and_max_tokens_inside_a_window(
    shards: dict[tuple[int, int], MistralShard],
    generator: Generator,
    itself: MistralShard,
    stages: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Forty sessions at once would be a busy forward, where the draft proposes nothing
    # (test_a_busy_forward_drafts_nothing): here every forward drafts.
    monkeypatch.setattr(runner, "BUSY_SESSIONS", 100)
    base = Req("x", plain(30, 11), 24)
    full = expected(generator, base)
    reqs = [Req(f"stop{t}", base.prompt, 24, stop_ids=frozenset({t})) for t in sorted(set(full))]
    reqs += [Req(f"len{m}", base.prompt, m) for m in range(1, 14)]
    p = pipeline(shards, stages, itself, max_draft_tokens=6)
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
    stops = {r.session for r in reqs if r.session.startswith("stop")}
    assert p.ended_inside & stops and p.ended_inside - stops
    assert len(draft_of(p).pool) == 0


def test_proposals_cut_by_stage_0_keep_the_tokens_and_the_draft_in_step(
    shards: dict[tuple[int, int], MistralShard], generator: Generator, itself: MistralShard
) -> None:
    """Stage 0 runs fewer proposals than were made: the draft is cut back to those."""
    reqs = [Req(f"c{i}", plain(40 + i, 9), 30) for i in range(4)]
    p = pipeline(shards, 2, itself, max_draft_tokens=8)
    p.stages[0].scheduler.draft_rows = 5  # fewer than the sessions propose together
    for r in reqs:
        p.open(r)
    p.run_until_idle()
    for r in reqs:
        assert p.tokens[r.session] == expected(generator, r), r.session
    spec = p.stages[-1].runner.spec
    assert spec.accepted == spec.proposed > 0  # what ran was all the model's own choice


def test_a_failing_draft_forward_proposes_nothing(
    shards: dict[tuple[int, int], MistralShard], generator: Generator, itself: MistralShard
) -> None:
    p = pipeline(shards, 1, itself)
    model = draft_of(p)
    calls = 0
    forward = model._forward

    def failing(caches: list, feed: list[list[int]]) -> list[int]:  # type: ignore[type-arg]
        nonlocal calls
        calls += 1
        if calls % 3 == 0:
            raise RuntimeError("out of memory")
        return forward(caches, feed)

    model._forward = failing  # type: ignore[method-assign]
    r = Req("f", plain(50, 10), 30)
    p.open(r)
    p.run_until_idle()
    assert p.tokens["f"] == expected(generator, r)
    assert p.stages[0].runner.spec.accepted > 0


def test_draft_caches_are_freed_when_sessions_end_or_are_cancelled(
    shards: dict[tuple[int, int], MistralShard], itself: MistralShard
) -> None:
    p = pipeline(shards, 2, itself)
    pool = draft_of(p).pool
    reqs = [Req(f"k{i}", plain(60 + i, 8), 6 + 30 * i) for i in range(4)]
    for r in reqs:
        p.open(r)
    assert len(pool) == 4 and pool.reserved == sum(len(r.prompt) + r.max_tokens for r in reqs)
    for _ in range(3):
        p.turn()
    assert "k0" in p.finishes and len(pool) == 3  # finished: closed by the pipeline
    for st in p.stages:  # cancelled (or failed): the worker closes the session
        st.close("k1")
    assert len(pool) == 2
    p.stages[-1].reset()  # a worker that loses its broker
    assert len(pool) == 0 and pool.reserved == 0
    # A session opened without speculation holds no draft cache.
    p.open(Req("quiet", plain(70), 8, speculative=False))
    assert len(pool) == 0


def test_a_draft_of_another_vocabulary_is_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    served = ModelArgs.from_dir(tiny_model_dir)
    bigger = tmp_path / "bigger"
    shutil.copytree(tiny_model_dir, bigger)
    cfg = json.loads((bigger / "config.json").read_text())
    cfg["vocab_size"] += 8
    (bigger / "config.json").write_text(json.dumps(cfg))
    both = (
        rf"{re.escape(str(bigger))} has a vocabulary of 528 .*{re.escape(str(tiny_model_dir))} 520"
    )
    with pytest.raises(DraftModelError, match=both):
        load_draft(bigger, tiny_model_dir, served, True)
    swapped = tmp_path / "swapped"
    shutil.copytree(tiny_model_dir, swapped)
    tok = json.loads((swapped / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (swapped / "tokenizer.json").write_text(json.dumps(tok))
    served_dir = re.escape(str(tiny_model_dir))
    both = f"{re.escape(str(swapped))}'s tokenizer is not the served model {served_dir}'s"
    with pytest.raises(DraftModelError, match=both):
        load_draft(swapped, tiny_model_dir, served, True)
    # Only the layout of the file differs: the same ids, accepted.
    spaced = tmp_path / "spaced"
    shutil.copytree(tiny_model_dir, spaced)
    tok = json.loads((tiny_model_dir / "tokenizer.json").read_text())
    (spaced / "tokenizer.json").write_text(json.dumps(tok, indent=1))
    assert load_draft(spaced, tiny_model_dir, served, True).is_last


def test_a_draft_is_refused_on_a_stage_that_does_not_sample(
    shards: dict[tuple[int, int], MistralShard], itself: MistralShard, tiny_model_dir: Path
) -> None:
    with pytest.raises(DraftModelError, match="not the last"):
        Stage(shards[(0, 2)], speculative="draft", draft=itself)
    with pytest.raises(ValueError, match="draft_model"):
        Stage(shards[(0, 4)], speculative="draft")
    with pytest.raises(ValueError, match="max_draft_tokens"):
        Stage(shards[(0, 4)], speculative="draft", draft=itself, max_draft_tokens=17)
    cfg = Config()
    cfg.model.path = cfg.worker.draft_model = str(tiny_model_dir)
    cfg.worker.speculative = "draft"
    cfg.worker.max_kv_tokens = 4096
    cfg.worker.layers = "0:2"
    with pytest.raises(
        DraftModelError, match=f"not the last: the draft model {re.escape(str(tiny_model_dir))}"
    ):
        load_stage(cfg)
    cfg.worker.layers = "2:4"
    stage = load_stage(cfg).stage
    assert stage.proposes and stage.speculation.draft is not None


def test_a_session_past_the_drafts_context_stops_proposing(
    shards: dict[tuple[int, int], MistralShard], generator: Generator, itself: MistralShard
) -> None:
    p = pipeline(shards, 1, itself)
    model = draft_of(p)
    model.context = 24  # the draft's cache stops short of the session's
    r = Req("long", plain(80, 12), 40)
    p.open(r)
    assert model.pool.get("long").max_len == 24
    p.run_until_idle()
    assert p.tokens["long"] == expected(generator, r)
    # Proposals while the draft had room (12 + 11 + 1 tokens), one a pass after.
    assert p.passes["long"] > 40 - 24 and p.stages[0].runner.spec.accepted > 0


def test_prompts_longer_than_a_catch_up_are_fed_in_pieces(
    shards: dict[tuple[int, int], MistralShard],
    generator: Generator,
    itself: MistralShard,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from zmqllm.engine import draft

    monkeypatch.setattr(draft, "CATCH_UP", 4)
    monkeypatch.setattr(draft, "FEED_CHUNK", 7)
    reqs = [Req(f"l{i}", plain(90 + i, 30 + 9 * i), 12) for i in range(2)]
    p = pipeline(shards, 2, itself)
    rows: list[int] = []
    model = draft_of(p)
    forward = model._forward

    def counting(caches: list, feed: list[list[int]]) -> list[int]:  # type: ignore[type-arg]
        rows.append(max(len(f) for f in feed))
        return forward(caches, feed)

    model._forward = counting  # type: ignore[method-assign]
    for r in reqs:
        p.open(r)
    p.run_until_idle()
    for r in reqs:
        assert p.tokens[r.session] == expected(generator, r), r.session
    assert max(rows) == 7
    assert p.stages[-1].runner.spec.accepted == p.stages[-1].runner.spec.proposed > 0
