"""Tokenizer, chat templates and incremental detokenizing (torch-free but the reference checks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from zmqllm.models.tiny_tokenizer import CHAT_TEMPLATE, write_tiny_tokenizer
from zmqllm.models.tokenizer import ChatTemplateError, IncrementalDecoder, Tokenizer

TEXTS = [
    "Hello, world! How are you today?",
    "Café naïve résumé, crème brûlée à Zürich.",
    "你好，世界！今天天气很好。机器学习",
    "こんにちは 東京",
    "Emoji 😀 🎉 🚀 👍 family 👨‍👩‍👧 done.",
    "Mixed: the 🐍 said 你好 to the café, ñ ü ø — ok?",
    "  leading spaces and\nnew lines\n\n",
]
SYSTEM_AND_USER = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France? Réponds en français 🇫🇷."},
]
USER_ONLY = [{"role": "user", "content": "Write a haiku about 東京."}]
REPLACEMENT = "\ufffd"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny_tokenizer")
    write_tiny_tokenizer(directory)
    return directory


@pytest.fixture(scope="module")
def tiny(tiny_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_dir)


def _stream(decoder: IncrementalDecoder, ids: Sequence[int]) -> list[str]:
    chunks = [decoder.push(token) for token in ids]
    chunks.append(decoder.flush())
    return chunks


# --- tiny tokenizer files ---------------------------------------------------------------


def test_tiny_tokenizer_is_deterministic(tmp_path: Path) -> None:
    write_tiny_tokenizer(tmp_path / "a")
    write_tiny_tokenizer(tmp_path / "b")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_tiny_tokenizer_files(tiny_dir: Path) -> None:
    config = json.loads((tiny_dir / "tokenizer_config.json").read_text())
    assert config["bos_token"] == "<|im_start|>"
    assert config["eos_token"] == "<|im_end|>"
    assert config["pad_token"] == config["unk_token"] == "<|endoftext|>"
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert config["add_bos_token"] is False
    assert config["chat_template"] == CHAT_TEMPLATE
    raw = HFTokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    assert raw.token_to_id("<|endoftext|>") == 0
    assert raw.token_to_id("<|im_start|>") == 1
    assert raw.token_to_id("<|im_end|>") == 2
    assert 400 <= raw.get_vocab_size() <= 512


# --- encode / decode ----------------------------------------------------------------------


def test_properties(tiny: Tokenizer) -> None:
    assert tiny.vocab_size == 512
    assert tiny.eos_token_ids == frozenset({2})
    assert tiny.bos_token_id == 1
    assert tiny.eos_token == "<|im_end|>"
    assert tiny.has_chat_template


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tiny: Tokenizer, text: str) -> None:
    ids = tiny.encode(text)
    assert ids
    assert tiny.decode(ids) == text


def test_special_tokens_in_text_are_special(tiny: Tokenizer) -> None:
    ids = tiny.encode("<|im_start|>user\nhi<|im_end|>\n")
    assert ids[0] == 1
    assert 2 in ids
    assert tiny.decode(ids) == "user\nhi\n"
    assert tiny.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>\n"
    # No post-processor template: add_special_tokens adds nothing for this tokenizer.
    assert tiny.encode("hi", add_special_tokens=True) == tiny.encode("hi")


# --- chat template --------------------------------------------------------------------------


def test_chat_template_output(tiny: Tokenizer) -> None:
    prompt = tiny.apply_chat_template(SYSTEM_AND_USER)
    assert prompt == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France? Réponds en français 🇫🇷.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_prompt = tiny.apply_chat_template(USER_ONLY, add_generation_prompt=False)
    assert no_prompt == "<|im_start|>user\nWrite a haiku about 東京.<|im_end|>\n"
    ids = tiny.encode_chat(USER_ONLY)
    assert ids[0] == 1
    assert ids[-3:] == tiny.encode("<|im_start|>assistant\n")[-3:]
    assert ids.count(1) == 2
    assert ids.count(2) == 1


def test_raise_exception_becomes_chat_template_error(tiny: Tokenizer) -> None:
    with pytest.raises(ChatTemplateError, match="Unknown role: robot"):
        tiny.apply_chat_template([{"role": "robot", "content": "beep"}])
    assert issubclass(ChatTemplateError, ValueError)


def _write_variant(src: Path, dst: Path, **changes: Any) -> dict[str, Any]:
    dst.mkdir()
    (dst / "tokenizer.json").write_bytes((src / "tokenizer.json").read_bytes())
    config = json.loads((src / "tokenizer_config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return config


def test_missing_template(tiny_dir: Path, tmp_path: Path) -> None:
    _write_variant(tiny_dir, tmp_path / "m", chat_template=None)
    tok = Tokenizer.from_dir(tmp_path / "m")
    assert not tok.has_chat_template
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.apply_chat_template(USER_ONLY)
    with pytest.raises(ChatTemplateError):
        tok.encode_chat(USER_ONLY)


def test_template_sources(tiny_dir: Path, tmp_path: Path) -> None:
    listed = [
        {"name": "tool_use", "template": "TOOLS"},
        {"name": "default", "template": "{{ bos_token }}{{ messages[0]['content'] }}"},
    ]
    _write_variant(tiny_dir, tmp_path / "list", chat_template=listed)
    assert Tokenizer.from_dir(tmp_path / "list").apply_chat_template(USER_ONLY) == (
        "<|im_start|>Write a haiku about 東京."
    )

    # A chat_template.jinja file wins over the config entry, as in transformers.
    _write_variant(tiny_dir, tmp_path / "file", chat_template=None)
    (tmp_path / "file" / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m.role }}]{{ m.content | tojson }}\n{% endfor %}"
        "{% if tools is none %}no tools{% endif %}{{ eos_token }}"
    )
    rendered = Tokenizer.from_dir(tmp_path / "file").apply_chat_template(USER_ONLY)
    assert rendered == '[user]"Write a haiku about 東京."\nno tools<|im_end|>'

    _write_variant(tiny_dir, tmp_path / "bad", chat_template="{% for m in messages %}")
    with pytest.raises(ChatTemplateError, match="compile"):
        Tokenizer.from_dir(tmp_path / "bad").apply_chat_template(USER_ONLY)


def test_special_tokens_as_dicts_and_eos_from_configs(tiny_dir: Path, tmp_path: Path) -> None:
    directory = tmp_path / "dicts"
    _write_variant(
        tiny_dir,
        directory,
        eos_token={"__type": "AddedToken", "content": "<|im_end|>", "special": True},
        bos_token={"content": "<|im_start|>"},
    )
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    (directory / "config.json").write_text(json.dumps({"eos_token_id": 5, "bos_token_id": 1}))
    tok = Tokenizer.from_dir(directory)
    assert tok.eos_token_ids == frozenset({0, 2, 5})
    assert tok.bos_token_id == 1
    assert tok.apply_chat_template(USER_ONLY).startswith("<|im_start|>user\n")


def test_bos_from_config_when_tokenizer_config_has_none(tiny_dir: Path, tmp_path: Path) -> None:
    directory = tmp_path / "nobos"
    _write_variant(tiny_dir, directory, bos_token=None)
    assert Tokenizer.from_dir(directory).bos_token_id is None
    (directory / "generation_config.json").write_text(json.dumps({"bos_token_id": 0}))
    assert Tokenizer.from_dir(directory).bos_token_id == 0


# --- incremental decoding ---------------------------------------------------------------------


def test_multibyte_characters_are_split(tiny: Tokenizer) -> None:
    split_tokens = [
        token
        for text in TEXTS
        for token in tiny.encode(text)
        if REPLACEMENT in tiny.decode([token])
    ]
    assert split_tokens, "the tiny tokenizer should split some multi-byte characters"


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_matches_decode(tiny: Tokenizer, text: str) -> None:
    ids = tiny.encode(text)
    chunks = _stream(tiny.incremental_decoder(), ids)
    assert "".join(chunks) == tiny.decode(ids) == text
    assert not any(REPLACEMENT in chunk for chunk in chunks)
    assert chunks[-1] == ""  # a complete text leaves nothing for flush


def test_incremental_waits_for_whole_characters(tiny: Tokenizer) -> None:
    ids = tiny.encode("🚀")
    assert len(ids) > 1
    decoder = tiny.incremental_decoder()
    chunks = [decoder.push(token) for token in ids]
    assert chunks[:-1] == [""] * (len(ids) - 1)
    assert chunks[-1] == "🚀"


def test_incremental_skips_special_tokens(tiny: Tokenizer) -> None:
    ids = tiny.encode("<|im_start|>assistant\nBonjour 🎉 café<|im_end|><|endoftext|>")
    chunks = _stream(tiny.incremental_decoder(), ids)
    assert "".join(chunks) == tiny.decode(ids) == "assistant\nBonjour 🎉 café"
    kept = _stream(tiny.incremental_decoder(skip_special_tokens=False), ids)
    assert "".join(kept) == tiny.decode(ids, skip_special_tokens=False)


def test_incremental_with_prompt_context(tiny: Tokenizer) -> None:
    prompt = tiny.encode_chat(USER_ONLY)
    answer = tiny.encode("Les 東京 nuits 🌍 brillent.")
    for context in (prompt, prompt[-2:], []):
        chunks = _stream(tiny.incremental_decoder(prompt_ids=context), answer)
        assert "".join(chunks) == tiny.decode(answer)
        assert not any(REPLACEMENT in chunk for chunk in chunks)


def test_flush_returns_incomplete_tail(tiny: Tokenizer) -> None:
    ids = tiny.encode("ok 🚀")[:-1]  # cut inside the emoji
    decoder = tiny.incremental_decoder()
    pushed = "".join(decoder.push(token) for token in ids)
    tail = decoder.flush()
    assert tail.endswith(REPLACEMENT)
    assert pushed + tail == tiny.decode(ids)
    assert decoder.flush() == ""


def test_flush_can_leave_a_cut_character_out(tiny: Tokenizer) -> None:
    ids = tiny.encode("ok 🚀")[:-1]  # cut inside the emoji
    decoder = tiny.incremental_decoder()
    pushed = "".join(decoder.push(token) for token in ids)
    tail = decoder.flush(drop_incomplete=True)
    assert REPLACEMENT not in tail
    assert pushed + tail == tiny.decode(ids).rstrip(REPLACEMENT)


def test_incremental_window_is_bounded(tiny: Tokenizer) -> None:
    text = " ".join(TEXTS) * 5
    ids = tiny.encode(text)
    decoder = tiny.incremental_decoder()
    lengths: list[int] = []
    real_decode = tiny.decode

    def spy(window: Sequence[int], skip_special_tokens: bool = True) -> str:
        lengths.append(len(window))
        return real_decode(window, skip_special_tokens)

    decoder._tokenizer = _SpyTokenizer(tiny, spy)  # type: ignore[assignment]
    assert "".join(_stream(decoder, ids)) == text
    assert len(ids) > 500
    assert max(lengths) <= 12


class _SpyTokenizer:
    def __init__(self, inner: Tokenizer, decode: Any) -> None:
        self.inner = inner
        self.decode = decode


def test_invalid_bytes_do_not_grow_the_window(tiny: Tokenizer) -> None:
    # A byte-level token that is a lone UTF-8 continuation byte never completes a character.
    stray = next(t for t in range(3, tiny.vocab_size) if tiny.decode([t]) == REPLACEMENT)
    ids = [stray] * (3 * IncrementalDecoder.MAX_PENDING)
    decoder = tiny.incremental_decoder()
    chunks = _stream(decoder, ids)
    assert "".join(chunks) == tiny.decode(ids)
    assert sum(1 for chunk in chunks if chunk) >= 3


def _write_sentencepiece_style(directory: Path) -> None:
    """A Llama/Mistral-style tokenizer: Metaspace, byte fallback, leading-space strip."""
    corpus = [text for text in TEXTS if text.isascii()] + [
        "the quick brown fox jumps over the lazy dog",
        "hello there, general kenobi",
    ]
    trainer = trainers.BpeTrainer(
        vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    base = HFTokenizer(models.BPE(unk_token="<unk>"))
    base.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
    base.train_from_iterator(corpus * 3, trainer=trainer)
    spec = json.loads(base.to_str())
    vocab: dict[str, int] = spec["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    spec["decoder"] = json.loads(
        decoders.Sequence(
            [
                decoders.Replace("▁", " "),
                decoders.ByteFallback(),
                decoders.Fuse(),
                decoders.Strip(" ", 1, 0),
            ]
        ).__getstate__()
    )
    directory.mkdir()
    (directory / "tokenizer.json").write_text(json.dumps(spec))
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def test_incremental_sentencepiece_style(tmp_path: Path) -> None:
    _write_sentencepiece_style(tmp_path / "sp")
    tok = Tokenizer.from_dir(tmp_path / "sp")
    assert tok.eos_token_ids == frozenset({2})
    for text in TEXTS:
        ids = tok.encode(text)
        assert any(REPLACEMENT in tok.decode([token]) for token in ids) or text.isascii()
        chunks = _stream(tok.incremental_decoder(), ids)
        assert "".join(chunks) == tok.decode(ids)
        assert not any(REPLACEMENT in chunk for chunk in chunks)
    # With the prompt as context the first token keeps its leading space.
    prompt = tok.encode("hello there")
    answer = tok.encode("general kenobi")
    streamed = "".join(_stream(tok.incremental_decoder(prompt_ids=prompt), answer))
    assert streamed == tok.decode(prompt + answer)[len(tok.decode(prompt)) :]


# --- reference: transformers ----------------------------------------------------------------


def _reference_checks(directory: Path) -> None:
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoTokenizer.from_pretrained(str(directory))
    ours = Tokenizer.from_dir(directory)
    for messages in (SYSTEM_AND_USER, USER_ONLY):
        for add_generation_prompt in (True, False):
            expected_text = reference.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
            expected_ids = reference.apply_chat_template(
                messages,
                tokenize=True,
                add_generation_prompt=add_generation_prompt,
                return_dict=False,
            )
            assert ours.apply_chat_template(messages, add_generation_prompt) == expected_text
            assert ours.encode_chat(messages, add_generation_prompt) == list(expected_ids)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == reference.encode(text, add_special_tokens=False)
        if not getattr(reference, "clean_up_tokenization_spaces", False):
            assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)
    assert reference.eos_token_id in ours.eos_token_ids
    assert ours.vocab_size == len(reference)


@pytest.mark.torch
def test_reference_tiny(tiny_dir: Path) -> None:
    _reference_checks(tiny_dir)


# Multi-line, whitespace-sensitive, with namespace/loop controls/tojson: checks that our jinja
# settings (trim_blocks, lstrip_blocks, globals) render like transformers'.
_RICH_TEMPLATE = """{{ bos_token }}
{% set ns = namespace(system='') %}
{% for message in messages %}
    {% if message['role'] == 'system' %}
        {% set ns.system = message['content'] %}
        {% continue %}
    {% endif %}
    {% if message['role'] == 'user' %}
        {% if loop.last and ns.system %}
[SYS]{{ ns.system | tojson }}[/SYS]
        {% endif %}
[INST] {{ message['content'] | trim }} [/INST]
    {% elif message['role'] == 'assistant' %}
{{ message['content'] }}{{ eos_token }}
    {% else %}
        {{ raise_exception('roles must be user/assistant/system') }}
    {% endif %}
{% endfor %}
{% if tools is not none %}TOOLS{% endif %}
{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


@pytest.mark.torch
def test_reference_rich_template(tiny_dir: Path, tmp_path: Path) -> None:
    _write_variant(tiny_dir, tmp_path / "rich", chat_template=_RICH_TEMPLATE)
    _reference_checks(tmp_path / "rich")
    conversation = [
        *SYSTEM_AND_USER,
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "  And of Japan?  "},
    ]
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "rich"))
    ours = Tokenizer.from_dir(tmp_path / "rich")
    expected = reference.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=True
    )
    assert ours.apply_chat_template(conversation) == expected
    assert "[SYS]" in expected and "TOOLS" not in expected


@pytest.mark.torch
def test_reference_default_model() -> None:
    location = os.environ.get("ZMQLLM_DEFAULT_MODEL_DIR")
    if not location or not Path(location).is_dir():
        pytest.skip("ZMQLLM_DEFAULT_MODEL_DIR does not point to a directory")
    _reference_checks(Path(location))
    tok = Tokenizer.from_dir(location)
    for text in TEXTS:
        ids = tok.encode(text)
        assert "".join(_stream(tok.incremental_decoder(), ids)) == tok.decode(ids)


def test_front_end_modules_do_not_import_the_ml_stack() -> None:
    # The gateway installs without torch: these modules must not pull it in.
    code = (
        "import sys, zmqllm.models.tokenizer, zmqllm.models.tiny_tokenizer; "
        "import zmqllm.engine.sampling; "
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"


LONG_TEXTS = [
    " " * 5000,
    "\n" * 3000 + "x",
    "\n" + " " * 4000,
    "aaaa" * 2000,
    "héllo wörld ✓ " * 500,
    "<|im_start|>" * 300,
    "def f():\n        return 1\n" * 300,
]


def test_max_token_bytes_bounds_any_text(tiny: Tokenizer) -> None:
    """No token stands for more bytes than max_token_bytes: the gateway refuses a prompt
    by its size on that promise. Checked on the runs of one character the longest tokens
    are made of, and on the default model's tokenizer where this machine has it."""
    tokenizers = [tiny]
    default = Path.home() / ".cache" / "zmqllm" / "models" / "smollm2-135m-instruct"
    if (default / "tokenizer.json").is_file():
        tokenizers.append(Tokenizer.from_dir(default))
    for tok in tokenizers:
        assert tok.max_token_bytes >= 2
        for text in LONG_TEXTS:
            ids = tok.encode(text)
            assert len(text.encode("utf-8")) <= len(ids) * tok.max_token_bytes, text[:20]


def test_encode_leaves_other_threads_running(tiny: Tokenizer) -> None:
    """A long prompt encoded in a thread does not hold the GIL: the gateway's event loop
    (here a thread counting its own wake-ups) keeps running meanwhile."""
    import threading
    import time

    text = "The quick brown fox jumps over the lazy dog. " * 40_000  # 1.8 MB
    ticks = 0
    done = threading.Event()

    def tick() -> None:
        nonlocal ticks
        while not done.is_set():
            time.sleep(0.001)
            ticks += 1

    ticker = threading.Thread(target=tick)
    ticker.start()
    try:
        before = ticks
        tiny.encode(text)
        during = ticks - before
    finally:
        done.set()
        ticker.join()
    # Holding the GIL (Tokenizer.encode through the library's encode), the ticker counts
    # a handful of times at most, at the edges (3 in seconds, on the machine it was tried
    # on); letting go of it, it counts on all the while the encode works (thousands).
    assert during >= 50, during
