"""Key folders: what `keys init` and `keys add` write, how roles find and load keys."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
import zmq.auth

from zmqllm.bus.keys import (
    KeysError,
    add_key,
    allowed_keys,
    init_keys,
    keys_dir,
    load_broker_keys,
    load_peer_keys,
)
from zmqllm.config.settings import SecuritySettings


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_init_writes_pyzmq_certificates_and_allowed_folders(tmp_path: Path) -> None:
    folder = init_keys(tmp_path / "keys")
    for name in ("broker", "client", "worker"):
        public, secret = zmq.auth.load_certificate(folder / f"{name}.key_secret")
        assert len(public) == 40 and secret is not None and len(secret) == 40
        assert zmq.auth.load_certificate(folder / f"{name}.key")[0] == public
        assert mode(folder / f"{name}.key_secret") == 0o600
    assert mode(folder) == 0o700
    client_public = zmq.auth.load_certificate(folder / "client.key")[0]
    worker_public = zmq.auth.load_certificate(folder / "worker.key")[0]
    assert allowed_keys(folder / "clients") == {client_public}
    assert allowed_keys(folder / "workers") == {worker_public}


def test_init_never_replaces_keys(tmp_path: Path) -> None:
    folder = init_keys(tmp_path / "keys")
    before = (folder / "broker.key_secret").read_bytes()
    with pytest.raises(KeysError, match="already has keys"):
        init_keys(folder)
    assert (folder / "broker.key_secret").read_bytes() == before


def test_add_issues_a_folder_for_another_host(tmp_path: Path) -> None:
    folder = init_keys(tmp_path / "keys")
    issued = add_key(folder, "worker", "gpu-host-2")
    assert issued == folder / "issued" / "gpu-host-2"
    keys = load_peer_keys(issued, "worker")  # the folder works as that host's --keys
    assert keys.server == load_broker_keys(folder).public
    assert keys.public in allowed_keys(folder / "workers")
    assert keys.public not in allowed_keys(folder / "clients")
    client = load_peer_keys(add_key(folder, "client", "app"), "client")
    assert client.public in allowed_keys(folder / "clients")


@pytest.mark.parametrize("name", ["", "a/b", "..", "x" * 65, "sp ace"])
def test_add_refuses_bad_names(tmp_path: Path, name: str) -> None:
    folder = init_keys(tmp_path / "keys")
    with pytest.raises(KeysError, match="key name"):
        add_key(folder, "worker", name)


def test_add_refuses_a_taken_name_and_a_folder_without_keys(tmp_path: Path) -> None:
    folder = init_keys(tmp_path / "keys")
    add_key(folder, "worker", "w2")
    with pytest.raises(KeysError, match="already exists"):
        add_key(folder, "worker", "w2")
    with pytest.raises(KeysError, match="keys init"):
        add_key(tmp_path / "empty", "worker", "w3")


def test_allowed_keys_skips_files_without_a_key(tmp_path: Path) -> None:
    folder = init_keys(tmp_path / "keys")
    (folder / "workers" / "junk.key").write_text("not a certificate\n")
    (folder / "workers" / "notes.txt").write_text("ignored\n")
    (folder / "workers" / "broken.key").write_text("curve\n    public-key\n")  # no "="
    assert len(allowed_keys(folder / "workers") or ()) == 1
    assert allowed_keys(tmp_path / "missing") is None  # unreadable: the caller decides


def test_loading_names_the_missing_file(tmp_path: Path) -> None:
    folder = init_keys(tmp_path / "keys")
    (folder / "worker.key_secret").unlink()
    with pytest.raises(KeysError, match=r"worker\.key_secret"):
        load_peer_keys(folder, "worker")
    with pytest.raises(KeysError, match="no secret key"):
        # A public key file where a pair is needed.
        (folder / "broker.key").replace(folder / "broker.key_secret")
        load_broker_keys(folder)


def test_keys_dir_resolution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZMQLLM_HOME", str(tmp_path / "home"))
    assert keys_dir(SecuritySettings()) is None  # nothing anywhere: plaintext
    default = init_keys(tmp_path / "home" / "keys")
    assert keys_dir(SecuritySettings()) == default
    assert keys_dir(SecuritySettings(insecure=True)) is None
    other = init_keys(tmp_path / "other")
    assert keys_dir(SecuritySettings(keys=str(other))) == other
    with pytest.raises(KeysError, match="keys init"):
        keys_dir(SecuritySettings(keys=str(tmp_path / "nope")))


def test_a_worker_key_carries_what_it_was_issued_for(tmp_path: Path) -> None:
    from zmqllm.bus.keys import claim_refusal, folder_claims, key_claims

    folder = init_keys(tmp_path / "keys")
    add_key(folder, "worker", "stage-1", {"model": "mistral-7b", "layers": "0:16"})
    claims = key_claims(folder / "workers" / "stage-1.key")
    assert claims == {"model": "mistral-7b", "layers": "0:16"}
    public, _ = zmq.auth.load_certificate(folder / "workers" / "stage-1.key")
    assert folder_claims(folder / "workers") == {public: claims}  # keys without claims: none
    assert claim_refusal(claims, "mistral-7b", 0, 16) is None
    assert claim_refusal(claims, "mistral-7b", 4, 8) is None  # within the range
    assert "not 0:32" in (claim_refusal(claims, "mistral-7b", 0, 32) or "")
    assert "model 'mistral-7b', not 'other'" in (claim_refusal(claims, "other", 0, 16) or "")
    assert claim_refusal({"layers": "16:"}, "m", 16, 32) is None
    with pytest.raises(KeysError, match="claims only model, layers"):
        add_key(folder, "worker", "odd", {"capacity": "9"})
    with pytest.raises(KeysError, match="characters"):
        add_key(folder, "worker", "odd", {"model": 'a"\nb'})


def test_a_worker_key_pins_the_model_it_may_define(tmp_path: Path) -> None:
    """`--digest`, `--num-layers` and `--kind` go in the key file beside the model and
    layers (the broker holds each REGISTER to them: broker/admission.py)."""
    from zmqllm.bus.keys import key_claims

    folder = init_keys(tmp_path / "keys")
    pins = {"model": "m", "layers": "16:32", "digest": "0f3a", "num_layers": "32", "kind": "layers"}
    add_key(folder, "worker", "gpu-2", pins)
    assert key_claims(folder / "workers" / "gpu-2.key") == pins
    assert key_claims(folder / "issued" / "gpu-2" / "worker.key") == pins


@pytest.mark.parametrize(
    ("claims", "match"),
    [
        ({"kind": "gguf"}, "kind 'gguf'"),
        ({"num_layers": "0"}, "num_layers '0'"),
        ({"num_layers": "many"}, "num_layers 'many'"),
        ({"num_layers": "2000"}, "num_layers '2000'"),
        ({"digest": "d" * 129}, "1 to 128"),
        ({"kind": "text", "num_layers": "2"}, "one layer"),
        ({"layers": "16:40", "num_layers": "32"}, "past the model's 32 layers"),
        ({"layers": "16-32"}, "give a range A:B"),
    ],
)
def test_pins_that_cannot_hold_are_refused_when_issued(
    tmp_path: Path, claims: dict[str, str], match: str
) -> None:
    folder = init_keys(tmp_path / "keys")
    with pytest.raises(KeysError, match=match):
        add_key(folder, "worker", "odd", claims)
    assert not (folder / "workers" / "odd.key").exists()


def test_keys_add_takes_the_pins_as_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from zmqllm.bus.keys import key_claims
    from zmqllm.cli import main

    folder = init_keys(tmp_path / "keys")
    args = ["keys", "add", "worker", "gpu-2", "--keys", str(folder), "--model", "m"]
    pins = ["--layers", "0:16", "--digest", "0f3a", "--num-layers", "32", "--kind", "layers"]
    assert main([*args, *pins]) == 0
    assert key_claims(folder / "workers" / "gpu-2.key") == {
        "model": "m",
        "layers": "0:16",
        "digest": "0f3a",
        "num_layers": "32",
        "kind": "layers",
    }
    # A remote model is one layer long: --kind text pins that too.
    text = ["keys", "add", "worker", "remote-1", "--keys", str(folder), "--model", "gpt"]
    assert main([*text, "--digest", "remote:gpt-4o", "--kind", "text"]) == 0
    claims = key_claims(folder / "workers" / "remote-1.key")
    assert claims["num_layers"] == "1" and claims["kind"] == "text"
    assert main(["keys", "add", "client", "app", "--keys", str(folder), "--digest", "x"]) == 2
    assert "a worker key's" in capsys.readouterr().err
