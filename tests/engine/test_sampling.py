"""Sampling: determinism per (seed, step), filters, validation, distribution."""

from __future__ import annotations

import math

import numpy as np
import pytest

from zmqllm.bus.sampling_params import LOGPROB_FLOOR, MAX_LOGPROBS, NO_LOGPROBS, SamplingParams
from zmqllm.engine.sampling import logprobs_of, sample, sample_batch


def _random_logits(rng: np.random.Generator, vocab: int = 200) -> np.ndarray:
    return (rng.normal(size=vocab) * rng.uniform(0.5, 4.0)).astype(np.float32)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x.astype(np.float64) - x.max())
    return e / e.sum()


def test_same_seed_and_step_give_same_token() -> None:
    logits = _random_logits(np.random.default_rng(0), 1000)
    params = SamplingParams(temperature=1.0, seed=1234)
    first = [sample(logits, params, step) for step in range(50)]
    for _ in range(20):
        assert [sample(logits, params, step) for step in range(50)] == first


def test_different_steps_and_seeds_vary() -> None:
    logits = np.zeros(1000, dtype=np.float32)  # uniform: any token equally likely
    params = SamplingParams(temperature=1.0, seed=7)
    by_step = {sample(logits, params, step) for step in range(50)}
    assert len(by_step) > 30
    by_seed = {sample(logits, SamplingParams(temperature=1.0, seed=s), 3) for s in range(50)}
    assert len(by_seed) > 30


def test_token_does_not_depend_on_batch_neighbours() -> None:
    rng = np.random.default_rng(1)
    rows = np.stack([_random_logits(rng, 300) for _ in range(4)])
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=s) for s in (1, 2, 3, 4)]
    steps = [10, 0, 5, 99]
    batch = sample_batch(rows, params, steps)
    alone = [sample(rows[i], params[i], steps[i]) for i in range(4)]
    assert batch == alone
    assert sample_batch(rows[2:3], params[2:3], steps[2:3]) == [alone[2]]


def test_temperature_zero_is_argmax_first_on_ties() -> None:
    rng = np.random.default_rng(2)
    for _ in range(50):
        logits = _random_logits(rng)
        assert sample(logits, SamplingParams(), step=0) == int(np.argmax(logits))
    ties = np.array([0.0, 3.0, 1.0, 3.0, 3.0], dtype=np.float32)
    assert sample(ties, SamplingParams(seed=5), step=9) == 1


def test_top_k_one_is_greedy() -> None:
    rng = np.random.default_rng(3)
    for seed in range(50):
        logits = _random_logits(rng)
        params = SamplingParams(temperature=1.5, top_k=1, seed=seed)
        assert sample(logits, params, step=seed) == int(np.argmax(logits))
    ties = np.array([0.0, 3.0, 1.0, 3.0], dtype=np.float32)
    assert sample(ties, SamplingParams(temperature=1.0, top_k=1), step=0) == 1


def test_top_k_never_picks_outside_k_largest() -> None:
    rng = np.random.default_rng(4)
    for trial in range(300):
        logits = _random_logits(rng, int(rng.integers(5, 400)))
        k = int(rng.integers(1, 10))
        params = SamplingParams(temperature=float(rng.uniform(0.3, 3.0)), top_k=k, seed=trial)
        token = sample(logits, params, step=trial)
        kth_largest = np.sort(logits)[-k]
        assert logits[token] >= kth_largest


def test_top_p_never_picks_outside_nucleus() -> None:
    rng = np.random.default_rng(5)
    for trial in range(300):
        logits = _random_logits(rng, int(rng.integers(5, 400)))
        temperature = float(rng.uniform(0.3, 2.0))
        top_p = float(rng.uniform(0.05, 0.95))
        params = SamplingParams(temperature=temperature, top_p=top_p, seed=trial)
        token = sample(logits, params, step=trial)
        probs = _softmax(logits.astype(np.float64) / temperature)
        # Tokens strictly more likely than the pick must not already reach top_p on their own.
        assert probs[probs > probs[token]].sum() < top_p + 1e-12


def test_top_p_keeps_at_least_one_token() -> None:
    logits = np.array([10.0, 0.0, -1.0, 0.0])
    for step in range(20):
        params = SamplingParams(temperature=1.0, top_p=1e-9, seed=3)
        assert sample(logits, params, step) == 0


def test_top_k_then_top_p() -> None:
    # After top-k=2 the kept probabilities are renormalised: 0.5 / 0.5, so top_p=0.6 needs both.
    logits = np.log(np.array([0.3, 0.3, 0.2, 0.2]))
    params = SamplingParams(temperature=1.0, top_k=2, top_p=0.6, seed=11)
    picks = {sample(logits, params, step) for step in range(200)}
    assert picks == {0, 1}


def test_large_vocab_nucleus_matches_small_path() -> None:
    # The nucleus search grows its candidate block; a flat distribution forces several rounds.
    rng = np.random.default_rng(6)
    logits = rng.normal(size=50_000) * 0.1
    params = SamplingParams(temperature=1.0, top_p=0.99, seed=2)
    tokens = [sample(logits, params, step) for step in range(20)]
    probs = _softmax(logits)
    order = np.argsort(-probs, kind="stable")
    cut = int(np.searchsorted(np.cumsum(probs[order]), 0.99)) + 1
    nucleus = set(order[:cut].tolist())
    assert all(token in nucleus for token in tokens)


def test_empirical_distribution_follows_softmax() -> None:
    logits = np.array([2.0, 1.0, 0.5, 0.0, -1.0, -3.0], dtype=np.float32)
    expected = _softmax(logits)
    params = SamplingParams(temperature=1.0, seed=42)
    n = 20_000
    counts = np.bincount([sample(logits, params, step) for step in range(n)], minlength=6)
    observed = counts / n
    # About 4 standard errors per bucket; fixed seed, so the test is deterministic anyway.
    tolerance = 4 * np.sqrt(expected * (1 - expected) / n) + 1e-3
    assert np.all(np.abs(observed - expected) <= tolerance)


def test_temperature_sharpens() -> None:
    logits = np.array([1.0, 0.0, 0.0, 0.0])
    n = 2000
    hot = sum(sample(logits, SamplingParams(temperature=5.0, seed=1), s) == 0 for s in range(n))
    cold = sum(sample(logits, SamplingParams(temperature=0.2, seed=1), s) == 0 for s in range(n))
    assert cold > hot


def test_infinities() -> None:
    masked = np.array([-np.inf, 1.0, -np.inf, 0.5])
    for step in range(50):
        assert sample(masked, SamplingParams(temperature=1.0, seed=1), step) in (1, 3)
    assert sample(masked, SamplingParams(temperature=1.0, top_k=3, seed=1), 0) in (1, 3)
    pos = np.array([0.0, np.inf, 5.0, np.inf])
    picks = {sample(pos, SamplingParams(temperature=1.0, seed=1), step) for step in range(50)}
    assert picks == {1, 3}
    assert sample(pos, SamplingParams(), 0) == 1
    huge = np.array([1e308, 5e307, 0.0])
    assert sample(huge, SamplingParams(temperature=1e-5, seed=1), 0) == 0


@pytest.mark.parametrize(
    "logits",
    [
        np.array([np.nan, 1.0]),
        np.array([np.nan, np.nan]),
        np.array([-np.inf, -np.inf]),
        np.zeros(0),
        np.zeros((2, 3)),
    ],
)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_bad_logits_raise(logits: np.ndarray, temperature: float) -> None:
    with pytest.raises(ValueError):
        sample(logits, SamplingParams(temperature=temperature), 0)


def test_bad_step_and_batch_shapes_raise() -> None:
    with pytest.raises(ValueError, match="step"):
        sample(np.zeros(3), SamplingParams(), -1)
    with pytest.raises(ValueError):
        sample_batch(np.zeros(3), [SamplingParams()], [0])
    with pytest.raises(ValueError):
        sample_batch(np.zeros((2, 3)), [SamplingParams()], [0, 1])


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**63}, "seed"),
    ],
)
def test_validate_names_bad_parameter(kwargs: dict[str, float], name: str) -> None:
    params = SamplingParams(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=name):
        params.validate()
    with pytest.raises(ValueError, match=name):
        sample(np.zeros(4), params, 0)


def test_validate_accepts_edges() -> None:
    SamplingParams(temperature=0.0, top_p=1.0, top_k=0, seed=0).validate()
    SamplingParams(temperature=100.0, top_p=1e-6, top_k=10**6, seed=2**63 - 1).validate()


def test_dict_round_trip() -> None:
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=40, seed=2**63 - 1)
    data = params.to_dict()
    assert data == {"temperature": 0.7, "top_p": 0.9, "top_k": 40, "seed": 2**63 - 1}
    assert SamplingParams.from_dict(data) == params
    assert SamplingParams.from_dict({}) == SamplingParams()
    replayed = SamplingParams(temperature=0.7, seed=5, first_step=12)
    assert replayed.to_dict()["first_step"] == 12
    assert SamplingParams.from_dict(replayed.to_dict()) == replayed
    # Integers are fine where a float is expected (JSON clients send 1 for 1.0).
    assert SamplingParams.from_dict({"temperature": 1}).temperature == 1.0
    assert isinstance(SamplingParams.from_dict({"temperature": 1}).temperature, float)


@pytest.mark.parametrize(
    "data",
    [
        {"temperatur": 0.5},
        {"temperature": "0.5"},
        {"temperature": None},
        {"temperature": True},
        {"top_k": 1.0},
        {"top_k": True},
        {"seed": "1"},
        {"top_p": 2.0},
        {"seed": -5},
    ],
)
def test_from_dict_rejects(data: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        SamplingParams.from_dict(data)


def test_from_dict_rejects_non_mapping() -> None:
    with pytest.raises(ValueError):
        SamplingParams.from_dict([("temperature", 1.0)])  # type: ignore[arg-type]


@pytest.mark.parametrize("first_step", [-1, 2**31, 1.5, True])
def test_first_step_must_be_a_step(first_step: object) -> None:
    with pytest.raises(ValueError, match="first_step"):
        SamplingParams(first_step=first_step).validate()  # type: ignore[arg-type]


def test_a_replay_draws_what_the_lost_session_would_have() -> None:
    """Step t of a generation draws from (seed, t) whether it is step t of the session
    that began it or step t - k of a replay that began at first_step k."""
    rng = np.random.default_rng(3)
    rows = rng.normal(size=(12, 50))
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=77)
    whole = [sample(rows[t], params, t) for t in range(12)]
    replay = SamplingParams(temperature=0.9, top_p=0.95, seed=77, first_step=5)
    assert [sample(rows[t], replay, t - 5) for t in range(5, 12)] == whole[5:]
    # ...and the steps really matter: draws at other steps differ somewhere.
    assert [sample(rows[t], params, t + 1) for t in range(12)] != whole


@pytest.mark.torch
def test_logprobs_are_the_log_softmax_chosen_first_then_the_most_likely() -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    logits = rng.normal(0, 4, 5000).astype(np.float32)
    logits[[10, 20]] = 30.0  # a tie at the top: the lower id first
    ids, values = logprobs_of(logits, 1234, 5)
    assert ids[0] == 1234 and len(ids) == len(values) == 6
    want = torch.log_softmax(torch.from_numpy(logits).double(), -1).numpy()
    assert ids[1:] == tuple(int(i) for i in np.argsort(-want, kind="stable")[:5])
    assert ids[1:3] == (10, 20)
    np.testing.assert_allclose(values, want[list(ids)], atol=1e-9)
    assert list(values[1:]) == sorted(values[1:], reverse=True)
    # numpy's log-sum-exp against torch's log_softmax: float64 sums of 5000 terms in
    # different orders (SIMD width depends on the CPU: AVX2 vs AVX-512) differ in the last
    # bits, about K * eps64 * 31 ~ 2e-11 at most; 1e-9 as above, a wrong formula is off
    # by far more.
    only_token = logprobs_of(logits, 7, 0)
    assert only_token[0] == (7,)
    assert only_token[1] == pytest.approx((float(want[7]),), rel=0, abs=1e-9)


def test_logprobs_of_an_impossible_token_stop_at_the_floor() -> None:
    logits = np.array([0.0, -np.inf, 5.0], np.float32)
    ids, values = logprobs_of(logits, 1, 2)
    assert ids == (1, 2, 0) and values[0] == LOGPROB_FLOOR


def test_logprobs_travel_with_the_params_only_when_asked() -> None:
    assert "logprobs" not in SamplingParams().to_dict()
    asked = SamplingParams(logprobs=3)
    assert SamplingParams.from_dict(asked.to_dict()) == asked
    for bad in (NO_LOGPROBS - 1, MAX_LOGPROBS + 1):
        with pytest.raises(ValueError, match="logprobs"):
            SamplingParams(logprobs=bad).validate()
