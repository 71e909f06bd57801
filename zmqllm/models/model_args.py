"""The model's hyper-parameters, read from a Hugging Face ``config.json``.

No torch here: the broker and the gateway read the same facts (layer count,
context length) without the ML stack.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("mistral", "llama")


class ModelConfigError(ValueError):
    """config.json describes a model this engine cannot run."""


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    sliding_window: int | None
    tie_word_embeddings: bool
    model_type: str = "mistral"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def kv_groups(self) -> int:
        """Query heads that share one key/value head (grouped-query attention)."""
        return self.num_heads // self.num_kv_heads

    @property
    def layer_params(self) -> int:
        """Matmul weights of one decoder layer (attention and MLP)."""
        q_o = 2 * self.hidden_size * self.num_heads * self.head_dim
        k_v = 2 * self.hidden_size * self.num_kv_heads * self.head_dim
        return q_o + k_v + 3 * self.hidden_size * self.intermediate_size

    @property
    def head_cost(self) -> float:
        """The output layer's matmul work in decoder layers (each row's cost is its
        weights'), to one decimal so every process splits alike: what "k/n" gives the
        last stage less."""
        return round(self.vocab_size * self.hidden_size / self.layer_params, 1)

    def stage_ranges(self, stages: int) -> list[tuple[int, int]]:
        """The layer ranges of "1/n" ... "n/n" for this model (stages of about equal
        cost)."""
        from zmqllm.config.layers import split_layers

        return split_layers(self.num_layers, stages, self.head_cost)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelArgs:
        model_type = cfg.get("model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelConfigError(
                f"model_type {model_type!r} is not supported (supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ModelConfigError(f"hidden_act {act!r} is not supported (only silu)")
        for flag in ("attention_bias", "mlp_bias"):
            if cfg.get(flag):
                raise ModelConfigError(f"{flag}=true is not supported")
        # transformers 5 nests rope settings in rope_parameters; 4.x and most
        # Hub checkpoints keep rope_theta / rope_scaling at the top level.
        rope = cfg.get("rope_parameters") or {}
        rope_theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", "default")
        scaling = cfg.get("rope_scaling")
        if scaling:
            rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type != "default":
            raise ModelConfigError(f"rope type {rope_type!r} is not supported (only default)")

        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ModelConfigError(
                f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
            )
        head_dim = cfg.get("head_dim") or int(cfg["hidden_size"]) // heads
        # A llama config has no sliding window; a mistral one may have null.
        window = cfg.get("sliding_window") if model_type == "mistral" else None
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            sliding_window=int(window) if window else None,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            model_type=model_type,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_dir(cls, directory: str | Path) -> ModelArgs:
        path = Path(directory) / "config.json"
        try:
            cfg = json.loads(path.read_text())
        except FileNotFoundError:
            raise ModelConfigError(f"{path} does not exist: not a model directory") from None
        except json.JSONDecodeError as exc:
            raise ModelConfigError(f"{path} is not valid JSON: {exc}") from None
        return cls.from_dict(cfg)

    def kv_bytes_per_token(self, num_layers: int, itemsize: int) -> int:
        """Bytes of keys and values one token needs on a stage of num_layers layers."""
        return 2 * num_layers * self.num_kv_heads * self.head_dim * itemsize
