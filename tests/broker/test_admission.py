"""A REGISTER's admission (broker/admission.py) without sockets: a registry, a key's
claims, and the verdict on each REGISTER."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.broker.test_registry import VERSION, add, register
from zmqllm.broker.admission import OUT_OF_SCOPE, Admission, may_define, scope_refusal
from zmqllm.broker.registry import Registry, RegistryError
from zmqllm.bus.messages import Refused

KEY = "k" * 40  # a worker's CURVE public key, as the broker sees it (z85)
PINS = {"model": "m", "layers": "0:2", "digest": "d1", "num_layers": "4", "kind": "layers"}


def admission(**kw: int) -> Admission:
    return Admission(Registry(), VERSION, **kw)


def test_a_register_naming_no_model_is_refused_never_a_model_named_empty() -> None:
    """`served: ""` once became a second model named "", after which every OPEN naming no
    model was ambiguous; it is a bad registration, whatever else is served."""
    a = admission()
    verdict = a.check(b"w-empty", register(0, 4, served=""))
    assert "names no model" in verdict.refused
    assert isinstance(verdict.reply, Refused)
    add(a.registry, "w0", 0, 4)  # model "m"
    assert "names no model" in a.check(b"w-empty", register(0, 4, served="")).refused
    with pytest.raises(RegistryError, match="names no model"):
        a.registry.add(b"w-empty", register(0, 4, served=""))
    assert list(a.registry.models) == ["m"] and a.registry.num_layers == 4


def test_a_scoped_key_without_pins_waits_for_its_model_to_be_defined() -> None:
    a = admission()
    claims = {"model": "m", "layers": "0:2"}
    for reg in (
        register(0, 2, num_layers=2),  # a one-hop model of its own layers
        register(0, 1, num_layers=1, digest="r", text_model=True),  # a remote text model
        register(0, 2),
    ):
        verdict = a.check(b"scoped", reg, KEY, claims)
        assert verdict.waits and not verdict.refused and verdict.reply is None
        assert "may not define" in verdict.waits
    add(a.registry, "honest", 0, 4)  # an unscoped key's worker defines m: 4 layers
    assert a.check(b"scoped", register(0, 2), KEY, claims).admitted
    # The model is defined now: a REGISTER that disagrees is the registry's refusal.
    assert (
        "the cluster's has 4"
        in a.check(b"scoped", register(0, 2, num_layers=2), KEY, claims).refused
    )


def test_the_last_worker_of_a_model_registering_again_still_defines_it() -> None:
    """A scoped worker that is its model's only one (the definer left) re-registering
    would define the model afresh: it waits too."""
    a = admission()
    add(a.registry, "definer", 2, 4)
    a.registry.add(b"scoped", register(0, 2), key=KEY)
    a.registry.remove(a.registry.workers["definer"])
    assert a.check(b"scoped", register(0, 2), KEY, {"model": "m"}).waits
    assert a.check(b"scoped", register(0, 2), KEY, PINS).admitted


def test_pins_hold_a_register_to_the_model_as_issued() -> None:
    a = admission()
    assert a.check(b"pinned", register(0, 2), KEY, PINS).admitted  # it may define m
    wrong = {
        "digest": register(0, 2, digest="d2"),
        "num_layers": register(0, 2, num_layers=2),
        "kind": register(0, 1, num_layers=1, digest="d1", text_model=True),
        "layers": register(0, 4),
        "model": register(0, 2, served="other"),
    }
    for claim, reg in wrong.items():
        refused = a.check(b"pinned", reg, KEY, PINS).refused
        assert refused.startswith(f"{OUT_OF_SCOPE}: "), claim
        assert "d1" not in refused, claim  # the pinned digest is never told
    assert "issued for a model of 4 layers, not 2" in scope_refusal(PINS, wrong["num_layers"])  # type: ignore[operator]
    assert "a model of layers, not a remote" in scope_refusal(PINS, wrong["kind"])  # type: ignore[operator]


def test_the_scope_is_checked_before_the_registry_names_the_served_digest() -> None:
    """With the model defined, a wrong digest from a pinned key is refused as out of
    scope, not with the registry's "digest d2 != d1" (which would tell the pin)."""
    a = admission()
    add(a.registry, "w0", 2, 4, summary={})
    refused = a.check(b"pinned", register(0, 2, digest="d2", summary={}), KEY, PINS).refused
    assert refused.startswith(OUT_OF_SCOPE) and "d1" not in refused


def test_what_a_key_must_pin_to_define_a_model() -> None:
    assert may_define({})  # an unscoped key (or no keys at all)
    assert may_define(PINS)
    for claim in ("model", "digest", "num_layers", "kind"):
        assert not may_define({k: v for k, v in PINS.items() if k != claim})
    assert not may_define({"model": "m", "layers": "0:2"})


def test_an_unreadable_pin_refuses_every_register() -> None:
    """A key file edited by hand: a pin the broker cannot read holds nothing true."""
    for bad in ("four", "", "04x"):
        assert scope_refusal({**PINS, "num_layers": bad}, register(0, 2)) is not None
    assert scope_refusal({**PINS, "kind": "odd"}, register(0, 2)) is not None


def test_a_key_holds_at_most_its_share_of_registrations() -> None:
    a = admission(max_key_workers=2)
    for wid in ("a", "b"):
        assert a.check(wid.encode(), register(0, 4), KEY).admitted
        a.registry.add(wid.encode(), register(0, 4), key=KEY)
    assert "holds 2 registrations" in a.check(b"c", register(0, 4), KEY).refused
    assert a.check(b"a", register(0, 4), KEY).admitted  # registering again: not one more
    assert a.check(b"c", register(0, 4), "o" * 40).admitted  # another key
    assert a.check(b"c", register(0, 4), "").admitted  # no keys: max_workers bounds it
    a.registry.remove(a.registry.workers["b"])
    assert a.check(b"c", register(0, 4), KEY).admitted
    with pytest.raises(ValueError):
        admission(max_key_workers=0)


def test_the_registry_keeps_the_key_each_worker_registered_with() -> None:
    reg = Registry()
    w = reg.add(b"a", register(0, 4), key=KEY)
    assert w.key == KEY and reg.models["m"].describe()["digest"] == "d1"
    assert reg.defines(register(0, 4), b"a")  # its own replacement would define m again
    assert not reg.defines(register(0, 4), b"b")
    assert reg.defines(replace(register(0, 4), served="other"), b"b")
