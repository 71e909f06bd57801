"""Issue 40, item 15: a failover replay goes only onto a route of the build its stream
started on. The broker's cores without sockets: build keys (route_build.py), the
registry's route search held to a build, the session table's first TOKEN and replays.

No torch here: the broker runs without the ML stack.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from zmqllm.broker.registry import Registry, WorkerEntry
from zmqllm.broker.route_build import RouteBuild, build_key, route_build
from zmqllm.broker.session_records import Out
from zmqllm.broker.session_table import SessionTable
from zmqllm.bus.messages import Error, ErrorCode, Open, Register, Token
from zmqllm.bus.protocol import decode, encode
from zmqllm.bus.wire_types import Payload, ProtocolError
from zmqllm.version import __version__

A, B = b"client-a", b"client-b"
# What worker/build_info.py reports, less what varies by machine.
BUILD: dict[str, Any] = {
    "zmqllm": __version__,
    "protocol": 3,
    "python": "3.11.9",
    "torch": "2.5.1+cpu",
    "numpy": "2.1.0",
    "kernel": "k1",
    "cpu": "avx2 fma avx512f",
    "capability": "AVX512",
    "quant": "none",
    "dtype": "float32",
    "wire_dtype": "auto",
    "device": "cpu",
}


def key(last_stage: bool = False, **changed: Any) -> str:
    return build_key({**BUILD, **changed}, last_stage=last_stage)


# -- build keys --------------------------------------------------------------------------


def test_a_build_key_is_short_and_the_same_for_the_same_build() -> None:
    k = key()
    assert len(k) == 12 and int(k, 16) >= 0
    assert key() == k
    # Nothing that leaves the numbers alone moves it.
    assert key(python="3.12.1", numpy="1.26.4", protocol=4) == k


@pytest.mark.parametrize(
    "field, value",
    [
        ("torch", "2.6.0+cpu"),
        ("zmqllm", "9.9.9"),
        ("kernel", "none"),
        ("capability", "AVX2"),
        ("cpu", "avx2 fma"),
        ("quant", "int8"),
        ("dtype", "bfloat16"),
        ("wire_dtype", "bfloat16"),
        ("device", "cuda"),
    ],
)
def test_each_field_that_decides_the_numbers_moves_the_key(field: str, value: str) -> None:
    assert key(**{field: value}) != key()


def test_like_values_are_one_build_and_unlike_types_are_not() -> None:
    # "auto" sends activations in the model's dtype: the same as naming it.
    assert key(wire_dtype="float32") == key(wire_dtype="auto") != key(wire_dtype="float16")
    # The last stage sends tokens, no activations: its wire dtype decides nothing.
    assert key(True, wire_dtype="bfloat16") == key(True)
    # Which GPU of a host does not matter; on a GPU, the host's CPU features do not.
    gpu = {"device": "cuda:0", "capability": "cuda sm_90, H100"}
    assert key(**gpu) == key(**{**gpu, "device": "cuda:1", "cpu": "avx2"})
    assert build_key({"dtype": 2}, last_stage=True) != build_key({"dtype": "2"}, last_stage=True)
    assert build_key({}, last_stage=True) != build_key({"torch": ""}, last_stage=True)


def test_a_route_build_chains_from_layer_0() -> None:
    hops = ("0:2:0123456789ab", "2:4:ba9876543210")
    b = RouteBuild.parse(hops)
    assert b.end == 4 and b.keys == {(0, 2): "0123456789ab", (2, 4): "ba9876543210"}
    assert b.describe() == "0:2:0123456789ab 2:4:ba9876543210"
    for bad in [(), ("1:2:0123456789ab",), ("0:2:0123456789ab", "3:4:0123456789ab")]:
        with pytest.raises(ValueError):
            RouteBuild.parse(bad)


def test_a_route_build_travels_on_token_and_open() -> None:
    hops = ("0:2:0123456789ab", "2:4:ba9876543210")
    token = Token(session="s", token=1, route=("w0", "w1"), boot="b", build=hops)
    assert decode(encode(token)).build == hops  # type: ignore[attr-defined]
    opened = decode(encode(open_msg(build=hops)))
    assert isinstance(opened, Open) and opened.build == hops
    assert decode(encode(open_msg())).build == ()  # (): any route
    head, payloads = open_msg().to_wire()
    with pytest.raises(ProtocolError):  # the wire bounds each hop's length
        Open.from_wire({**head, "build": ["1000:1024:" + "0" * 13]}, payloads)


# -- the registry ------------------------------------------------------------------------


def register(reg: Registry, wid: str, start: int, end: int, **build: Any) -> WorkerEntry:
    msg = Register(
        start=start,
        end=end,
        num_layers=4,
        capacity=4,
        max_kv_tokens=1000,
        context=512,
        version=__version__,
        fingerprint="d1",
        served="m",
        build={**BUILD, **build},
    )
    return reg.add(wid.encode(), msg)


def test_workers_carry_their_build_key_and_status_shows_it() -> None:
    reg = Registry()
    w = register(reg, "w0", 0, 2)
    last = register(reg, "w1", 2, 4, wire_dtype="bfloat16")
    assert w.build_key == key() and last.build_key == key(True)
    assert w.describe(0.0)["build_key"] == w.build_key


def test_a_route_search_held_to_a_build_takes_only_its_workers() -> None:
    reg = Registry()
    register(reg, "w0", 0, 2)
    register(reg, "w1", 2, 4)
    odd = register(reg, "w2", 2, 4, torch="2.6.0+cpu")
    ours = reg.find_route(10)
    assert ours is not None and [w.worker_id for w in ours] == ["w0", "w1"]
    held = RouteBuild.parse(route_build(ours))
    reg.remove(reg.workers["w1"])
    # Free, the odd replica would serve; held to the build, no route is left.
    assert [w.worker_id for w in reg.find_route(10) or []] == ["w0", "w2"]
    assert reg.find_route(10, admit=held.admits) is None
    assert RouteBuild.parse(route_build([reg.workers["w0"], odd])).admits(odd)


# -- the session table -------------------------------------------------------------------


def open_msg(session: str = "s1", build: tuple[str, ...] = ()) -> Open:
    return Open(
        session=session,
        request_id="r1",
        max_tokens=5,
        prompt_len=3,
        tokens=Payload(np.arange(3, dtype=np.int32), "int32"),
        build=build,
    )


def opened_on(outs: list[Out]) -> list[bytes]:
    """The workers an OPEN went to (stage order)."""
    return sorted(o.identity for o in outs if isinstance(o.msg, Open))


def first_token(t: SessionTable, outs: list[Out], last: str) -> Token:
    wire = next(o.msg.session for o in outs if isinstance(o.msg, Open))
    w = t.registry.workers[last]
    sent = t.on_token(w, Token(session=wire, attempt=1, step=0, token=7), 0.0)
    (token,) = [o.msg for o in sent if o.identity == A]
    assert isinstance(token, Token)
    return token


def cluster(**odd_build: Any) -> SessionTable:
    """w0 for 0:2; w1 and w2 for 2:4, w2 of ``odd_build``."""
    reg = Registry()
    register(reg, "w0", 0, 2)
    register(reg, "w1", 2, 4)
    register(reg, "w2", 2, 4, **odd_build)
    return SessionTable(reg, "boot1", queue_timeout=5.0)


def test_the_first_token_says_the_routes_build_and_later_ones_do_not() -> None:
    t = cluster()
    outs = t.open(A, open_msg(), 0.0)
    token = first_token(t, outs, "w1")
    w0, w1 = t.registry.workers["w0"], t.registry.workers["w1"]
    assert token.build == (f"0:2:{w0.build_key}", f"2:4:{w1.build_key}")
    wire = next(o.msg.session for o in outs if isinstance(o.msg, Open))
    later = t.on_token(w1, Token(session=wire, attempt=1, step=1, token=8), 0.0)
    assert [o.msg.build for o in later if o.identity == A] == [None]  # type: ignore[union-attr]
    # Stages are not told (the field is the client's question to the broker).
    assert all(o.msg.build == () for o in outs if isinstance(o.msg, Open))


def test_a_replay_goes_only_onto_a_replica_of_its_build() -> None:
    t = cluster(wire_dtype="bfloat16", device="cuda:0")  # w2: another build
    build = first_token(t, t.open(A, open_msg("s1"), 0.0), "w1").build
    assert build is not None
    t.registry.remove(t.registry.workers["w1"])
    t.worker_lost("w1", "gone", 0.0)
    # Another build has room, but the replay waits; a new request is not held back by it.
    assert opened_on(t.open(A, open_msg("s1-1", build), 1.0)) == []
    assert opened_on(t.open(B, open_msg("s2"), 1.0)) == [b"w0", b"w2"]
    # A replica of its build comes back: the replay goes there.
    register(t.registry, "w3", 2, 4)
    assert opened_on(t.dispatch(2.0)) == [b"w0", b"w3"]


def test_a_replica_of_the_same_build_continues_the_replay_at_once() -> None:
    t = cluster()
    build = first_token(t, t.open(A, open_msg("s1"), 0.0), "w1").build
    t.registry.remove(t.registry.workers["w1"])
    t.worker_lost("w1", "gone", 0.0)
    assert opened_on(t.open(A, open_msg("s1-1", build), 1.0)) == [b"w0", b"w2"]


def test_a_replay_with_no_route_of_its_build_fails_naming_it() -> None:
    t = cluster(torch="2.6.0+cpu")
    outs = t.open(A, open_msg("s1"), 0.0)
    build = first_token(t, outs, "w1").build
    assert build is not None
    t.registry.remove(t.registry.workers["w1"])
    t.worker_lost("w1", "gone", 0.0)
    t.open(A, open_msg("s1-1", build), 1.0)
    assert t.tick(3.0, "no route") == []  # still waiting
    (out,) = [o for o in t.tick(7.0, "no route") if o.identity == A]
    assert isinstance(out.msg, Error) and out.msg.code is ErrorCode.NO_CAPACITY
    assert "no route of the stream's build" in out.msg.message
    assert " ".join(build) in out.msg.message and not t.queue


@pytest.mark.parametrize(
    "build, why",
    [
        (("0:2:0123456789ab",), "ends at layer 2"),
        (("0:2:0123456789ab", "3:4:0123456789ab"), "does not go on from layer 2"),
        (("0:4:0123456789AB",), "is not START:END:KEY"),
        (("0:4:01234",), "is not START:END:KEY"),
        (("a:b:0123456789ab",), "is not START:END:KEY"),
    ],
)
def test_a_route_build_that_cannot_be_the_models_is_a_bad_request(
    build: tuple[str, ...], why: str
) -> None:
    t = cluster()
    (out,) = t.open(A, open_msg("s1", build), 0.0)
    assert isinstance(out.msg, Error) and out.msg.code is ErrorCode.BAD_REQUEST
    assert why in out.msg.message and not t.queue
