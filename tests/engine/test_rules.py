"""The last stage's sampling rules on the tiny model, without sockets: penalties as
OpenAI defines them (against a reference computed here from the full logits), grammars
(every token allowed, the document complete, the session finished there), and a replay
given the tokens so far that goes on as the stream it replaces.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
llguidance = pytest.importorskip("llguidance")

from tests.engine.test_stage import Pipeline, Req, prompt  # noqa: E402
from zmqllm.bus.messages import Finish  # noqa: E402
from zmqllm.bus.sampling_params import SamplingParams  # noqa: E402
from zmqllm.engine.generator import Generator, load_shard  # noqa: E402
from zmqllm.engine.model import MistralShard  # noqa: E402
from zmqllm.engine.rules import GrammarTokenizer, SessionRules  # noqa: E402
from zmqllm.engine.stage import Stage  # noqa: E402
from zmqllm.models.model_args import ModelArgs  # noqa: E402
from zmqllm.models.tokenizer import Tokenizer  # noqa: E402

pytestmark = pytest.mark.torch

SCHEMA = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["cat", "dog"]},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
        "inner": {
            "type": "object",
            "properties": {"n": {"enum": [1, 2, 3]}},
            "required": ["n"],
            "additionalProperties": False,
        },
    },
    "required": ["kind", "ok", "tags", "inner"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def shards(tiny_model_dir: Path) -> dict[tuple[int, int], MistralShard]:
    return {r: load_shard(tiny_model_dir, *r) for r in [(0, 2), (2, 4)]}


@pytest.fixture(scope="module")
def grammars(tiny_model_dir: Path) -> GrammarTokenizer:
    return GrammarTokenizer(tiny_model_dir, ModelArgs.from_dir(tiny_model_dir).vocab_size)


def pipeline(shards: dict[tuple[int, int], MistralShard], grammars: GrammarTokenizer) -> Pipeline:
    return Pipeline([Stage(shards[(0, 2)]), Stage(shards[(2, 4)], grammar_tokenizer=grammars)])


def grammar(schema: dict) -> str:
    return llguidance.LLMatcher.grammar_from_json_schema(schema)


def test_penalties_are_openais(tiny_model_dir: Path, shards, grammars) -> None:
    gen = Generator(tiny_model_dir)
    ids = prompt(12, seed=3)
    presence, frequency = -2.0, 0.5  # a negative presence penalty: the random model repeats
    # The reference: greedy over the full logits, each token's logit minus presence if
    # it was generated before and frequency times its count.
    want: list[int] = []
    for _ in range(12):
        logits = gen.all_logits(ids + want)[-1].numpy().copy()
        for t in set(want):
            logits[t] -= presence + frequency * want.count(t)
        want.append(int(np.argmax(logits)))
    plain = Pipeline([Stage(shards[(0, 2)]), Stage(shards[(2, 4)])])
    plain.open(Req("p", ids, 12))
    plain.run_until_idle()
    p = pipeline(shards, grammars)
    sampling = SamplingParams(presence_penalty=presence, frequency_penalty=frequency)
    p.open(Req("s", ids, 12, sampling))
    p.run_until_idle()
    assert p.tokens["s"] == want
    assert p.tokens["s"] != plain.tokens["p"]  # the penalties changed the answer


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_grammar_gives_a_document_of_its_schema(
    tiny_model_dir: Path, shards, grammars, temperature: float
) -> None:
    tok = Tokenizer.from_dir(tiny_model_dir)
    p = pipeline(shards, grammars)
    sampling = SamplingParams(temperature=temperature, seed=5, grammar=grammar(SCHEMA))
    p.open(Req("g", prompt(10, seed=4), 200, sampling))
    p.run_until_idle()
    doc = json.loads(tok.decode(p.tokens["g"]))
    assert set(doc) == {"kind", "ok", "tags", "inner"}
    assert doc["kind"] in ("cat", "dog") and isinstance(doc["ok"], bool)
    assert set(doc["tags"]) <= {"a", "b"} and len(doc["tags"]) <= 2
    assert doc["inner"]["n"] in (1, 2, 3)
    assert p.finishes["g"][-1] == Finish.STOP  # ended by the grammar, not max_tokens
    assert len(p.tokens["g"]) < 200


def test_a_replay_given_the_tokens_so_far_goes_on_the_same(
    tiny_model_dir: Path, shards, grammars
) -> None:
    ids = prompt(10, seed=6)
    sampling = SamplingParams(
        temperature=0.9, seed=11, frequency_penalty=0.5, grammar=grammar(SCHEMA)
    )
    whole = pipeline(shards, grammars)
    whole.open(Req("w", ids, 200, sampling))
    whole.run_until_idle()
    done = 4
    sofar = whole.tokens["w"][:done]
    replay = pipeline(shards, grammars)
    again = SamplingParams(**{**sampling.__dict__, "first_step": done})
    # What the broker does for a replay: the tokens so far close the prompt, and the
    # last stage is given them to restore its penalties and grammar.
    replay.stages[1].open(
        "r", "req", len(ids) + 200, 200 - done, again, frozenset(), generated=sofar
    )
    replay.stages[0].open(
        "r", "req", len(ids) + 200, 200 - done, again, frozenset(),
        np.asarray(ids + sofar, np.int32),
    )  # fmt: skip
    replay.tokens["r"], replay.finishes["r"], replay.finals["r"] = [], [], []
    replay.run_until_idle()
    assert sofar + replay.tokens["r"] == whole.tokens["w"]


def test_bad_grammars_and_refused_tokens_are_value_errors(grammars) -> None:
    vocab = grammars.vocab_size
    with pytest.raises(ValueError, match="grammar"):
        SessionRules(SamplingParams(grammar='{"grammars": [{"nonsense": 1}]}'), vocab, grammars)
    with pytest.raises(ValueError, match="cannot constrain"):
        SessionRules(SamplingParams(grammar=grammar(SCHEMA)), vocab, None)
    rules = SessionRules(SamplingParams(grammar=grammar(SCHEMA)), vocab, grammars)
    row = rules.apply(np.zeros(vocab, np.float32))
    allowed = np.flatnonzero(np.isfinite(row))
    assert 0 < allowed.size < vocab  # a document starts with "{" and little else
    refused = int(np.flatnonzero(~np.isfinite(row))[0])
    with pytest.raises(ValueError, match="refused"):
        rules.accept(refused)
