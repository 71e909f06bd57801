"""Find a checkpoint and read only the tensors one shard needs.

A model is a local directory or a Hugging Face Hub repo id. From the Hub a
worker downloads config and tokenizer files, the index, and then only the
safetensors files that hold its own tensors.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from zmqllm.models.checkpoint import INDEX_FILE, SINGLE_FILE, CheckpointError, weight_map
from zmqllm.models.model_args import ModelArgs
from zmqllm.models.tokenizer import MODEL_FILES

# Small files every process wants (the config, tokenizer and chat template), and the
# weight index that names a shard's files.
META_PATTERNS = [*MODEL_FILES, "chat_template.json", INDEX_FILE]
# Config keys that say nothing about the computation.
_VOLATILE_CONFIG_KEYS = {
    "transformers_version",
    "_name_or_path",
    "architectures",
    "dtype",
    "torch_dtype",
    "use_cache",
}


def shard_tensor_names(args: ModelArgs, start: int, end: int) -> list[str]:
    """Checkpoint names of every tensor a shard for layers [start, end) needs."""
    names: list[str] = []
    if start == 0:
        names.append("model.embed_tokens.weight")
    for i in range(start, end):
        p = f"model.layers.{i}."
        names += [p + f"self_attn.{x}_proj.weight" for x in ("q", "k", "v", "o")]
        names += [p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
    if end == args.num_layers:
        names.append("model.norm.weight")
        head = "model.embed_tokens.weight" if args.tie_word_embeddings else "lm_head.weight"
        if head not in names:
            names.append(head)
    return names


def resolve_checkpoint(
    model: str,
    args_for: tuple[int, int] | Callable[[ModelArgs], tuple[int, int]] | None = None,
    revision: str | None = None,
) -> Path:
    """A local directory holding what a shard needs.

    ``model`` is a directory or a Hub repo id. For a repo id the config,
    tokenizer and index come first; then, if ``args_for`` gives the layer range
    (start, end) — or a function of the config that does, when the range
    depends on the layer count — only the safetensors files that hold those
    layers' tensors, else all of them. Honours HF_HOME / HF_HUB_OFFLINE.
    """
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.is_absolute() or model.startswith((".", "~")) or model.count("/") > 1:
        raise CheckpointError(f"model directory {model} does not exist")
    from huggingface_hub import snapshot_download

    try:
        local = Path(snapshot_download(model, revision=revision, allow_patterns=META_PATTERNS))
        args = ModelArgs.from_dir(local)
        if (local / INDEX_FILE).exists():
            wmap = weight_map(local)
            bounds = args_for(args) if callable(args_for) else args_for
            names = shard_tensor_names(args, *bounds) if bounds else list(wmap)
            files = sorted({wmap[n] for n in names if n in wmap})
        else:
            files = [SINGLE_FILE]
        local = Path(snapshot_download(model, revision=revision, allow_patterns=files))
    except CheckpointError:
        raise
    except Exception as exc:  # hub errors come in many classes; say which model failed
        raise CheckpointError(f"cannot fetch {model!r} from the Hugging Face Hub: {exc}") from exc
    return local


@dataclass
class ShardTensors:
    """Tensors read for one shard, and a record of what was read."""

    tensors: dict[str, torch.Tensor]
    files_opened: list[str] = field(default_factory=list)

    @property
    def names_read(self) -> list[str]:
        return list(self.tensors)


def shard_tensor_groups(args: ModelArgs, start: int, end: int) -> list[list[str]]:
    """The shard's tensor names in loading groups: embedding, each layer, norm + head.

    A tied head on a shard that also embeds needs no second read of the embedding.
    """
    names = shard_tensor_names(args, start, end)
    groups: list[list[str]] = []
    if start == 0:
        groups.append(["model.embed_tokens.weight"])
    for i in range(start, end):
        groups.append([n for n in names if n.startswith(f"model.layers.{i}.")])
    if end == args.num_layers:
        tail = ["model.norm.weight"]
        if not args.tie_word_embeddings:
            tail.append("lm_head.weight")
        elif start != 0:
            tail.append("model.embed_tokens.weight")
        groups.append(tail)
    return groups


def load_shard_tensors(
    directory: Path,
    args: ModelArgs,
    start: int,
    end: int,
    only: list[str] | None = None,
    wmap: dict[str, str] | None = None,
) -> ShardTensors:
    """Read exactly the tensors of layers [start, end) (+ embedding / head), or the
    subset ``only`` of them. Each call opens (maps) the files and closes them again,
    so the pages it touched leave the resident set with it."""
    wmap = wmap if wmap is not None else weight_map(directory)
    names = only if only is not None else shard_tensor_names(args, start, end)
    missing = [n for n in names if n not in wmap]
    if missing:
        raise CheckpointError(
            f"{directory} lacks {len(missing)} tensors this shard needs, e.g. {missing[0]}"
        )
    by_file: dict[str, list[str]] = {}
    for name in names:
        by_file.setdefault(wmap[name], []).append(name)
    out = ShardTensors(tensors={})
    for fname, fnames in sorted(by_file.items()):
        fpath = directory / fname
        if not fpath.exists():
            raise CheckpointError(f"{fpath} is missing (needed for {fnames[0]})")
        out.files_opened.append(fname)
        with safe_open(str(fpath), framework="pt") as f:
            for name in fnames:
                out.tensors[name] = f.get_tensor(name)
    return out


def _canonical_config(directory: Path) -> dict[str, Any]:
    cfg = json.loads((directory / "config.json").read_text())
    return {k: v for k, v in sorted(cfg.items()) if k not in _VOLATILE_CONFIG_KEYS}


def model_fingerprint(directory: Path, args: ModelArgs, runtime_dtype: str) -> dict[str, Any]:
    """What every worker of one cluster must agree on.

    The digest covers the computation-relevant config and the full list of
    tensor names; the summary fields let a refusal name what differs.
    """
    cfg = _canonical_config(directory)
    names = sorted(weight_map(directory))
    cfg_digest = hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:16]
    names_digest = hashlib.sha256("\n".join(names).encode()).hexdigest()[:16]
    summary: dict[str, Any] = {
        "model_type": args.model_type,
        "num_layers": args.num_layers,
        "hidden_size": args.hidden_size,
        "intermediate_size": args.intermediate_size,
        "num_heads": args.num_heads,
        "num_kv_heads": args.num_kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "sliding_window": args.sliding_window,
        "rope_theta": args.rope_theta,
        "tie_word_embeddings": args.tie_word_embeddings,
        "num_tensors": len(names),
        "dtype": runtime_dtype,
        "config": cfg_digest,
        "tensors": names_digest,
    }
    summary["digest"] = hashlib.sha256(json.dumps(summary, sort_keys=True).encode()).hexdigest()[
        :16
    ]
    return summary
