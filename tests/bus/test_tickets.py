"""Tickets without sockets: the line's format and the checks its reader makes, and what
issuing, revoking and storing one leave in key folders (bus/tickets.py, ticket_keys.py)."""

from __future__ import annotations

import dataclasses
import stat
import time
from pathlib import Path

import pytest
import zmq
import zmq.auth

from zmqllm.bus.keys import KeysError, add_key, allowed_keys, init_keys, key_claims, load_peer_keys
from zmqllm.bus.ticket_keys import (
    issue_ticket,
    record_use,
    revoke_key,
    revoked_keys,
    store_ticket,
    ticket_keys,
    used_keys,
)
from zmqllm.bus.tickets import (
    Ticket,
    TicketError,
    decode_ticket,
    encode_ticket,
    parse_lifetime,
)

ENDPOINT = "tcp://broker.example:5556"


def made(role: str = "worker", **changes: object) -> Ticket:
    public, secret = zmq.curve_keypair()
    server, _ = zmq.curve_keypair()
    t = Ticket(
        role=role,  # type: ignore[arg-type]
        name="gpu-2",
        endpoint=ENDPOINT,
        server=server,
        public=public,
        secret=secret,
        expires=2_000_000_000,
        model="default",
        layers="16:32" if role == "worker" else "",
    )
    return dataclasses.replace(t, **changes)  # type: ignore[arg-type]


def refused(text: str) -> TicketError:
    with pytest.raises(TicketError) as caught:
        decode_ticket(text)
    return caught.value


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize("role", ["worker", "client"])
def test_a_ticket_reads_back_as_made(role: str) -> None:
    t = made(role)
    line = encode_ticket(t)
    assert line.startswith("zmqllm-ticket-1.") and "\n" not in line and " " not in line
    assert decode_ticket(line) == t
    # Wrapped by a mail program, or pasted with the newline: still the same ticket.
    wrapped = "\n".join(line[i : i + 60] for i in range(0, len(line), 60))
    assert decode_ticket(f"  {wrapped}\n") == t


def test_the_secret_is_never_shown() -> None:
    t = made()
    assert t.secret.decode() not in repr(t)
    line = encode_ticket(t)
    for cut in (line[:-3], line[: len(line) // 2], line.replace("eyJ", "eyK", 1)):
        assert t.secret.decode() not in str(refused(cut))


def test_a_truncated_ticket_says_so() -> None:
    line = encode_ticket(made())
    for cut in (line[:-1], line[:-11], line[: len(line) // 2], "zmqllm-ticket-1"):
        assert refused(cut).kind == "truncated", cut[-20:]


def test_an_altered_ticket_says_so() -> None:
    line = encode_ticket(made())
    head, body, check = line.split(".")
    # One character of the body changed, or the checksum; a part of the body lost.
    flipped = body[:40] + ("A" if body[40] != "A" else "B") + body[41:]
    for bad in (
        f"{head}.{flipped}.{check}",
        f"{head}.{body}.{check[:-1]}{'A' if check[-1] != 'A' else 'B'}",
        f"{head}.{body[:30]}{body[40:]}.{check}",
        f"{head}.{body}.{check}x",
    ):
        err = refused(bad)
        assert err.kind == "altered" and "checksum" in str(err)


def test_a_key_pair_that_is_not_one_pair_is_altered_even_with_a_good_checksum() -> None:
    other_public, _ = zmq.curve_keypair()
    err = refused(encode_ticket(made(public=other_public)))
    assert err.kind == "altered" and "one pair" in str(err)


def test_not_a_ticket_and_another_version() -> None:
    assert refused("").kind == "empty"
    assert refused("hello world").kind == "malformed"
    assert refused("x" * 5000).kind == "malformed"
    line = encode_ticket(made())
    err = refused(line.replace("zmqllm-ticket-1.", "zmqllm-ticket-2.", 1))
    assert err.kind == "version" and "version 2" in str(err)


def test_fields_a_ticket_cannot_hold_are_refused() -> None:
    assert refused(encode_ticket(made(endpoint="ipc:///tmp/x"))).kind == "malformed"
    assert refused(encode_ticket(made(name="a/b"))).kind == "malformed"
    assert refused(encode_ticket(made(model="my model"))).kind == "malformed"


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("24h", 86400), ("30m", 1800), ("7d", 604800), ("90", 90), ("2w", 1209600)],
)
def test_lifetimes(text: str, seconds: int) -> None:
    assert parse_lifetime(text) == seconds


@pytest.mark.parametrize("text", ["", "0", "-1h", "1y", "h", "400d"])
def test_lifetimes_refused(text: str) -> None:
    with pytest.raises(KeysError, match="--expires"):
        parse_lifetime(text)


def test_issuing_allows_a_scoped_key_and_keeps_no_secret(tmp_path: Path) -> None:
    folder = init_keys(tmp_path / "keys")
    before = time.time()
    t = issue_ticket(
        folder,
        "worker",
        "gpu-2",
        ENDPOINT,
        3600,
        model="default",
        layers="16:32",
        claims={"model": "smollm2-135m-instruct", "layers": "16:32"},
    )
    assert decode_ticket(encode_ticket(t)) == t
    assert t.server == load_peer_keys(folder, "worker").server  # the broker's key
    assert before + 3600 - 1 <= t.expires <= time.time() + 3600
    assert t.public in allowed_keys(folder / "workers")
    assert key_claims(folder / "workers" / "gpu-2.key") == {
        "model": "smollm2-135m-instruct",
        "layers": "16:32",
        "expires": str(t.expires),
    }
    assert ticket_keys(folder / "workers")[t.public].expires == t.expires
    # The ticket is the secret's only copy: nothing on the broker's host holds it.
    assert not (folder / "issued" / "gpu-2").exists()
    for path in folder.rglob("*"):
        if path.is_file():
            assert t.secret not in path.read_bytes(), path
    client = issue_ticket(folder, "client", "app", "tcp://broker.example:5555", 60)
    assert client.public in allowed_keys(folder / "clients")


def test_a_ticket_name_is_used_once(tmp_path: Path) -> None:
    folder = init_keys(tmp_path / "keys")
    issue_ticket(folder, "worker", "w2", ENDPOINT, 60)
    for role in ("worker", "client"):
        with pytest.raises(KeysError, match="already exists"):
            issue_ticket(folder, role, "w2", ENDPOINT, 60)  # type: ignore[arg-type]
    revoke_key(folder, "w2")
    with pytest.raises(KeysError, match="already exists"):
        issue_ticket(folder, "worker", "w2", ENDPOINT, 60)
    with pytest.raises(KeysError, match="already exists"):
        add_key(folder, "worker", "w2")


def test_a_ticket_that_would_not_read_back_is_not_issued(tmp_path: Path) -> None:
    folder = init_keys(tmp_path / "keys")
    with pytest.raises(KeysError, match="cannot make this ticket"):
        issue_ticket(folder, "worker", "w2", ENDPOINT, 60, model="a model with spaces")
    assert list((folder / "workers").glob("w2*")) == []


def test_revoking_moves_the_key_aside(tmp_path: Path) -> None:
    folder = init_keys(tmp_path / "keys")
    t = issue_ticket(folder, "worker", "gpu-2", ENDPOINT, 60)
    add_key(folder, "worker", "plain")
    assert revoke_key(folder, "gpu-2") == ["worker"]
    assert t.public not in allowed_keys(folder / "workers")
    assert revoked_keys(folder / "revoked" / "workers") == {t.public: "gpu-2"}
    assert revoke_key(folder, "plain") == ["worker"]  # a `keys add` key too
    assert not (folder / "issued" / "plain").exists()
    with pytest.raises(KeysError, match="revoked already"):
        revoke_key(folder, "gpu-2")
    with pytest.raises(KeysError, match="no key named"):
        revoke_key(folder, "nobody")


def test_uses_are_recorded_by_key(tmp_path: Path) -> None:
    public, _ = zmq.curve_keypair()
    assert used_keys(tmp_path / "used") == frozenset()
    assert record_use(tmp_path / "used", public, time.time())
    (tmp_path / "used" / "junk").write_text("x")
    assert used_keys(tmp_path / "used") == {public}
    # A folder that cannot be made (a file in its place): told, not raised.
    (tmp_path / "blocked").write_text("")
    assert not record_use(tmp_path / "blocked", public, time.time())


def test_a_stored_ticket_is_a_private_key_folder(tmp_path: Path) -> None:
    t = made()
    folder = store_ticket(t, tmp_path / "home")
    assert folder == tmp_path / "home" / "tickets" / "gpu-2"
    keys = load_peer_keys(folder, "worker")  # what --keys reads
    assert (keys.public, keys.secret, keys.server) == (t.public, t.secret, t.server)
    assert mode(folder) == 0o700 and mode(folder.parent) == 0o700
    assert mode(folder / "worker.key_secret") == 0o600
    assert zmq.auth.load_certificate(folder / "worker.key")[1] is None
    app = made("client", name="app")
    client = store_ticket(app, tmp_path / "home")
    assert load_peer_keys(client, "client").secret == app.secret
    assert mode(client / "client.key_secret") == 0o600


# -- the commands: `zmqllm ticket`, `zmqllm keys list|revoke` -------------------------------


@pytest.fixture
def captured(
    capsys: pytest.CaptureFixture[str], restore_logging: None
) -> pytest.CaptureFixture[str]:
    """What the commands print; `zmqllm ticket` sets up logging on the captured stderr,
    so that is put back afterwards."""
    return capsys


def cli(captured: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    from zmqllm.cli import main

    code = main(list(args))
    out, err = captured.readouterr()
    return code, out, err


def test_ticket_prints_one_line_and_says_what_it_is_for(
    tmp_path: Path, captured: pytest.CaptureFixture[str]
) -> None:
    folder = init_keys(tmp_path / "keys")
    flags = ["--keys", str(folder), "--frontend", "tcp://127.0.0.1:1", "--timeout", "0.2"]
    code, out, err = cli(captured, "ticket", *flags, "--model", "tiny", "--layers", "0:2")
    assert code == 0, err
    (line,) = out.splitlines()
    t = decode_ticket(line)
    assert (t.role, t.model, t.layers, t.endpoint) == (
        "worker",
        "tiny",
        "0:2",
        "tcp://127.0.0.1:5556",
    )
    assert t.name.startswith("ticket-") and t.secret.decode() not in err
    assert "only this machine can use this ticket" in err  # the default backend: loopback
    assert "serves no tiny now" in err  # no broker answered: no pins
    assert key_claims(folder / "workers" / f"{t.name}.key") == {
        "model": "tiny",
        "layers": "0:2",
        "expires": str(t.expires),
    }
    code, out, err = cli(
        captured, "ticket", *flags, "--client", "--name", "app", "--address", "broker.example"
    )
    assert code == 0, err
    assert decode_ticket(out).endpoint == "tcp://broker.example:1"
    assert "only this machine" not in err


def test_ticket_refusals(
    tmp_path: Path, captured: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ZMQLLM_HOME", str(tmp_path / "home"))
    code, out, err = cli(captured, "ticket", "--layers", "0:2")
    assert code == 2 and out == "" and "has no CURVE keys" in err
    folder = init_keys(tmp_path / "keys")
    flags = ["--keys", str(folder), "--frontend", "tcp://127.0.0.1:1", "--timeout", "0.2"]
    code, out, err = cli(captured, "ticket", *flags)  # --layers auto, and no broker answers
    assert code == 2 and out == "" and "give --layers A:B" in err
    for bad in (["--layers", "two"], ["--expires", "soon"], ["--backend", "ipc:///tmp/b"]):
        code, out, err = cli(captured, "ticket", *flags, "--layers", "0:2", *bad)
        assert code == 2 and out == "", bad
    assert allowed_keys(folder / "workers") == {load_peer_keys(folder, "worker").public}


def test_keys_list_and_revoke(tmp_path: Path, captured: pytest.CaptureFixture[str]) -> None:
    folder = init_keys(tmp_path / "keys")
    used = issue_ticket(folder, "worker", "gpu-2", ENDPOINT, 60)
    record_use(folder / "used", used.public, time.time())
    issue_ticket(folder, "worker", "gpu-3", ENDPOINT, 60)
    add_key(folder, "client", "app")
    code, out, _ = cli(captured, "keys", "list", "--keys", str(folder))
    assert code == 0
    assert "gpu-2 (ticket, used)" in out and "gpu-3 (ticket, to be used by " in out
    assert "clients allowed (2): app, client" in out
    code, out, _ = cli(captured, "keys", "revoke", "gpu-2", "--keys", str(folder))
    assert code == 0 and "revoked the worker key 'gpu-2'" in out
    code, out, _ = cli(captured, "keys", "list", "--keys", str(folder))
    assert "workers revoked (1): gpu-2" in out
    code, _, err = cli(captured, "keys", "revoke", "gpu-2", "--keys", str(folder))
    assert code == 2 and "revoked already" in err


def test_auto_layers_and_pins_from_a_status() -> None:
    from zmqllm.client.ticket_cli import choose_layers, model_pins, reachable

    model = {"name": "m", "text_model": False, "digest": "d1", "num_layers": 4, "uncovered": ""}
    workers = [{"model": "m", "layers": [0, 2]}, {"model": "m", "layers": [0, 2]}]
    workers += [{"model": "m", "layers": [2, 4]}, {"model": "other", "layers": [2, 4]}]
    status = {"models": [model], "workers": workers}
    assert choose_layers(status, "m") == "2:4"  # the least served range
    assert choose_layers({**status, "models": [{**model, "uncovered": "1:2, 3:4"}]}, "m") == "1:2"
    assert choose_layers(status, "unknown") == ":"
    assert model_pins(status, "m") == {"digest": "d1", "num_layers": "4", "kind": "layers"}
    assert model_pins(status, "unknown") == {}
    assert reachable("tcp://127.0.0.1:5556")[1]  # loopback: a note
    assert reachable("tcp://*:5556", "198.18.0.7") == ("tcp://198.18.0.7:5556", "")
    assert reachable("tcp://*:5556", "fd00::7")[0] == "tcp://[fd00::7]:5556"
