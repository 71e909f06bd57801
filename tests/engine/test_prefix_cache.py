"""Prefix caching in the stages, driven by hand without sockets (test_stage's Pipeline
plays the broker: it sends each stage the prompt's keys, and stage 0 what the later
stages hold).

A session whose prompt starts with a cached prefix computes only the rest, and its tokens
are the Generator's (HF-exact) tokens for the whole prompt; stages that hold different
amounts agree on the least; cached blocks give way to live sessions and never touch
one.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tests.engine.test_stage import Pipeline, Req, prompt, reference  # noqa: E402
from zmqllm.bus.prefix import PREFIX_BLOCK, PrefixIndex, prefix_blocks, prefix_chain  # noqa: E402
from zmqllm.bus.sampling_params import SamplingParams  # noqa: E402
from zmqllm.engine.cache import CacheFullError  # noqa: E402
from zmqllm.engine.generator import Generator, load_shard  # noqa: E402
from zmqllm.engine.model import MistralShard  # noqa: E402
from zmqllm.engine.stage import BadWork, Stage  # noqa: E402

pytestmark = pytest.mark.torch


@pytest.fixture(scope="module")
def shards(tiny_model_dir: Path) -> dict[tuple[int, int], MistralShard]:
    return {r: load_shard(tiny_model_dir, *r) for r in [(0, 2), (2, 4)]}


@pytest.fixture(scope="module")
def generator(tiny_model_dir: Path) -> Generator:
    return Generator(tiny_model_dir)


def pipeline(shards: dict[tuple[int, int], MistralShard], **kw: int) -> Pipeline:
    return Pipeline([Stage(shards[(0, 2)], **kw), Stage(shards[(2, 4)], **kw)])


def forwarded_tokens(p: Pipeline) -> int:
    return p.stages[0].stats.tokens


# -- keys ------------------------------------------------------------------------------


def test_keys_name_whole_blocks_and_the_whole_prefix_before_them() -> None:
    a = np.arange(3, 3 + 50, dtype=np.int32)
    chain = prefix_chain(a)
    assert len(chain) == prefix_blocks(50) == 3  # 49 tokens: 3 whole blocks, last token out
    assert prefix_chain(a[:17]) == chain[:1]  # a prefix's keys are the prefix of the keys
    assert prefix_chain(a[:16]) == ()  # 15 tokens before the last: no whole block
    b = a.copy()
    b[0] += 1  # one token early on changes every later key
    assert all(x != y for x, y in zip(prefix_chain(b), chain, strict=True))
    assert all(0 <= k < 1 << 63 for k in chain)


def test_the_broker_index_follows_what_it_sent_where() -> None:
    index = PrefixIndex(max_keys=4)
    chain = prefix_chain(np.arange(100, dtype=np.int32))  # 6 keys
    index.note("w1", chain[:3])
    assert index.held("w1", chain) == 3
    assert index.held("w2", chain) == 0
    index.note("w1", chain[3:5])  # 5 keys > 4: the least recently noted goes
    assert index.held("w1", chain) == 0
    assert index.held("w1", chain[1:]) == 4
    index.forget("w1")
    assert index.held("w1", chain[1:]) == 0


# -- exactness ---------------------------------------------------------------------------


def test_a_cached_prefix_gives_the_generators_tokens_and_skips_its_forward(
    shards: dict[tuple[int, int], MistralShard], generator: Generator
) -> None:
    system = prompt(70, seed=1)
    first = system + prompt(9, seed=2)
    second = first + prompt(30, seed=3)  # the next turn: the whole first prompt again
    p = pipeline(shards)
    p.open(Req("t1", first, 12))
    p.run_until_idle()
    assert p.tokens["t1"] == reference(generator, first, 12)
    cold = forwarded_tokens(p)
    assert cold == len(first) + 11  # the prompt, then one row per decode step

    p.open(Req("t2", second, 12))
    held = p.stages[0].sessions["t2"].reused
    assert held == prefix_blocks(len(first)) * PREFIX_BLOCK == 64
    p.run_until_idle()
    assert p.tokens["t2"] == reference(generator, second, 12)
    assert forwarded_tokens(p) - cold == len(second) - held + 11
    for st in p.stages:
        stats = st.prefixes.stats
        assert stats.query_tokens == len(first) + len(second)
        assert stats.hit_tokens == held


def test_stages_holding_different_amounts_start_after_the_least(
    shards: dict[tuple[int, int], MistralShard], generator: Generator
) -> None:
    long = prompt(100, seed=4)
    p = pipeline(shards)
    p.open(Req("a", long, 6))
    p.run_until_idle()
    # The second stage lost all but its first two blocks (another session's room).
    later = p.stages[1].prefixes
    later._blocks = OrderedDict(list(later._blocks.items())[:2])
    p.open(Req("b", long, 6))
    assert p.stages[0].sessions["b"].reused == 2 * PREFIX_BLOCK
    p.run_until_idle()
    assert p.tokens["b"] == reference(generator, long, 6)


def test_stage_zero_waits_for_every_later_stage_before_the_prompt(
    shards: dict[tuple[int, int], MistralShard],
) -> None:
    long = prompt(40, seed=5)
    chain = prefix_chain(np.asarray(long, np.int32))
    st = Stage(shards[(0, 2)])
    st.open("a", "r", 50, 4, SamplingParams(), frozenset(), np.asarray(long, np.int32), chain)
    st.run()  # one stage: its prompt runs at once, and its blocks are kept
    assert len(st.prefixes) == 2
    st.open(
        "b", "r", 50, 4, SamplingParams(), frozenset(), np.asarray(long, np.int32), chain, 3, 40
    )
    assert not st.has_work()  # two later stages to hear from
    st.cached("b", 32)
    assert not st.has_work()
    st.cached("nobody", 32)  # a closed session's word: nothing happens
    st.cached("b", 20)  # holds one whole block and a part
    assert st.has_work()
    assert st.sessions["b"].reused == PREFIX_BLOCK
    (out,) = st.run()
    assert out.prefix == PREFIX_BLOCK and out.hidden is not None
    assert out.hidden.shape[0] == 40 - PREFIX_BLOCK
    st.cached("b", 0)  # too late: ignored


def test_a_later_stage_refuses_a_prefix_it_does_not_hold(
    shards: dict[tuple[int, int], MistralShard],
) -> None:
    st = Stage(shards[(2, 4)])
    chain = prefix_chain(np.arange(3, 43, dtype=np.int32))
    st.open("s", "r", 50, 4, SamplingParams(), frozenset(), chain=chain, stages=2, prompt_len=40)
    assert st.sessions["s"].held == 0
    hidden = torch.zeros(8, shards[(2, 4)].args.hidden_size)
    with pytest.raises(BadWork, match="holds 0"):
        st.activation("s", 0, hidden, True, prefix=PREFIX_BLOCK)
    with pytest.raises(BadWork, match="prefix of 5"):
        st.activation("s", 0, hidden, True, prefix=5)


def test_without_the_prefix_cache_nothing_is_kept(
    shards: dict[tuple[int, int], MistralShard], generator: Generator
) -> None:
    long = prompt(60, seed=6)
    p = pipeline(shards, prefix_cache=False)
    for name in ("a", "b"):
        p.open(Req(name, long, 5))
        assert p.stages[0].sessions[name].reused == 0
        p.run_until_idle()
        assert p.tokens[name] == reference(generator, long, 5)
    assert all(
        st.prefixes is None and "prefix_hit_tokens" not in st.heartbeat_figures() for st in p.stages
    )


# -- memory ------------------------------------------------------------------------------


def test_cached_blocks_give_way_to_live_sessions_and_never_break_one(
    shards: dict[tuple[int, int], MistralShard], generator: Generator
) -> None:
    # Room for 200 KV tokens: the cached blocks fill what live sessions leave free.
    p = pipeline(shards, max_kv_tokens=200)
    prompts = [prompt(60, seed=10 + i) for i in range(4)]
    p.open(Req("live", prompts[0], 40))  # stays open while the others come and go
    p.turn()
    p.turn()
    for i, toks in enumerate(prompts[1:]):
        p.open(Req(f"s{i}", toks, 20))
        p.run_until_idle()
        assert p.tokens[f"s{i}"] == reference(generator, toks, 20)
        for st in p.stages:
            assert st.pool.reserved + st.prefixes.tokens <= 200
    assert p.tokens["live"] == reference(generator, prompts[0], 40)
    evicted = [st.prefixes.stats.evicted_blocks for st in p.stages]
    assert all(n > 0 for n in evicted), evicted
    # A session as large as the whole room still opens: every block gives way.
    p.open(Req("big", prompt(100, seed=20), 100))
    assert all(len(st.prefixes) == 0 for st in p.stages)


def test_a_memory_limit_drops_the_cached_blocks_before_refusing(
    shards: dict[tuple[int, int], MistralShard], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The limit counts KV bytes reserved (the cached blocks' too), not RSS: room for a
    50-token session and 20 tokens more, so once two blocks are cached a second session
    only fits when they are dropped."""
    from zmqllm.engine import stage as stage_module

    shard = shards[(0, 2)]
    per_token = shard.args.kv_bytes_per_token(shard.num_local_layers, 4)
    fixed = (1000 << 20) - 70 * per_token  # what the stage holds before any session
    monkeypatch.setattr(stage_module, "memory_in_use", lambda device: fixed)
    st = Stage(shard, max_memory_mb=1000)
    toks = np.asarray(prompt(40, seed=7), np.int32)
    st.open("a", "r", 50, 4, SamplingParams(), frozenset(), toks, prefix_chain(toks))
    st.run()
    st.close("a")
    assert len(st.prefixes) == 2
    st.open("b", "r", 50, 4, SamplingParams(), frozenset(), toks, prefix_chain(toks))
    assert len(st.prefixes) == 0
    assert st.sessions["b"].reused == 0
    with pytest.raises(CacheFullError, match="KV reserved"):
        st.open("c", "r", 50, 4, SamplingParams(), frozenset(), toks)


def test_a_new_prompt_is_kept_in_place_of_the_least_recently_used(
    shards: dict[tuple[int, int], MistralShard],
) -> None:
    """Once the cache fills the room, a new prompt's blocks replace the oldest ones (it
    is not turned away): the next turn of a new conversation still finds its prompt."""
    st = Stage(shards[(0, 2)], max_kv_tokens=200)
    prompts = [np.asarray(prompt(70, seed=30 + i), np.int32) for i in range(4)]
    for i, toks in enumerate(prompts):
        st.open(f"s{i}", "r", 80, 4, SamplingParams(), frozenset(), toks, prefix_chain(toks))
        st.run()
        st.close(f"s{i}")
        assert st.prefixes.tokens <= 200
    # 4 blocks each, room for 12: the newest prompt is whole, the oldest gone.
    assert st.prefixes.held(prefix_chain(prompts[-1])) == 4
    assert st.prefixes.held(prefix_chain(prompts[0])) == 0
