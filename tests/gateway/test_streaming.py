"""Token stream -> text: stop strings, UTF-8 safety, EOS, finish reasons, failures (no torch)."""

from __future__ import annotations

import pytest

from tests.fake_broker_client import FakeBrokerClient, FakeBrokerError, Script
from zmqllm.bus.sampling_params import SamplingParams
from zmqllm.client.request import GenerateRequest
from zmqllm.gateway.streaming import GenerationError, StopMatcher, TextStream
from zmqllm.models.tiny_tokenizer import EOS_TOKEN, write_tiny_tokenizer
from zmqllm.models.tokenizer import Tokenizer

pytestmark = pytest.mark.anyio

REPLACEMENT = "\ufffd"


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    directory = tmp_path_factory.mktemp("tiny-tokenizer")
    write_tiny_tokenizer(directory)
    return Tokenizer.from_dir(directory)


def eos(tok: Tokenizer) -> int:
    token = tok.token_to_id(EOS_TOKEN)
    assert token is not None and token in tok.eos_token_ids
    return token


# --- StopMatcher ---------------------------------------------------------------------------


def feed(matcher: StopMatcher, pieces: list[str]) -> tuple[list[str], bool]:
    out = []
    for piece in pieces:
        text, hit = matcher.push(piece)
        out.append(text)
        if hit:
            return out, True
    out.append(matcher.flush())
    return out, False


def test_no_stops_passes_text_through() -> None:
    assert feed(StopMatcher([]), ["a", "b"]) == (["a", "b", ""], False)


def test_stop_inside_one_chunk_is_cut() -> None:
    out, hit = feed(StopMatcher(["END"]), ["hello END world"])
    assert hit and "".join(out) == "hello "


def test_stop_split_across_chunks_is_held_back_then_cut() -> None:
    matcher = StopMatcher(["###"])
    assert matcher.push("abc#") == ("abc", False)  # "#" could start the stop string
    assert matcher.push("#") == ("", False)
    assert matcher.push("#tail") == ("", True)
    assert matcher.matched == "###"


def test_held_back_text_is_released_when_it_is_not_a_stop() -> None:
    matcher = StopMatcher(["###"])
    assert matcher.push("x##") == ("x", False)
    assert matcher.push("y") == ("##y", False)
    assert matcher.push("##") == ("", False)
    assert matcher.flush() == "##"


def test_earliest_of_several_stops_wins() -> None:
    out, hit = feed(StopMatcher(["world", "lo w"]), ["hel", "lo world"])
    assert hit and "".join(out) == "hel"


def test_overlapping_prefixes_hold_the_longest() -> None:
    matcher = StopMatcher(["aab"])
    assert matcher.push("xaa") == ("x", False)
    assert matcher.push("a") == ("a", False)  # "aaa": only the last "aa" can still match
    assert matcher.push("b") == ("", True)


# --- TextStream with the fake broker -------------------------------------------------------


async def run_stream(
    tok: Tokenizer,
    answer_ids: list[int],
    *,
    stops: tuple[str, ...] = (),
    max_tokens: int = 1000,
    delay: float = 0.0,
    fail_after: int | None = None,
) -> tuple[list[str], TextStream, FakeBrokerClient]:
    fake = FakeBrokerClient(Script(answer_ids, delay=delay, fail_after=fail_after))
    prompt = tok.encode_chat([{"role": "user", "content": "Hi"}])
    stream = fake.generate(
        GenerateRequest(
            request_id="r1",
            prompt=tuple(prompt),
            max_tokens=max_tokens,
            sampling=SamplingParams(),
            stop_ids=tuple(sorted(tok.eos_token_ids)),
        )
    )
    text_stream = TextStream(
        stream,
        tok.incremental_decoder(prompt_ids=prompt),
        max_tokens=max_tokens,
        stop_ids=tok.eos_token_ids,
        stops=stops,
    )
    chunks: list[str] = []
    await text_stream.open()
    try:
        async for chunk in text_stream.chunks():
            chunks.append(chunk)
    finally:
        await text_stream.close()
    return chunks, text_stream, fake


async def test_exact_text_and_eos_is_hidden(tok: Tokenizer) -> None:
    text = "The quick brown fox jumps over the lazy dog."
    ids = tok.encode(text)
    chunks, stream, fake = await run_stream(tok, [*ids, eos(tok)])
    assert "".join(chunks) == text
    assert len(chunks) > 1 and all(chunks)
    assert stream.finish_reason == "stop"
    assert stream.generated_tokens == len(ids) + 1  # the EOS token counts as generated
    assert fake.cancels == []  # the session finished by itself: nothing to cancel


@pytest.mark.parametrize(
    "text",
    [
        "Café naïve résumé",
        "你好，世界！今天天气很好。",
        "Emoji 😀 🎉 🚀 family 👨‍👩‍👧",
        "こんにちは 東京",
    ],
)
async def test_multibyte_characters_split_across_tokens(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert any(REPLACEMENT in tok.decode([token]) for token in ids), "want split characters"
    chunks, _, _ = await run_stream(tok, [*ids, eos(tok)])
    assert "".join(chunks) == text
    assert not any(REPLACEMENT in chunk for chunk in chunks)


async def test_max_tokens_cutting_a_character_leaves_the_cut_character_out(
    tok: Tokenizer,
) -> None:
    ids = tok.encode("ok 🚀 go")
    # Find a cut inside the emoji: the decoded prefix ends in U+FFFD there.
    cut = next(n for n in range(1, len(ids)) if tok.decode(ids[:n]).endswith(REPLACEMENT))
    chunks, stream, fake = await run_stream(tok, [*ids, eos(tok)], max_tokens=cut)
    assert stream.finish_reason == "length"
    assert stream.generated_tokens == cut
    # decode() ends with U+FFFD for the cut character; the stream ends before it.
    assert "".join(chunks) == tok.decode(ids[:cut]).rstrip(REPLACEMENT)
    assert not any(REPLACEMENT in chunk for chunk in chunks)
    assert fake.cancels == []


async def test_stop_string_across_token_boundaries_is_cut_and_cancels(tok: Tokenizer) -> None:
    text = "Hello, world! How are you today?"
    ids = tok.encode(text)
    stop = "world! How"
    # No single token holds the stop string: it can only be found across tokens.
    assert not any(stop in tok.decode([token]) for token in ids)
    chunks, stream, fake = await run_stream(tok, [*ids, eos(tok)], stops=(stop,))
    assert "".join(chunks) == "Hello, "
    assert stream.finish_reason == "stop"
    assert fake.cancels == ["s1"]  # stopped early: the session is cancelled
    assert stream.generated_tokens < len(ids)


async def test_stop_string_prefix_that_does_not_match_is_released(tok: Tokenizer) -> None:
    text = "The sun rises in the east and sets in the west."
    chunks, stream, _ = await run_stream(tok, [*tok.encode(text), eos(tok)], stops=("the moon",))
    assert "".join(chunks) == text
    assert stream.finish_reason == "stop"


async def test_stop_string_at_the_very_end(tok: Tokenizer) -> None:
    text = "All that glitters is not gold."
    chunks, stream, _ = await run_stream(tok, [*tok.encode(text), eos(tok)], stops=("gold.",))
    assert "".join(chunks) == "All that glitters is not "
    assert stream.finish_reason == "stop"


async def test_error_mid_stream_raises_generation_error(tok: Tokenizer) -> None:
    ids = tok.encode("Once upon a time there was a little robot")
    with pytest.raises(GenerationError) as caught:
        await run_stream(tok, [*ids, eos(tok)], fail_after=3)
    assert caught.value.code == "worker_lost"


async def test_error_before_first_token_raises_from_open(tok: Tokenizer) -> None:
    fake = FakeBrokerClient(
        Script([1, 2], fail_before_first=FakeBrokerError("no_capacity", "no route"))
    )
    stream = fake.generate(
        GenerateRequest(
            request_id="r", prompt=(5,), max_tokens=4, sampling=SamplingParams(), stop_ids=(2,)
        )
    )
    closed: list[bool] = []

    async def on_close() -> None:
        closed.append(True)

    text_stream = TextStream(
        stream, tok.incremental_decoder(), max_tokens=4, stop_ids=[2], on_close=on_close
    )
    with pytest.raises(GenerationError) as caught:
        await text_stream.open()
    assert (caught.value.code, caught.value.message) == ("no_capacity", "no route")
    assert closed == [True]  # open() cleaned up after itself
    assert fake.open_streams == set()


async def test_first_token_timeout(tok: Tokenizer) -> None:
    fake = FakeBrokerClient(Script([*tok.encode("slow"), eos(tok)], delay=5.0))
    stream = fake.generate(
        GenerateRequest(
            request_id="r", prompt=(5,), max_tokens=8, sampling=SamplingParams(), stop_ids=(2,)
        )
    )
    text_stream = TextStream(stream, tok.incremental_decoder(), max_tokens=8, timeout=0.05)
    # Without the timeout the first token would come after 5 s, and open() would succeed.
    with pytest.raises(GenerationError) as caught:
        await text_stream.open()
    assert caught.value.code == "timeout"
    assert fake.cancels == ["s1"]


async def test_close_before_the_end_cancels_once(tok: Tokenizer) -> None:
    fake = FakeBrokerClient(Script([*tok.encode("a b c d e f"), eos(tok)]))
    stream = fake.generate(
        GenerateRequest(
            request_id="r", prompt=(5,), max_tokens=50, sampling=SamplingParams(), stop_ids=(2,)
        )
    )
    text_stream = TextStream(stream, tok.incremental_decoder(), max_tokens=50)
    await text_stream.open()
    async for _ in text_stream.chunks():
        break
    await text_stream.close()
    await text_stream.close()
    assert fake.cancels == ["s1"]
    assert text_stream.finish_reason is None
