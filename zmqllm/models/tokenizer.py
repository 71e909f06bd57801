"""The gateway's tokenizer: Hugging Face ``tokenizers`` plus jinja2 chat templates.

It reads a model directory the way transformers does (tokenizer.json, tokenizer_config.json,
chat_template.jinja, config.json, generation_config.json) without importing torch or
transformers, and renders chat templates with the same jinja settings, so prompts match
``AutoTokenizer.apply_chat_template`` token for token.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

# The small files of a model directory that this tokenizer and the model config come
# from: what a process that runs no weights fetches from the Hub.
MODEL_FILES = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
]

# The named special tokens transformers passes to a chat template (its special_tokens_map).
_SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
_REPLACEMENT_CHAR = "\ufffd"


class ChatTemplateError(ValueError):
    """The chat template is missing, does not compile, or rejected the messages."""


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _token_content(value: Any) -> str | None:
    """A special token in tokenizer_config.json is a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _token_ids(value: Any) -> list[int]:
    """eos_token_id / bos_token_id in config files: an int, a list of ints, or null."""
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [item for item in value if isinstance(item, int) and not isinstance(item, bool)]
    return []


def _select_template(value: Any) -> str | None:
    """tokenizer_config's chat_template: a string, or a list of {name, template}."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        for entry in value:
            if isinstance(entry, dict) and entry.get("name") == "default":
                template = entry.get("template")
                return template if isinstance(template, str) else None
    return None


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson HTML-escapes; templates expect plain JSON (as transformers renders it).
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template does not compile: {exc}") from exc


class Tokenizer:
    """Encodes, decodes and renders chat prompts for one model directory."""

    def __init__(
        self,
        tokenizer: _HFTokenizer,
        *,
        chat_template: str | None = None,
        special_tokens: Mapping[str, str] | None = None,
        eos_token_ids: Iterable[int] = (),
        bos_token_id: int | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self._chat_template_source = chat_template
        self._compiled_template: jinja2.Template | None = None
        self._special_tokens = dict(special_tokens or {})
        self._eos_token_ids = frozenset(eos_token_ids)
        self._bos_token_id = bos_token_id

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        directory = Path(path)
        tokenizer = _HFTokenizer.from_file(str(directory / "tokenizer.json"))
        tok_config = _read_json(directory / "tokenizer_config.json")
        model_config = _read_json(directory / "config.json")
        gen_config = _read_json(directory / "generation_config.json")

        special_tokens: dict[str, str] = {}
        for name in _SPECIAL_TOKEN_NAMES:
            content = _token_content(tok_config.get(name))
            if content is not None:
                special_tokens[name] = content
        _register_special_tokens(tokenizer, tok_config, special_tokens.values())

        eos_ids: set[int] = set()
        eos_content = special_tokens.get("eos_token")
        if eos_content is not None and (eos_id := tokenizer.token_to_id(eos_content)) is not None:
            eos_ids.add(eos_id)
        eos_ids.update(_token_ids(gen_config.get("eos_token_id")))
        eos_ids.update(_token_ids(model_config.get("eos_token_id")))

        bos_id: int | None = None
        bos_content = special_tokens.get("bos_token")
        if bos_content is not None:
            bos_id = tokenizer.token_to_id(bos_content)
        if bos_id is None:
            candidates = _token_ids(gen_config.get("bos_token_id"))
            candidates += _token_ids(model_config.get("bos_token_id"))
            bos_id = candidates[0] if candidates else None

        # Like transformers, a chat_template.jinja file takes priority over the config entry.
        template_file = directory / "chat_template.jinja"
        if template_file.is_file():
            chat_template: str | None = template_file.read_text(encoding="utf-8")
        else:
            chat_template = _select_template(tok_config.get("chat_template"))

        return cls(
            tokenizer,
            chat_template=chat_template,
            special_tokens=special_tokens,
            eos_token_ids=eos_ids,
            bos_token_id=bos_id,
        )

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (the model's embedding may be larger)."""
        return int(self._tokenizer.get_vocab_size(with_added_tokens=True))

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos_token_ids

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def bos_token(self) -> str | None:
        return self._special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self._special_tokens.get("eos_token")

    @property
    def has_chat_template(self) -> bool:
        return self._chat_template_source is not None

    def token_to_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        # Special tokens written as text (as chat templates do) are matched as special tokens.
        # encode_batch, not encode: the same ids, but it lets go of the GIL while it works,
        # so a long prompt encoded in a thread leaves the event loop running (what a long
        # prompt takes: docs/benchmarks.md, "Figures behind the gateway's choices").
        (encoding,) = self._tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)
        return list(encoding.ids)

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """An upper bound on the bytes of text one token stands for: a text of N bytes
        is at least N / max_token_bytes tokens. (A token decoded alone may lose the space
        a SentencePiece token starts with: hence the one byte more.)"""
        size = self.vocab_size
        alone = self._tokenizer.decode_batch([[i] for i in range(size)], skip_special_tokens=False)
        return max(1, max((len(t.encode("utf-8")) for t in alone), default=0) + 1)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **template_vars: Any,
    ) -> str:
        """Render ``messages`` to the prompt string; extra keyword arguments reach the template."""
        template = self._template()
        # transformers drops None-valued keys and always defines tools/documents (templates
        # test `tools is not none`, which an undefined name would pass).
        chat = [{key: value for key, value in m.items() if value is not None} for m in messages]
        variables: dict[str, Any] = {"tools": None, "documents": None}
        variables.update(self._special_tokens)
        variables.update(template_vars)
        variables["messages"] = chat
        variables["add_generation_prompt"] = add_generation_prompt
        try:
            return template.render(**variables)
        except (jinja2.TemplateError, TypeError) as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        # The rendered prompt already holds its special tokens (BOS included) as text.
        prompt = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        return self.encode(prompt, add_special_tokens=False)

    def incremental_decoder(
        self, skip_special_tokens: bool = True, *, prompt_ids: Sequence[int] = ()
    ) -> IncrementalDecoder:
        """A streaming decoder; ``prompt_ids`` (their last few) give the first token context."""
        return IncrementalDecoder(self, skip_special_tokens, prompt_ids=prompt_ids)

    def _template(self) -> jinja2.Template:
        if self._compiled_template is None:
            if self._chat_template_source is None:
                raise ChatTemplateError(
                    "this model has no chat template (no chat_template in tokenizer_config.json "
                    "and no chat_template.jinja); use the completions endpoint instead"
                )
            self._compiled_template = _compile_template(self._chat_template_source)
        return self._compiled_template


def _register_special_tokens(
    tokenizer: _HFTokenizer, tok_config: Mapping[str, Any], named: Iterable[str]
) -> None:
    """Mark config-declared special tokens that tokenizer.json only has in its vocab.

    transformers does this on load; without it such a token written as text in a chat
    template would be split into ordinary pieces. Tokens absent from the vocab are not added:
    that would change the vocabulary the model was trained with.
    """
    contents = set(named)
    added = tok_config.get("added_tokens_decoder")
    if isinstance(added, dict):
        for entry in added.values():
            if isinstance(entry, dict) and entry.get("special") and (c := _token_content(entry)):
                contents.add(c)
    already = {token.content for token in tokenizer.get_added_tokens_decoder().values()}
    missing = sorted(
        c for c in contents if c not in already and tokenizer.token_to_id(c) is not None
    )
    if missing:
        tokenizer.add_special_tokens(missing)


class IncrementalDecoder:
    """Turns a stream of token ids into text chunks that never end in a partial character.

    The prefix/read offset scheme (as in TGI and vLLM): ``_ids[:_read]`` is text already
    emitted, kept only as context because some decoders (SentencePiece's leading-space strip,
    byte fallback) render a token differently at the start of a sequence. Each push decodes
    that short window plus the pending tokens and emits what goes beyond the context's text,
    unless the window ends in U+FFFD: then a multi-byte character is still incomplete and we
    wait. Once emitted, the pending tokens become the next context, so the window stays a few
    tokens long.
    """

    # Prompt tokens kept as context for the first generated token (vLLM uses 5 as well).
    PROMPT_CONTEXT = 5
    # A UTF-8 character spans at most 4 byte tokens; this many pending tokens still ending in
    # U+FFFD means the model produced invalid bytes, which we then emit as U+FFFD (as decode
    # does) to keep the window bounded.
    MAX_PENDING = 32

    def __init__(
        self,
        tokenizer: Tokenizer,
        skip_special_tokens: bool = True,
        *,
        prompt_ids: Sequence[int] = (),
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        tail = prompt_ids[max(0, len(prompt_ids) - self.PROMPT_CONTEXT) :]
        self._ids: list[int] = [int(token) for token in tail]
        self._read = len(self._ids)
        self._context_text = self._decode(self._ids)

    def push(self, token_id: int) -> str:
        """Add one generated token; return the text it completes (often "", never partial)."""
        self._ids.append(int(token_id))
        text = self._decode(self._ids)
        pending = len(self._ids) - self._read
        complete = len(text) > len(self._context_text) and not text.endswith(_REPLACEMENT_CHAR)
        if complete or pending >= self.MAX_PENDING:
            return self._emit(text)
        return ""

    def flush(self, drop_incomplete: bool = False) -> str:
        """Return whatever is still pending; call at end of stream. A character cut by the
        end (a token budget ran out inside it) decodes as U+FFFD: ``drop_incomplete``
        leaves it out instead."""
        if len(self._ids) == self._read:
            return ""
        chunk = self._emit(self._decode(self._ids))
        return chunk.rstrip(_REPLACEMENT_CHAR) if drop_incomplete else chunk

    def _emit(self, text: str) -> str:
        chunk = text[len(self._context_text) :]
        # The tokens just emitted are the context for the next ones.
        self._ids = self._ids[self._read :]
        self._read = len(self._ids)
        self._context_text = self._decode(self._ids)
        return chunk

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)
