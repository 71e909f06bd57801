"""Discovery's format and choice (bus/discovery.py), without the network: an announcement
is checked field by field, only one with the broker key the worker holds is used, one
already serving its model first. The multicast itself crosses test hosts in
tests/e2e/test_discovery.py."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest
import zmq

from zmqllm.bus.discovery import (
    MAX_TXT_VALUE,
    Announcement,
    DiscoveryError,
    choose,
    discovered_config,
    parse_properties,
    txt_properties,
)
from zmqllm.bus.keys import add_key, init_keys
from zmqllm.config.loading import with_overrides
from zmqllm.config.settings import Config

KEY = zmq.curve_keypair()[0]
OTHER = zmq.curve_keypair()[0]


def raw(props: dict[str, str]) -> dict[bytes, bytes | None]:
    return {k.encode(): v.encode() for k, v in props.items()}


def test_an_announcement_round_trips() -> None:
    props = raw(txt_properties(KEY, ["b", "a", "a"]))
    got = parse_properties("x._zmqllm._tcp.local.", ["198.18.0.1"], 5556, props)
    assert got == Announcement("x._zmqllm._tcp.local.", ("198.18.0.1",), 5556, KEY, ("a", "b"))
    assert got.endpoint() == "tcp://198.18.0.1:5556"


def test_many_models_are_cut_to_one_txt_string() -> None:
    props = txt_properties(KEY, [f"model-{i:03d}" for i in range(100)])
    shown = props["models"].split(",")
    assert len(props["models"]) <= MAX_TXT_VALUE and shown == [f"model-{i:03d}" for i in range(24)]
    assert all(len(f"{k}={v}") <= 255 for k, v in props.items())


@pytest.mark.parametrize(
    "props, addresses, port",
    [
        ({"v": "2", "key": KEY.decode()}, ["198.18.0.1"], 5556),  # another version
        ({"v": "1", "key": "short"}, ["198.18.0.1"], 5556),  # not a z85 key
        ({"v": "1"}, ["198.18.0.1"], 5556),  # no key
        ({"v": "1", "key": KEY.decode()}, ["::1", "224.0.0.251", "0.0.0.0", "x"], 5556),
        ({"v": "1", "key": KEY.decode()}, ["198.18.0.1"], 0),
    ],
)
def test_announcements_this_version_cannot_use_are_dropped(
    props: dict[str, str], addresses: list[str], port: int
) -> None:
    assert parse_properties("x", addresses, port, raw(props)) is None


def test_undecodable_properties_are_dropped_and_bad_models_left_out() -> None:
    assert parse_properties("x", ["198.18.0.1"], 1, {b"key": b"\xff" * 40}) is None
    props = raw({"v": "1", "key": KEY.decode(), "models": "ok,bad name,,also-ok"})
    got = parse_properties("x", ["198.18.0.1"], 1, props)
    assert got is not None and got.models == ("ok", "also-ok")


def test_only_the_held_key_is_used_and_a_broker_serving_the_model_first() -> None:
    a = Announcement("a", ("198.18.0.1",), 1, KEY)
    b = Announcement("b", ("198.18.0.2",), 1, KEY, ("m",))
    liar = Announcement("0-liar", ("198.18.0.3",), 1, OTHER, ("m",))
    assert choose([liar, b, a], KEY) == (a, [liar])  # by name when no model is asked
    assert choose([liar, b, a], KEY, "m") == (b, [liar])
    assert choose([liar], KEY, "m") == (None, [liar])


def test_the_endpoint_prefers_an_address_on_a_local_network() -> None:
    a = Announcement("a", ("198.18.0.3", "198.18.0.200"), 5556, KEY)
    assert a.endpoint([ipaddress.ip_network("198.18.0.128/25")]) == "tcp://198.18.0.200:5556"
    assert a.endpoint([ipaddress.ip_network("198.18.1.0/24")]) == "tcp://198.18.0.3:5556"


def test_discovery_needs_a_broker_key_to_check_against(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ZMQLLM_HOME", str(tmp_path / "home"))
    with pytest.raises(DiscoveryError, match="needs the broker's public key"):
        discovered_config(Config())
    folder = init_keys(tmp_path / "keys")
    issued = add_key(folder, "worker", "w1")
    seen: list[tuple[bytes, str]] = []

    def found(trusted: bytes, model: str, timeout: float) -> str:
        seen.append((trusted, model))
        assert timeout == 2.5
        return "tcp://198.18.0.1:5556"

    monkeypatch.setattr("zmqllm.bus.discovery.discover_broker", found)
    cfg = with_overrides(Config(), "security", {"keys": str(issued)})
    cfg = with_overrides(cfg, "worker", {"discover_timeout": 2.5})
    got = discovered_config(cfg, "m")
    assert got.worker.broker == "tcp://198.18.0.1:5556"
    broker_public = (folder / "broker.key").read_text()
    assert seen[0][1] == "m" and seen[0][0].decode() in broker_public
