"""Fixtures for end-to-end tests: real processes on 127.0.0.1, always stopped."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")

from zmqllm.local_cluster import Cluster


@pytest.fixture(scope="session")
def e2e_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from zmqllm.engine import native
    from zmqllm.models import prepare_tiny_model

    # Built once here, not by the first workers while a test waits for them to be ready.
    native.load()
    return prepare_tiny_model(tmp_path_factory.mktemp("e2e-models") / "tiny")


@pytest.fixture(scope="session")
def reference(e2e_model: Path):
    """Greedy text from HF MistralForCausalLM on the same weights, stopping at EOS."""
    import torch
    from transformers import MistralForCausalLM

    from zmqllm.tokenizer import Tokenizer

    model = MistralForCausalLM.from_pretrained(e2e_model).eval()
    tok = Tokenizer.from_dir(e2e_model)

    def text_for(ids: list[int], max_tokens: int) -> tuple[str, list[int]]:
        x = torch.tensor([ids])
        out = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=sorted(tok.eos_token_ids),
            pad_token_id=0,
        )[0, len(ids) :].tolist()
        return tok.decode(out), out

    def chat(prompt: str, max_tokens: int) -> str:
        return text_for(tok.encode_chat([{"role": "user", "content": prompt}]), max_tokens)[0]

    def raw(prompt: str, max_tokens: int) -> str:
        return text_for(tok.encode(prompt), max_tokens)[0]

    chat.raw = raw  # type: ignore[attr-defined]
    chat.tokenizer = tok  # type: ignore[attr-defined]
    return chat


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, e2e_model: Path) -> Iterator[Cluster]:
    """Broker + workers for layers 0:2 and 2:4 + gateway, shared by a test module."""
    c = Cluster(tmp_path_factory.mktemp("cluster"), e2e_model)
    try:
        c.start_all()
        yield c
    finally:
        c.stop()


@pytest.fixture()
def fresh_cluster(tmp_path: Path, e2e_model: Path) -> Iterator[Cluster]:
    """A cluster of its own, for tests that kill or restart processes."""
    c = Cluster(tmp_path / "cluster", e2e_model)
    try:
        yield c
    finally:
        c.stop()
