"""Log-probabilities in OpenAI's two shapes, from what the last stage sends with each
token: the sampled token's log-probability first, then the most likely tokens'.

Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``.
Completions: ``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}],
"text_offset"}``. A token's text is its own decoding (a piece of a character that spans
tokens decodes as U+FFFD; its ``bytes`` are those of that text).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from zmqllm.models.tokenizer import Tokenizer

__all__ = ["Entry", "chat_logprobs", "completion_logprobs"]

# (sampled token, ids, log-probabilities): ids[0] is the sampled token, the rest the most
# likely tokens, most likely first.
Entry = tuple[int, tuple[int, ...], tuple[float, ...]]


def _text(tok: Tokenizer, token: int) -> str:
    return tok.decode([token], skip_special_tokens=False)


def _one(tok: Tokenizer, token: int, logprob: float) -> dict[str, Any]:
    text = _text(tok, token)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(tok: Tokenizer, entries: Sequence[Entry], top: int) -> dict[str, Any]:
    content = []
    for token, ids, values in entries:
        item = _one(tok, token, values[0])
        item["top_logprobs"] = [
            _one(tok, i, v) for i, v in zip(ids[1 : 1 + top], values[1 : 1 + top], strict=True)
        ]
        content.append(item)
    return {"content": content}


def completion_logprobs(
    tok: Tokenizer, entries: Sequence[Entry], top: int, offset: int
) -> tuple[dict[str, Any], int]:
    """The completions shape, tokens' text offsets counted from ``offset`` (the characters
    of this choice's text already sent); returns it and the offset after these tokens."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for token, ids, values in entries:
        text = _text(tok, token)
        tokens.append(text)
        token_logprobs.append(values[0])
        best: dict[str, float] = {}
        for i, v in zip(ids[1 : 1 + top], values[1 : 1 + top], strict=True):
            best.setdefault(_text(tok, i), v)  # tokens that decode alike: the likeliest
        tops.append(best)
        offsets.append(offset)
        offset += len(text)
    shape = {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": tops,
        "text_offset": offsets,
    }
    return shape, offset
