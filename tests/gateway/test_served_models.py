"""Which model a gateway request means: its own model, the broker's remote models, the
default, 404 for a name nobody serves and 503 for a remote model whose workers just left."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from zmqllm.config.paths import checked_model_name
from zmqllm.config.settings import ConfigError
from zmqllm.gateway.errors import APIError
from zmqllm.gateway.served_models import ModelDirectory, ServedModel, complete_route

OWN = ServedModel("tiny", False, 1024, 0)


def entry(name: str, *, text: bool = False, complete: bool = True) -> dict[str, Any]:
    return {"name": name, "text_model": text, "complete_route": complete, "context": 9}


def status(*models: dict[str, Any]) -> dict[str, Any]:
    return {"models": list(models)}


def find(d: ModelDirectory, name: str | None) -> ServedModel:
    return asyncio.run(d.find(name))


def refused(d: ModelDirectory, name: str | None) -> APIError:
    with pytest.raises(APIError) as info:
        find(d, name)
    return info.value


def test_the_own_model_and_the_remote_ones_by_name() -> None:
    d = ModelDirectory(OWN)
    d.update(
        status(entry("tiny"), entry("api", text=True), entry("half", text=True, complete=False))
    )
    assert find(d, None) is OWN and find(d, "tiny") is OWN
    assert find(d, "api").text_model and find(d, "api").name == "api"
    assert [m.name for m in d.listed()] == ["tiny", "api"]  # no worker yet: not listed
    err = refused(d, "half")
    assert (err.status, err.code) == (404, "model_not_found") and "'tiny', 'api'" in err.message


def test_the_default_without_a_model_of_its_own() -> None:
    d = ModelDirectory(None)
    err = refused(d, None)
    assert err.status == 503  # nothing registered yet
    d.update(status(entry("api", text=True)))
    assert find(d, None).name == "api"
    d.update(status(entry("api", text=True), entry("other", text=True)))
    err = refused(d, None)
    assert err.status == 400 and "name one" in err.message


def test_a_configured_default_and_a_fetch_for_a_name_not_seen_yet() -> None:
    calls = []

    async def fetch() -> dict[str, Any]:
        calls.append(1)
        return status(entry("late", text=True))

    d = ModelDirectory(OWN, default="late", fetch_status=fetch)
    assert find(d, None).name == "late" and calls == [1]
    # A second unknown name within REFRESH_MIN_S does not ask the broker again.
    assert refused(d, "nope").status == 404 and calls == [1]


def test_a_remote_model_whose_workers_left_is_503_for_a_while() -> None:
    d = ModelDirectory(None)
    d.update(status(entry("api", text=True)))
    d.update(status())
    err = refused(d, "api")
    assert err.status == 503 and err.headers and "Retry-After" in err.headers
    d.gone["api"] -= 3600  # long gone
    d.update(status())
    assert refused(d, "api").status == 404


def test_the_own_model_follows_the_name_its_workers_use() -> None:
    d = ModelDirectory(OWN)
    d.update(status(entry("org/Tiny-Model"), entry("api", text=True)))
    assert d.route_name == "org/Tiny-Model"  # the only model of layers
    d.update(status(entry("tiny"), entry("other")))
    assert d.route_name == "tiny"
    d.update(status(entry("a"), entry("b")))
    assert d.route_name == "tiny"  # several others: no guessing


def test_complete_route_per_model_and_from_a_broker_of_one_model() -> None:
    st = status(entry("tiny", complete=False), entry("api", text=True))
    assert not complete_route(st, "tiny") and complete_route(st, "api")
    assert complete_route({"complete_route": True}, "anything")


@pytest.mark.parametrize("name", ["", "My Model", "é", "x" * 256, "tab\there"])
def test_a_model_name_the_bus_cannot_carry_is_a_config_error(name: str) -> None:
    with pytest.raises(ConfigError, match="--model-name"):
        checked_model_name(name)
    assert checked_model_name("mistralai/Mistral-7B-v0.3") == "mistralai/Mistral-7B-v0.3"
