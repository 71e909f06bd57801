"""Fixtures for end-to-end tests: real processes on 127.0.0.1, always stopped."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.e2e.expected import sent_text

# Torch is asked for by the fixtures that need it: the remote-model tests run without it
# (in the front-end environments, whose processes then prove the point).
pytest.importorskip("fastapi")

from testbed.cluster import Cluster
from zmqllm.launch.child_process import ChildProcess


@pytest.fixture(scope="session")
def e2e_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("torch")
    from zmqllm.engine import native
    from zmqllm.models.prepare import prepare_tiny_model

    # Built once here, not by the first workers while a test waits for them to be ready.
    native.load()
    return prepare_tiny_model(tmp_path_factory.mktemp("e2e-models") / "tiny")


@pytest.fixture(scope="session")
def reference(e2e_model: Path):
    """Greedy text from HF MistralForCausalLM on the same weights, stopping at EOS, as
    the gateway sends it (``.body``: as /chat sends it)."""
    torch = pytest.importorskip("torch")
    from transformers import MistralForCausalLM

    from zmqllm.models.tokenizer import Tokenizer

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
        return sent_text(tok, out), out

    def chat(prompt: str, max_tokens: int) -> str:
        return text_for(tok.encode_chat([{"role": "user", "content": prompt}]), max_tokens)[0]

    def raw(prompt: str, max_tokens: int) -> str:
        return text_for(tok.encode(prompt), max_tokens)[0]

    def body(prompt: str, max_tokens: int) -> str:
        """What POST /chat sends: the answer, then a newline."""
        return chat(prompt, max_tokens) + "\n"

    def turns(messages: list[dict[str, str]], max_tokens: int) -> str:
        """The next reply of a conversation (a list of role/content messages)."""
        return text_for(tok.encode_chat(messages), max_tokens)[0]

    chat.raw = raw  # type: ignore[attr-defined]
    chat.turns = turns  # type: ignore[attr-defined]
    chat.body = body  # type: ignore[attr-defined]
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


@dataclass
class ConfiguredCluster(Cluster):
    """A Cluster whose processes all read one TOML config (settings the flags of
    ``Cluster`` do not reach: the broker's peer_queue, the gateway's max_concurrent...).
    Flags still win over the file, as on the command line."""

    config: str = ""

    def _start(self, name: str, args: list[str]) -> ChildProcess:
        if self.config:
            path = self.root / "cluster.toml"
            path.write_text(self.config)
            args = [*args, "--config", str(path)]
        return super()._start(name, args)


@pytest.fixture(scope="session")
def greedy_ids(e2e_model: Path) -> Callable[..., list[int]]:
    """HF MistralForCausalLM greedy token ids for prompt ids; ``stop_at_eos=False`` is the
    reference for ``ignore_eos`` requests (exactly ``max_tokens`` ids). Cached: several
    tests and streams share prompts, and HF generate runs the whole model for every token."""
    import torch
    from transformers import MistralForCausalLM

    from zmqllm.models.tokenizer import Tokenizer

    model = MistralForCausalLM.from_pretrained(e2e_model).eval()
    eos = sorted(Tokenizer.from_dir(e2e_model).eos_token_ids)

    @functools.cache
    def generate(ids: tuple[int, ...], max_tokens: int, stop_at_eos: bool) -> tuple[int, ...]:
        x = torch.tensor([ids])
        threads = torch.get_num_threads()
        # One thread: on 2 cores shared with a cluster (and more), every parallel region
        # of a 2-thread forward waits for a descheduled thread (measured ~10x slower).
        torch.set_num_threads(1)
        try:
            out = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=max_tokens,
                do_sample=False,
                # None (not []): generate then ignores the checkpoint's EOS as ignore_eos
                # does, where min_new_tokens would forbid EOS and change the argmax.
                eos_token_id=eos if stop_at_eos else None,
                pad_token_id=0,
            )
        finally:
            torch.set_num_threads(threads)
        return tuple(out[0, len(ids) :].tolist())

    def greedy(ids: Sequence[int], max_tokens: int, stop_at_eos: bool = True) -> list[int]:
        return list(generate(tuple(ids), max_tokens, stop_at_eos))

    return greedy
