"""A request's limits are declared once (bus/sampling_params.py): the gateway's request
schema, the bus's SamplingParams and an ASK's upstream body take and refuse the same
values at their edges."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from zmqllm.bus.ask_body import AskBodyError, upstream_body
from zmqllm.bus.messages import AskKind
from zmqllm.bus.sampling_params import MAX_PENALTY, MAX_SEED, MAX_STOPS, SamplingParams
from zmqllm.gateway.schemas import ChatCompletionRequest

HI = [{"role": "user", "content": "hi"}]


def _gateway_takes(**fields: Any) -> bool:
    try:
        ChatCompletionRequest.model_validate({"messages": HI, **fields})
    except ValidationError:
        return False
    return True


def _ask_takes(**fields: Any) -> bool:
    try:
        upstream_body(AskKind.CHAT, {"messages": HI, **fields}, 8)
    except AskBodyError:
        return False
    return True


def _sampler_takes(**fields: Any) -> bool:
    try:
        SamplingParams(**fields).validate()
    except ValueError:
        return False
    return True


@pytest.mark.parametrize(("count", "ok"), [(1, True), (MAX_STOPS, True), (MAX_STOPS + 1, False)])
def test_stop_strings(count: int, ok: bool) -> None:
    stops = [f"s{i}" for i in range(count)]
    assert _gateway_takes(stop=stops) is ok
    assert _ask_takes(stop=stops) is ok


@pytest.mark.parametrize("name", ["presence_penalty", "frequency_penalty"])
@pytest.mark.parametrize(
    ("value", "ok"),
    [(-MAX_PENALTY, True), (MAX_PENALTY, True), (MAX_PENALTY + 0.5, False), (-3.0, False)],
)
def test_penalties(name: str, value: float, ok: bool) -> None:
    assert _sampler_takes(**{name: value}) is ok
    assert _ask_takes(**{name: value}) is ok


@pytest.mark.parametrize(("seed", "ok"), [(0, True), (MAX_SEED, True), (MAX_SEED + 1, False)])
def test_seed(seed: int, ok: bool) -> None:
    assert _sampler_takes(seed=seed) is ok
    assert _ask_takes(seed=seed) is ok
