"""The official ``openai`` package, unchanged, against the gateway on a real port."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.fake_broker_client import FakeBrokerClient, Script
from tests.gateway.support import (
    ANSWER,
    MODEL,
    answer_script,
    make_app,
    running_server,
    tiny_tokenizer,
)
from zmqllm.models.tokenizer import Tokenizer

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return tiny_tokenizer(tmp_path_factory.mktemp("tiny-tokenizer"))


@pytest.fixture(scope="module")
def fake(tok: Tokenizer) -> FakeBrokerClient:
    return FakeBrokerClient(answer_script(tok, delay=0.001))


@pytest.fixture(scope="module")
def api(fake: FakeBrokerClient, tok: Tokenizer) -> Iterator[Any]:
    with running_server(make_app(fake, tok)) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(autouse=True)
def reset(fake: FakeBrokerClient, tok: Tokenizer) -> None:
    fake.default_script = answer_script(tok, delay=0.001)


MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def test_models(api: Any) -> None:
    assert [model.id for model in api.models.list()] == [MODEL]


def test_chat_completion(api: Any, tok: Tokenizer) -> None:
    completion = api.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0)
    assert completion.choices[0].message.content == ANSWER
    assert completion.choices[0].message.role == "assistant"
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage.completion_tokens == len(tok.encode(ANSWER)) + 1
    assert completion.usage.total_tokens == (
        completion.usage.prompt_tokens + completion.usage.completion_tokens
    )


def test_chat_completion_stream(api: Any) -> None:
    stream = api.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        stream=True,
        stream_options={"include_usage": True},
        max_completion_tokens=5,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert ANSWER.startswith(text) and text
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finish[-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5


def test_completion(api: Any) -> None:
    completion = api.completions.create(model=MODEL, prompt="Paris is", stop=["France"])
    assert completion.choices[0].text == "The capital of "
    assert completion.choices[0].finish_reason == "stop"


def test_completion_stream(api: Any) -> None:
    stream = api.completions.create(model=MODEL, prompt="Paris is", stream=True, seed=3)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == ANSWER
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_errors_surface_as_openai_exceptions(api: Any, fake: FakeBrokerClient) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        api.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert "gpt-4o" in missing.value.message
    with pytest.raises(openai.BadRequestError) as bad:
        api.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=0)
    assert bad.value.body["param"] == "max_tokens"
    # A failure mid-stream arrives as an error event, which the package raises.
    fake.default_script = Script(fake.default_script.tokens, fail_after=3)
    stream = api.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True)
    with pytest.raises(openai.APIError, match="stopped answering"):
        list(stream)
