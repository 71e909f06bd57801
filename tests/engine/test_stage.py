"""Stage: sessions and batching of one pipeline stage, driven by hand without sockets.

The reference is the in-process Generator on the same tiny model: a pipeline of Stage
objects, with the test playing the broker between them, must produce its tokens exactly,
however sessions interleave in the batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from zmqllm.bus.prefix import prefix_chain  # noqa: E402
from zmqllm.bus.sampling_params import SamplingParams  # noqa: E402
from zmqllm.engine.batching import COALESCE_MAX_S  # noqa: E402
from zmqllm.engine.cache import CacheFullError  # noqa: E402
from zmqllm.engine.generator import Generator, load_shard  # noqa: E402
from zmqllm.engine.model import MistralShard  # noqa: E402
from zmqllm.engine.runner import BatchFailed  # noqa: E402
from zmqllm.engine.stage import BadWork, Stage  # noqa: E402

pytestmark = pytest.mark.torch

GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def shards(tiny_model_dir: Path) -> dict[tuple[int, int], MistralShard]:
    # Shards hold only weights (caches live in each Stage's pool): safe to share.
    return {r: load_shard(tiny_model_dir, *r) for r in [(0, 2), (2, 4), (0, 4)]}


@pytest.fixture(scope="module")
def generator(tiny_model_dir: Path) -> Generator:
    return Generator(tiny_model_dir)


def prompt(n: int, seed: int) -> list[int]:
    # Ids >= 3 keep clear of the special tokens; 200 is well inside the tiny vocabulary.
    return np.random.default_rng(seed).integers(3, 200, n).tolist()


def reference(
    gen: Generator,
    tokens: Sequence[int],
    max_tokens: int,
    sampling: SamplingParams = GREEDY,
    stop_ids: Sequence[int] = (),
) -> list[int]:
    return list(gen.generate(list(tokens), max_tokens, sampling, stop_ids))


@dataclass
class Req:
    session: str
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams = GREEDY
    stop_ids: frozenset[int] = frozenset()


@dataclass
class Pipeline:
    """Plays the broker in-process: activations to the next stage, each sampled token
    back to stage 0 as the next step, every stage closed when a session finishes."""

    stages: list[Stage]
    tokens: dict[str, list[int]] = field(default_factory=dict)
    finishes: dict[str, list[str | None]] = field(default_factory=dict)
    finals: dict[str, list[bool]] = field(default_factory=dict)  # stage 0's prefill chunks
    held: dict[str, list[int]] = field(default_factory=dict)  # what later stages hold

    def open(self, req: Req) -> None:
        max_len = len(req.prompt) + req.max_tokens
        chain = prefix_chain(np.asarray(req.prompt, np.int32))
        # Later stages first, as the broker does: each holds the session before
        # activations can reach it; what each holds of the prompt goes to stage 0.
        for i in reversed(range(len(self.stages))):
            opened = self.stages[i].open(
                req.session,
                f"req-{req.session}",
                max_len,
                req.max_tokens,
                req.sampling,
                req.stop_ids,
                np.asarray(req.prompt, np.int32) if i == 0 else None,
                chain=chain,
                stages=len(self.stages),
                prompt_len=len(req.prompt),
            )
            if i > 0:
                self.held.setdefault(req.session, []).append(opened.held)
        for held in self.held.pop(req.session, []):
            self.stages[0].cached(req.session, held)
        self.tokens[req.session] = []
        self.finishes[req.session] = []
        self.finals[req.session] = []

    def close(self, session: str) -> None:
        for st in self.stages:
            st.close(session)

    def turn(self) -> None:
        """One run() of every stage, in pipeline order."""
        last = len(self.stages) - 1
        for i, st in enumerate(self.stages):
            for out in st.run():
                if i < last:
                    assert out.hidden is not None and out.token is None
                    if i == 0 and out.step == 0:
                        self.finals[out.session].append(out.final)
                    nxt = self.stages[i + 1]
                    nxt.activation(out.session, out.step, out.hidden, out.final, out.prefix)
                    continue
                # The last stage only answers work that completes a position to sample.
                assert out.final and out.token is not None
                got = self.tokens[out.session]
                assert out.step == len(got), "steps arrive in order, one token each"
                got.append(out.token)
                self.finishes[out.session].append(out.finish)
                if out.finish is None:
                    self.stages[0].step(out.session, out.step + 1, out.token)
                else:
                    self.close(out.session)

    def busy(self) -> bool:
        return any(st.has_work() for st in self.stages)

    def run_until_idle(self, max_turns: int = 500) -> None:
        for _ in range(max_turns):
            if not self.busy():
                return
            self.turn()
        raise AssertionError("pipeline still busy after max_turns")


def two_stages(shards: dict[tuple[int, int], MistralShard], **kw: int) -> Pipeline:
    return Pipeline([Stage(shards[(0, 2)], **kw), Stage(shards[(2, 4)], **kw)])


def one_stage(shards: dict[tuple[int, int], MistralShard], **kw: int) -> Pipeline:
    return Pipeline([Stage(shards[(0, 4)], **kw)])


# -- exactness ---------------------------------------------------------------------------


@pytest.mark.parametrize("micro_batches", [0, 1], ids=["a-group-per-stage", "one-group"])
def test_two_stages_match_the_generator_for_interleaved_sessions(
    shards: dict[tuple[int, int], MistralShard], generator: Generator, micro_batches: int
) -> None:
    # Prompt lengths on both sides of the sliding window (8); sessions that end at
    # different steps, so batches keep changing shape.
    reqs = [
        Req("a", prompt(5, 1), 6),
        Req("b", prompt(12, 2), 3),
        Req("c", prompt(3, 3), 9),
        Req("d", prompt(20, 4), 4),
        Req("e", prompt(7, 5), 8),  # cancelled midway
    ]
    p = two_stages(shards, micro_batches=micro_batches)
    p.open(reqs[0])
    p.turn()
    p.open(reqs[1])
    p.turn()
    p.turn()
    p.open(reqs[2])
    p.open(reqs[3])
    p.turn()
    p.open(reqs[4])
    for _ in range(4):
        p.turn()
    for _ in range(20):  # in its own group, e may be a turn or two behind
        if p.tokens["e"]:
            break
        p.turn()
    cancelled_after = len(p.tokens["e"])
    p.close("e")  # the client went away: its pending work must vanish too
    p.run_until_idle()

    for r in reqs[:4]:
        assert p.tokens[r.session] == reference(generator, r.prompt, r.max_tokens), r.session
        assert p.finishes[r.session] == [None] * (r.max_tokens - 1) + ["length"]
    assert 0 < cancelled_after < reqs[4].max_tokens
    assert p.tokens["e"] == reference(generator, reqs[4].prompt, 8)[:cancelled_after]
    # Sessions really shared forwards on both stages.
    assert all(st.stats.max_batch > 1 for st in p.stages)
    # Every cache was freed.
    assert all(not st.sessions and len(st.pool) == 0 for st in p.stages)


def test_chunked_prefill_gives_the_same_tokens(
    shards: dict[tuple[int, int], MistralShard], generator: Generator
) -> None:
    long = Req("long", prompt(11, 6), 5)
    p = two_stages(shards, prefill_chunk=4)
    p.open(long)
    # 11 prompt tokens in chunks of 4: 4, 4, 3. The last stage runs the first two
    # chunks but has nothing to sample yet.
    p.turn()
    p.turn()
    assert p.stages[1].stats.forwards == 2
    assert p.tokens["long"] == []
    p.turn()
    assert len(p.tokens["long"]) == 1
    assert p.finals["long"] == [False, False, True]
    p.run_until_idle()
    assert p.tokens["long"] == reference(generator, long.prompt, long.max_tokens)


def test_chunked_prefill_on_a_whole_model_stage(
    shards: dict[tuple[int, int], MistralShard], generator: Generator
) -> None:
    req = Req("s", prompt(10, 15), 3)
    p = one_stage(shards, prefill_chunk=3)
    p.open(req)
    for _ in range(3):  # chunks of 3, 3, 3 tokens: nothing to sample yet
        p.turn()
        assert p.tokens["s"] == []
    p.turn()  # the last token of the prompt
    assert len(p.tokens["s"]) == 1
    p.run_until_idle()
    assert p.tokens["s"] == reference(generator, req.prompt, req.max_tokens)


def test_chunked_prefill_next_to_running_decodes(
    shards: dict[tuple[int, int], MistralShard], generator: Generator
) -> None:
    reqs = [
        Req("short", prompt(3, 7), 10),
        Req("long", prompt(25, 8), 4),
        Req("mid", prompt(9, 9), 5),
    ]
    p = two_stages(shards, prefill_chunk=6)
    p.open(reqs[0])
    p.turn()
    p.open(reqs[1])
    p.open(reqs[2])
    p.run_until_idle()
    for r in reqs:
        assert p.tokens[r.session] == reference(generator, r.prompt, r.max_tokens), r.session
    # Decodes rode along with the prompt chunks.
    assert p.stages[0].stats.max_batch > 1


def test_a_prompt_entering_while_others_decode_goes_in_busy_chunks(
    shards: dict[tuple[int, int], MistralShard], generator: Generator
) -> None:
    # None decoding: a prompt takes the whole prefill_chunk, in one forward.
    alone = two_stages(shards, prefill_chunk=16, busy_prefill_chunk=4)
    solo = Req("solo", prompt(14, 10), 3)
    alone.open(solo)
    alone.run_until_idle()
    assert alone.finals["solo"] == [True]
    assert alone.tokens["solo"] == reference(generator, solo.prompt, solo.max_tokens)
    # A session decoding: the same prompt goes 4 tokens a forward (4, 4, 4, 2), each
    # forward also carrying the decoding session's step (one group: micro-batches would
    # give the two their own forwards), so neither waits on the other.
    p = two_stages(shards, prefill_chunk=16, busy_prefill_chunk=4, micro_batches=1)
    short, long = Req("short", prompt(3, 11), 12), Req("long", prompt(14, 10), 3)
    p.open(short)
    p.turn()
    assert len(p.tokens["short"]) == 1
    p.open(long)
    for n in range(4):
        p.turn()
        assert p.stages[0].stats.last_batch == 2  # the step and a chunk
        assert len(p.tokens["short"]) == 2 + n
    assert p.finals["long"] == [False, False, False, True]
    p.run_until_idle()
    for r in (short, long):
        assert p.tokens[r.session] == reference(generator, r.prompt, r.max_tokens), r.session


def test_a_batch_holds_several_sessions(shards: dict[tuple[int, int], MistralShard]) -> None:
    stage = Stage(shards[(0, 4)])
    for i in range(3):
        stage.open(f"s{i}", "", 20, 5, GREEDY, frozenset(), np.asarray(prompt(4, i), np.int32))
    outputs = stage.run()
    assert sorted(o.session for o in outputs) == ["s0", "s1", "s2"]
    assert stage.stats.last_batch == 3
    assert stage.stats.tokens == 12
    for o in outputs:
        stage.step(o.session, 1, o.token or 0)
    assert len(stage.run()) == 3
    figures = stage.heartbeat_figures()
    assert figures["sessions"] == 3
    assert figures["kv_tokens_reserved"] == 60
    assert figures["max_batch"] == 3
    assert figures["mean_batch"] == 3.0


# -- admission and closing ---------------------------------------------------------------


def test_cache_full_when_max_sessions_is_exceeded(
    shards: dict[tuple[int, int], MistralShard],
) -> None:
    stage = Stage(shards[(2, 4)], max_sessions=2)
    stage.open("a", "", 10, 5, GREEDY, frozenset())
    stage.open("b", "", 10, 5, GREEDY, frozenset())
    with pytest.raises(CacheFullError):
        stage.open("c", "", 10, 5, GREEDY, frozenset())
    assert sorted(stage.sessions) == ["a", "b"]  # the refused session left nothing behind
    stage.close("a")
    stage.open("c", "", 10, 5, GREEDY, frozenset())


def test_cache_full_when_max_kv_tokens_is_exceeded(
    shards: dict[tuple[int, int], MistralShard],
) -> None:
    stage = Stage(shards[(0, 2)], max_kv_tokens=50)
    stage.open("a", "", 30, 5, GREEDY, frozenset(), np.asarray([5, 6], np.int32))
    with pytest.raises(CacheFullError):
        stage.open("b", "", 30, 5, GREEDY, frozenset(), np.asarray([5, 6], np.int32))
    stage.open("c", "", 20, 5, GREEDY, frozenset(), np.asarray([5, 6], np.int32))  # fits exactly
    assert stage.heartbeat_figures()["kv_tokens_reserved"] == 50
    stage.close("a")
    stage.open("b", "", 30, 5, GREEDY, frozenset(), np.asarray([5, 6], np.int32))


def test_close_drops_pending_work(shards: dict[tuple[int, int], MistralShard]) -> None:
    first = Stage(shards[(0, 2)])
    first.open("a", "", 10, 5, GREEDY, frozenset(), np.asarray([5, 6, 7], np.int32))
    assert first.has_work()  # the prompt waits to be run
    assert first.close("a")
    assert not first.has_work()
    assert first.run() == []

    later = Stage(shards[(2, 4)])
    later.open("a", "", 10, 5, GREEDY, frozenset())
    later.open("b", "", 10, 5, GREEDY, frozenset())
    hidden = torch.zeros(3, shards[(2, 4)].args.hidden_size)
    later.activation("a", 0, hidden, True)
    later.activation("b", 0, hidden, True)
    assert later.close("a")
    # Only b's work is left.
    assert [o.session for o in later.run()] == ["b"]
    assert not later.has_work()
    assert len(later.pool) == 1


def test_unknown_sessions_are_refused(shards: dict[tuple[int, int], MistralShard]) -> None:
    stage = Stage(shards[(0, 4)])
    later = Stage(shards[(2, 4)])
    assert not stage.close("nope")
    with pytest.raises(BadWork, match="no such session"):
        stage.step("nope", 1, 5)
    with pytest.raises(BadWork, match="no such session"):
        later.activation("nope", 0, torch.zeros(1, 64), True)
    assert not stage.has_work() and not later.has_work()


def test_a_step_after_close_is_refused(shards: dict[tuple[int, int], MistralShard]) -> None:
    stage = Stage(shards[(0, 4)])
    stage.open("a", "", 10, 5, GREEDY, frozenset(), np.asarray([5, 6, 7], np.int32))
    (out,) = stage.run()
    stage.step("a", 1, out.token or 0)
    stage.close("a")
    assert stage.run() == []
    with pytest.raises(BadWork):
        stage.step("a", 2, 5)


def test_warmup_leaves_no_session(shards: dict[tuple[int, int], MistralShard]) -> None:
    for r in [(0, 2), (2, 4)]:
        stage = Stage(shards[r])
        stage.warmup()
        assert not stage.sessions
        assert len(stage.pool) == 0
        assert not stage.has_work()


# -- finishing and sampling --------------------------------------------------------------


def test_finish_stop_when_a_stop_id_is_sampled(
    shards: dict[tuple[int, int], MistralShard], generator: Generator
) -> None:
    tokens = prompt(6, 10)
    ref = reference(generator, tokens, 8)
    stop = ref[2]
    expected = ref[: ref.index(stop) + 1]  # the stop token is sent, then it ends
    p = one_stage(shards)
    p.open(Req("s", tokens, 8, stop_ids=frozenset({stop})))
    p.run_until_idle()
    assert p.tokens["s"] == expected
    assert p.finishes["s"] == [None] * (len(expected) - 1) + ["stop"]


def test_finish_length_at_max_tokens(
    shards: dict[tuple[int, int], MistralShard], generator: Generator
) -> None:
    tokens = prompt(6, 11)
    p = one_stage(shards)
    p.open(Req("s", tokens, 3))
    p.run_until_idle()
    assert p.tokens["s"] == reference(generator, tokens, 3)
    assert p.finishes["s"] == [None, None, "length"]


def test_max_tokens_one_finishes_at_the_first_token(
    shards: dict[tuple[int, int], MistralShard],
) -> None:
    p = two_stages(shards)
    p.open(Req("s", prompt(4, 12), 1))
    p.run_until_idle()
    assert len(p.tokens["s"]) == 1
    assert p.finishes["s"] == ["length"]


def test_seeded_sampling_replays_the_same_tokens(
    shards: dict[tuple[int, int], MistralShard], generator: Generator
) -> None:
    sampling = SamplingParams(temperature=1.0, top_k=50, top_p=0.95, seed=1234)
    tokens = prompt(7, 13)
    runs = []
    for attempt in range(2):
        p = two_stages(shards)
        # Different company in the batches each time: it must not change the draws.
        if attempt == 1:
            p.open(Req("other", prompt(5, 14), 6, sampling=SamplingParams(0.7, seed=9)))
            p.turn()
        p.open(Req("s", tokens, 8, sampling=sampling))
        p.run_until_idle()
        runs.append(p.tokens["s"])
    assert runs[0] == runs[1]
    assert runs[0] == reference(generator, tokens, 8, sampling)


def test_memory_limit_refuses_new_sessions(tiny_model_dir: Path) -> None:
    from zmqllm.bus.sampling_params import SamplingParams
    from zmqllm.engine.cache import CacheFullError
    from zmqllm.engine.generator import load_shard
    from zmqllm.engine.stage import Stage

    # A limit below what the process already uses: every new session is refused.
    stage = Stage(load_shard(tiny_model_dir, 0, 4), max_memory_mb=1)
    with pytest.raises(CacheFullError, match="max_memory_mb"):
        stage.open("s", "r", 16, 4, SamplingParams(), frozenset(), np.arange(3, dtype=np.int32))
    roomy = Stage(load_shard(tiny_model_dir, 0, 4), max_memory_mb=1 << 20)
    roomy.open("s", "r", 16, 4, SamplingParams(), frozenset(), np.arange(3, dtype=np.int32))


def test_coalesce_wait_only_while_some_sessions_are_elsewhere(
    shards: dict[tuple[int, int], MistralShard],
) -> None:
    import time

    stage = Stage(shards[(0, 2)])
    for sid in ("a", "b"):
        stage.open(sid, "", 20, 8, GREEDY, frozenset(), np.asarray([5, 6, 7], np.int32))
    now = time.monotonic()
    assert stage.coalesce_wait(now) == 0.0  # prompts waiting: never hold them back
    assert not stage.others_pending()
    stage.run()  # both prompts in one forward; now the stage knows its forward time
    stage.step("a", 1, 9)
    # Asked the moment a's step came (its own timestamp), not some time after it.
    wait = stage.coalesce_wait(stage.oldest_ready())
    assert 0.0 < wait <= COALESCE_MAX_S  # b is on another stage: may wait for it
    assert stage.coalesce_wait(time.monotonic() + COALESCE_MAX_S) == 0.0  # bounded
    # ... from when it was last stalled elsewhere (the worker's `since`), if later.
    later = time.monotonic() + COALESCE_MAX_S
    assert stage.coalesce_wait(later, since=later - 0.01) == pytest.approx(COALESCE_MAX_S - 0.01)
    assert stage.others_pending()
    stage.step("b", 1, 9)
    assert not stage.others_pending()
    assert stage.coalesce_wait(time.monotonic()) == 0.0  # everyone is ready: go
    assert len(stage.run()) == 2


# -- validation before computing -----------------------------------------------------------


def prefilled(shard: MistralShard, sessions: Sequence[str]) -> Stage:
    """A stage-0 stage whose sessions have run their prompts (each expects step 1)."""
    stage = Stage(shard, prefill_chunk=8)
    for sid in sessions:
        stage.open(sid, "", 20, 8, GREEDY, frozenset(), np.asarray([5, 6], np.int32))
    assert len(stage.run()) == len(sessions) or not shard.is_last
    return stage


@pytest.mark.parametrize(
    ("token", "step", "problem"),
    [
        (0, 1, "not in"),  # 0 stands for vocab_size: the first id past the vocabulary
        (10**9, 1, "not in"),
        (-1, 1, "not in"),
        (5, 2, "expected 1"),
        (5, 0, "expected 1"),
        (5, 8, "expected 1"),
    ],
)
def test_a_bad_step_is_refused_before_any_tensor_op(
    shards: dict[tuple[int, int], MistralShard], token: int, step: int, problem: str
) -> None:
    stage = prefilled(shards[(0, 4)], ["a", "b"])
    with pytest.raises(BadWork, match=problem):
        stage.step("a", step, token or stage.shard.args.vocab_size)
    # Nothing was queued for a; b's step runs alone and a is still open for the worker
    # to close and answer.
    stage.step("b", 1, 7)
    assert [o.session for o in stage.run()] == ["b"]
    assert "a" in stage.sessions


def test_a_step_during_prefill_or_past_max_tokens_is_refused(
    shards: dict[tuple[int, int], MistralShard],
) -> None:
    stage = Stage(shards[(0, 4)])
    stage.open("a", "", 20, 2, GREEDY, frozenset(), np.asarray([5, 6], np.int32))
    with pytest.raises(BadWork, match="prefill"):
        stage.step("a", 1, 5)
    stage.run()
    stage.step("a", 1, 5)
    stage.run()
    with pytest.raises(BadWork, match="max_tokens"):
        stage.step("a", 2, 5)  # max_tokens 2: steps 0 and 1 only


def test_a_prompt_outside_the_vocabulary_is_refused(
    shards: dict[tuple[int, int], MistralShard],
) -> None:
    stage = Stage(shards[(0, 2)])
    for bad in ([5, stage.shard.args.vocab_size], [-1, 5], []):
        with pytest.raises(ValueError, match=r"vocab_size|int32"):
            stage.open("a", "", 20, 2, GREEDY, frozenset(), np.asarray(bad, np.int32))
    with pytest.raises(ValueError, match="int32"):
        stage.open("a", "", 20, 2, GREEDY, frozenset())  # stage 0 without a prompt
    with pytest.raises(ValueError, match="only stage 0"):
        Stage(shards[(2, 4)]).open("a", "", 20, 2, GREEDY, frozenset(), np.asarray([5]))
    assert not stage.sessions and len(stage.pool) == 0


@pytest.mark.parametrize(
    ("rows", "width", "dtype", "problem"),
    [
        (0, 64, torch.float32, "rows"),
        (9, 64, torch.float32, "rows"),  # past this stage's prefill_chunk of 8
        (1, 63, torch.float32, "expected"),
        (1, 128, torch.float32, "expected"),
        (1, 64, torch.float64, "float64"),
    ],
)
def test_a_bad_activation_is_refused_before_any_tensor_op(
    shards: dict[tuple[int, int], MistralShard],
    rows: int,
    width: int,
    dtype: torch.dtype,
    problem: str,
) -> None:
    stage = Stage(shards[(2, 4)], prefill_chunk=8)
    stage.open("a", "", 20, 5, GREEDY, frozenset())
    stage.open("b", "", 20, 5, GREEDY, frozenset())
    with pytest.raises(BadWork, match=problem):
        stage.activation("a", 0, torch.zeros(rows, width, dtype=dtype), True)
    stage.activation("b", 0, torch.zeros(3, 64), True)
    assert [o.session for o in stage.run()] == ["b"]


@pytest.mark.parametrize("wire", [torch.bfloat16, torch.float16], ids=str)
def test_a_narrower_activation_is_cast_to_the_stage_dtype(
    shards: dict[tuple[int, int], MistralShard], wire: torch.dtype
) -> None:
    """What a float32 stage makes of a bf16/fp16 activation is what it makes of the
    same values in float32: the wire dtype rounds them, the stage adds nothing."""
    hidden = torch.randn(5, 64, generator=torch.Generator().manual_seed(3))
    stage = Stage(shards[(2, 4)], prefill_chunk=8)
    stage.open("a", "", 20, 5, GREEDY, frozenset())
    stage.open("b", "", 20, 5, GREEDY, frozenset())
    stage.activation("a", 0, hidden.to(wire), True)
    stage.activation("b", 0, hidden.to(wire).float(), True)
    queued = [w.inputs for w in stage.scheduler.ready]
    assert [x.dtype for x in queued] == [torch.float32, torch.float32]
    assert torch.equal(queued[0], queued[1])
    tokens = {o.session: o.token for _ in range(2) for o in stage.run()}
    assert tokens["a"] == tokens["b"]


def test_activation_steps_follow_the_prompt_in_order(
    shards: dict[tuple[int, int], MistralShard],
) -> None:
    stage = Stage(shards[(2, 4)], prefill_chunk=8)
    stage.open("a", "", 20, 5, GREEDY, frozenset())
    with pytest.raises(BadWork, match="before the prompt"):
        stage.activation("a", 1, torch.zeros(1, 64), True)
    stage.activation("a", 0, torch.zeros(4, 64), False)  # chunks of a prompt
    stage.activation("a", 0, torch.zeros(2, 64), True)  # its last
    with pytest.raises(BadWork, match="one final row"):
        stage.activation("a", 1, torch.zeros(2, 64), True)
    with pytest.raises(BadWork, match="expected 1"):
        stage.activation("a", 2, torch.zeros(1, 64), True)
    stage.activation("a", 1, torch.zeros(1, 64), True)
    stage.open("x", "", 4, 2, GREEDY, frozenset())
    with pytest.raises(BadWork, match="overflow"):
        stage.activation("x", 0, torch.zeros(5, 64), True)  # 5 rows into a cache of 4
    first = prefilled(shards[(0, 4)], ["a"])
    with pytest.raises(BadWork, match="stage 0"):
        first.activation("a", 0, torch.zeros(1, 64), True)


class FailingShard:
    """A shard whose forward raises; everything else is the real shard's."""

    def __init__(self, shard: MistralShard) -> None:
        self._shard = shard

    def __getattr__(self, name: str) -> object:
        return getattr(self._shard, name)

    def __call__(self, *_: object) -> torch.Tensor:
        raise RuntimeError("device lost")


def test_a_failed_forward_names_only_the_sessions_in_its_batch(
    shards: dict[tuple[int, int], MistralShard],
) -> None:
    stage = prefilled(shards[(0, 4)], ["a", "b", "c"])
    stage.step("a", 1, 5)
    stage.step("b", 1, 6)  # c's step has not come back: it is not in the batch
    stage.shard = FailingShard(stage.shard)  # type: ignore[assignment]
    with pytest.raises(BatchFailed) as failed:
        stage.run()
    assert sorted(failed.value.keys) == ["a", "b"]
    assert isinstance(failed.value.__cause__, RuntimeError)
    assert sorted(stage.sessions) == ["a", "b", "c"]  # the worker closes what failed
