"""Activations sent as bfloat16 or float16 (`--wire-dtype`) by a real 2-stage cluster.

The option rounds the hidden states once, where they leave stage 0 (layers 0:2), and
changes nothing else: the receiving float32 stage casts them back. So the cluster's greedy
text is asserted equal, token for token, to HF `MistralForCausalLM`'s on the same weights
with that one rounding applied at the output of layer 1 (a forward hook): a deterministic
prediction. How often that text also equals float32's is printed, not asserted: it depends
on near-ties the rounding may break (figures for the tiny and the default model:
docs/benchmarks.md).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from testbed.cluster import Cluster
from tests.e2e.expected import sent_text
from tests.e2e.test_cluster import PROMPTS, post_chat
from zmqllm.launch.child_process import ChildProcess

pytestmark = [pytest.mark.e2e, pytest.mark.torch]

SPLIT = 2  # stage 0 holds layers 0:2
MAX_TOKENS = 32
FLOAT16_MAX = 65504.0


@dataclass
class WireCluster(Cluster):
    """A Cluster whose workers send activations in ``wire_dtype``."""

    wire_dtype: str = "auto"

    def _start(self, name: str, args: list[str]) -> ChildProcess:
        if args[0] == "worker":
            args = [*args, "--wire-dtype", self.wire_dtype]
        return super()._start(name, args)


@pytest.fixture(scope="module", params=["bfloat16", "float16"])
def wire_cluster(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, e2e_model: Path
) -> Iterator[WireCluster]:
    c = WireCluster(tmp_path_factory.mktemp("wire"), e2e_model, wire_dtype=request.param)
    try:
        c.start_all((f"0:{SPLIT}", f"{SPLIT}:4"))
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def rounded_reference(e2e_model: Path) -> Callable[[str, int, str], str]:
    """HF greedy chat text with the hidden states rounded to a wire dtype after layer
    SPLIT - 1, as the cluster's stage boundary rounds them."""
    import torch
    from transformers import MistralForCausalLM

    from zmqllm.models.tokenizer import Tokenizer

    model = MistralForCausalLM.from_pretrained(e2e_model).eval()
    tok = Tokenizer.from_dir(e2e_model)

    @functools.cache
    def text(prompt: str, max_tokens: int, wire: str) -> str:
        dtype = getattr(torch, wire)

        def round_trip(h: torch.Tensor) -> torch.Tensor:
            if dtype == torch.float16:  # saturates, as a sender does
                h = h.clamp(-FLOAT16_MAX, FLOAT16_MAX)
            return h.to(dtype).to(torch.float32)

        def hook(_module: Any, _inputs: Any, out: Any) -> Any:
            if isinstance(out, tuple):
                return (round_trip(out[0]), *out[1:])
            return round_trip(out)

        handle = model.model.layers[SPLIT - 1].register_forward_hook(hook)
        ids = tok.encode_chat([{"role": "user", "content": prompt}])
        x = torch.tensor([ids])
        try:
            out = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=max_tokens,
                do_sample=False,
                eos_token_id=sorted(tok.eos_token_ids),
                pad_token_id=0,
            )[0, len(ids) :].tolist()
        finally:
            handle.remove()
        return sent_text(tok, out)

    return text


def test_a_narrow_wire_serves_exactly_what_its_rounding_predicts(
    wire_cluster: WireCluster, rounded_reference: Callable[[str, int, str], str], reference: Any
) -> None:
    wire = wire_cluster.wire_dtype
    same_as_float32 = 0
    for prompt in PROMPTS:
        status, chunks, _ = post_chat(wire_cluster, prompt, f"max_tokens={MAX_TOKENS}")
        assert status == 200
        text = b"".join(p for _, p in chunks).decode()
        # /chat ends the answer with a newline.
        assert text == rounded_reference(prompt, MAX_TOKENS, wire) + "\n", prompt
        same_as_float32 += text == reference.body(prompt, MAX_TOKENS)
    print(f"{wire} on the wire: {same_as_float32}/{len(PROMPTS)} answers equal float32's")
