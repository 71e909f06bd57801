"""response_format and the penalties through the openai package, with real processes.

On the tiny model (random weights: only the grammar makes its output a document) and on
the default model (slow): every reply of a ``json_schema`` request parses and validates
against its schema (nested objects, enums, arrays), streamed and not; ``json_object``
gives an object; the penalties change a greedy answer the way they should.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from testbed.cluster import Cluster

pytestmark = [pytest.mark.e2e, pytest.mark.torch]
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "role": {"enum": ["engineer", "artist", "pilot"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "role", "age"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 9999},
        "status": {"enum": ["open", "shipped", "closed"]},
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"enum": ["A1", "B2", "C3"]},
                    "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                },
                "required": ["sku", "qty"],
                "additionalProperties": False,
            },
        },
        "gift": {"type": "boolean"},
    },
    "required": ["id", "status", "items", "gift"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "sky": {"enum": ["sunny", "cloudy", "rain", "snow"]},
        "wind": {
            "type": "object",
            "properties": {
                "speed_kmh": {"type": "integer", "minimum": 0, "maximum": 200},
                "from": {"enum": ["N", "E", "S", "W"]},
            },
            "required": ["speed_kmh", "from"],
            "additionalProperties": False,
        },
    },
    "required": ["city", "sky", "wind"],
    "additionalProperties": False,
}
ASKS = [
    ("Describe a person as JSON.", PERSON),
    ("Give me an order as JSON.", ORDER),
    ("What is the weather in Oslo? Answer as JSON.", WEATHER),
]


def client_of(c: Cluster) -> Any:
    return openai.OpenAI(base_url=c.url + "/v1", api_key="unused", max_retries=0)


def schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema}}


def check_schemas(c: Cluster, max_tokens: int) -> None:
    client = client_of(c)
    model = client.models.list().data[0].id
    for question, schema in ASKS:
        msgs = [{"role": "user", "content": question}]
        fmt = schema_format(schema)
        whole = client.chat.completions.create(
            model=model, messages=msgs, max_tokens=max_tokens, response_format=fmt
        )
        choice = whole.choices[0]
        assert choice.finish_reason == "stop", choice  # the document ended, not the budget
        jsonschema.validate(json.loads(choice.message.content), schema)
        stream = client.chat.completions.create(
            model=model, messages=msgs, max_tokens=max_tokens, response_format=fmt, stream=True
        )
        text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
        assert text == choice.message.content  # greedy: the same document
        sampled = client.chat.completions.create(
            model=model,
            messages=msgs,
            max_tokens=max_tokens,
            response_format=fmt,
            temperature=1.0,
            seed=7,
            n=2,
        )
        for ch in sampled.choices:
            jsonschema.validate(json.loads(ch.message.content), schema)
    anything = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Any JSON object, please."}],
        max_tokens=max_tokens,
        response_format={"type": "json_object"},
        temperature=1.0,
        seed=3,
    )
    if anything.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(anything.choices[0].message.content), dict)
    else:  # a free object may outgrow the budget: what came is a document's start
        assert anything.choices[0].message.content.lstrip().startswith("{")


def test_tiny_model_replies_follow_their_schemas(cluster: Cluster) -> None:
    check_schemas(cluster, max_tokens=300)


def test_penalties_reach_the_last_stage(cluster: Cluster) -> None:
    client = client_of(cluster)
    model = client.models.list().data[0].id
    msgs = [{"role": "user", "content": "Count."}]
    plain = client.chat.completions.create(model=model, messages=msgs, max_tokens=40)
    again = client.chat.completions.create(
        model=model, messages=msgs, max_tokens=40, presence_penalty=0.0, frequency_penalty=0.0
    )
    assert again.choices[0].message.content == plain.choices[0].message.content
    # A strong negative presence penalty makes the random model repeat what it said.
    repeat = client.chat.completions.create(
        model=model, messages=msgs, max_tokens=40, presence_penalty=-2.0
    )
    assert repeat.choices[0].message.content != plain.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        client.chat.completions.create(
            model=model, messages=msgs, max_tokens=4, presence_penalty=3.0
        )


@pytest.fixture(scope="module")
def default_cluster(
    tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path
) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("default"), default_model_dir, threads=2)
    try:
        c.start_all(("0:15", "15:30"))
        yield c
    finally:
        c.stop()


@pytest.mark.slow
def test_default_model_replies_follow_their_schemas(default_cluster: Cluster) -> None:
    check_schemas(default_cluster, max_tokens=200)
