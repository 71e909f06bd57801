"""A shard reads only its own tensors, locally and from a (pre-filled) Hub cache."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from zmqllm.broker.registry import fingerprint_differences  # noqa: E402
from zmqllm.engine.generator import load_shard  # noqa: E402
from zmqllm.engine.weights import (  # noqa: E402
    load_shard_tensors,
    model_fingerprint,
    resolve_checkpoint,
    shard_tensor_names,
)
from zmqllm.models.checkpoint import INDEX_FILE, CheckpointError, weight_map  # noqa: E402
from zmqllm.models.model_args import ModelArgs  # noqa: E402

pytestmark = pytest.mark.torch


def test_shard_reads_only_its_layers(tiny_model_dir: Path) -> None:
    args = ModelArgs.from_dir(tiny_model_dir)
    read = load_shard_tensors(tiny_model_dir, args, 0, 2)
    assert set(read.names_read) == set(shard_tensor_names(args, 0, 2))
    assert all(not n.startswith(("model.layers.2.", "model.layers.3.")) for n in read.names_read)
    assert "lm_head.weight" not in read.names_read and "model.norm.weight" not in read.names_read
    last = load_shard_tensors(tiny_model_dir, args, 2, 4)
    assert "model.embed_tokens.weight" not in last.names_read  # untied: own lm_head
    assert "lm_head.weight" in last.names_read


def test_half_model_shard_holds_about_half_the_layer_parameters(tiny_model_dir: Path) -> None:
    whole = load_shard(tiny_model_dir, 0, 4)
    first, second = load_shard(tiny_model_dir, 0, 2), load_shard(tiny_model_dir, 2, 4)

    def layer_params(s) -> int:
        return sum(p.numel() for p in s.layers.parameters())

    assert layer_params(first) == layer_params(second) == layer_params(whole) // 2
    # Each half holds the layers' half plus only its own end (embedding or head).
    total = whole.num_parameters()
    assert first.num_parameters() + second.num_parameters() == total
    for half in (first, second):
        assert 0.3 * total < half.num_parameters() < 0.7 * total


def test_tied_embeddings_serve_as_lm_head(default_model_dir: Path) -> None:
    args = ModelArgs.from_dir(default_model_dir)
    assert args.tie_word_embeddings
    names = shard_tensor_names(args, 15, 30)
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    last = load_shard(default_model_dir, 15, 30)
    assert last.lm_head is not None and last.embed is None
    whole = load_shard(default_model_dir, 0, 30)
    assert whole.lm_head is whole.embed  # one tensor, not two copies


def test_sharded_checkpoint_opens_only_needed_files(tiny_sharded_dir: Path) -> None:
    assert (tiny_sharded_dir / INDEX_FILE).exists()
    wmap = weight_map(tiny_sharded_dir)
    assert len(set(wmap.values())) > 2
    args = ModelArgs.from_dir(tiny_sharded_dir)
    read = load_shard_tensors(tiny_sharded_dir, args, 0, 1)
    needed = {wmap[n] for n in shard_tensor_names(args, 0, 1)}
    assert set(read.files_opened) == needed
    assert len(needed) < len(set(wmap.values()))


def _fill_hub_cache(cache: Path, repo: str, src: Path, keep: set[str]) -> None:
    """Lay out a Hugging Face hub cache by hand, holding only the files in keep."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    root = cache / ("models--" + repo.replace("/", "--"))
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(commit)
    snap = root / "snapshots" / commit
    snap.mkdir(parents=True)
    for f in src.iterdir():
        if f.name in keep:
            shutil.copy(f, snap / f.name)


def test_hub_repo_resolves_offline_from_cache(
    tiny_sharded_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    args = ModelArgs.from_dir(tiny_sharded_dir)
    wmap = weight_map(tiny_sharded_dir)
    stage0 = {wmap[n] for n in shard_tensor_names(args, 0, 1)}
    meta = {p.name for p in tiny_sharded_dir.iterdir() if p.suffix in (".json", ".jinja")}
    cache = tmp_path / "hub"
    # Only stage 0's safetensors files are in the cache: enough for that shard.
    _fill_hub_cache(cache, "zmqllm-tests/tiny", tiny_sharded_dir, meta | stage0)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(cache))
    local = resolve_checkpoint("zmqllm-tests/tiny", args_for=(0, 1))
    assert (local / "config.json").exists()
    shard = load_shard(local, 0, 1)
    ref = load_shard(tiny_sharded_dir, 0, 1)
    assert torch.equal(shard.layers[0].wqkv.weight, ref.layers[0].wqkv.weight)


@pytest.fixture
def hub_calls(tiny_sharded_dir: Path, monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The allow_patterns of every Hub download, each answered with the sharded tiny
    checkpoint (no network)."""
    import huggingface_hub

    calls: list[list[str]] = []

    def fake_snapshot(repo_id: str, revision=None, allow_patterns=None, **kw) -> str:
        calls.append(list(allow_patterns or []))
        return str(tiny_sharded_dir)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot)
    return calls


def test_hub_download_asks_only_for_the_shards_files(
    tiny_sharded_dir: Path, hub_calls: list[list[str]]
) -> None:
    args = ModelArgs.from_dir(tiny_sharded_dir)
    resolve_checkpoint("org/model", args_for=(3, 4))
    assert "config.json" in hub_calls[0] and INDEX_FILE in hub_calls[0]
    wmap = weight_map(tiny_sharded_dir)
    assert set(hub_calls[1]) == {wmap[n] for n in shard_tensor_names(args, 3, 4)}
    assert not any(f.endswith(".safetensors") for f in hub_calls[0])


def test_missing_checkpoint_errors(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError):
        resolve_checkpoint(str(tmp_path / "nope"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mistral"}))
    with pytest.raises(CheckpointError, match=r"no model\.safetensors"):
        weight_map(tmp_path)


def test_fingerprint_is_stable_and_names_differences(
    tiny_model_dir: Path, tiny_sharded_dir: Path, default_model_dir: Path
) -> None:
    a = model_fingerprint(tiny_model_dir, ModelArgs.from_dir(tiny_model_dir), "float32")
    b = model_fingerprint(tiny_sharded_dir, ModelArgs.from_dir(tiny_sharded_dir), "float32")
    assert a == b  # same model, different file layout
    c = model_fingerprint(default_model_dir, ModelArgs.from_dir(default_model_dir), "float32")
    diffs = fingerprint_differences(a, c)
    assert any(d.startswith("num_layers: 4 != 30") for d in diffs)
    assert fingerprint_differences(a, b) == []


def test_hub_range_from_the_config_fetches_only_that_ranges_files(
    tiny_sharded_dir: Path, hub_calls: list[list[str]]
) -> None:
    """A worker given "2/2" learns the layer count from config.json first: the range
    is a function of the config, and still only its files are asked for."""
    args = ModelArgs.from_dir(tiny_sharded_dir)
    resolve_checkpoint("org/model", args_for=lambda a: (a.num_layers - 1, a.num_layers))
    wmap = weight_map(tiny_sharded_dir)
    assert len(hub_calls) == 2
    assert set(hub_calls[1]) == {wmap[n] for n in shard_tensor_names(args, 3, 4)}
