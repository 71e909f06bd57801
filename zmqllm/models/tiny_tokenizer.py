"""A tiny byte-level BPE tokenizer for tests and the tiny model.

It is trained on a fixed corpus, so every run writes byte-identical files. The corpus mixes
English with accented, CJK and emoji text: with a 512-entry vocabulary most multi-byte
characters stay split over several byte tokens, which is exactly what the incremental
decoder must cope with.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

PAD_TOKEN = "<|endoftext|>"
BOS_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
# Order fixes the ids: 0, 1, 2.
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN)
VOCAB_SIZE = 512
MODEL_MAX_LENGTH = 2048

# ChatML. Stored as JSON, so the "\n" below are jinja string escapes, not newlines.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unknown role: ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_CORPUS = (
    "The quick brown fox jumps over the lazy dog.",
    "A journey of a thousand miles begins with a single step.",
    "She sells sea shells by the sea shore.",
    "The rain in Spain stays mainly in the plain.",
    "To be, or not to be, that is the question.",
    "All that glitters is not gold.",
    "Hello, world! How are you today?",
    "I am fine, thank you. And you?",
    "What is the capital of France? The capital of France is Paris.",
    "Please write a short poem about the sea.",
    "The model answers questions and follows instructions.",
    "Once upon a time there was a little robot who loved to read.",
    "It was the best of times, it was the worst of times.",
    "Numbers like 1, 2, 3, 42 and 2024 appear in text too.",
    "The cat sat on the mat and looked at the moon.",
    "Water boils at 100 degrees Celsius at sea level.",
    "Tell me a story about a dragon and a knight.",
    "The sun rises in the east and sets in the west.",
    "Good morning! Did you sleep well last night?",
    "Machine learning models predict the next token.",
    "The library opens at nine and closes at five.",
    "Can you explain how a transformer works?",
    "Every token is an integer id in the vocabulary.",
    "He walked slowly down the long and winding road.",
    "Café, naïve, résumé, jalapeño, façade, Zürich, São Paulo, crème brûlée.",
    "Über den Wolken muss die Freiheit wohl grenzenlos sein.",
    "El niño comió una manzana en la mañana.",
    "Ça va très bien, merci beaucoup !",
    "Ελληνικά γράμματα και Русский язык тоже.",
    "你好，世界！今天天气很好。",
    "我喜欢学习机器学习和自然语言处理。",
    "こんにちは、元気ですか？東京は大きい都市です。",
    "안녕하세요, 만나서 반갑습니다.",
    "Emoji: 😀 🎉 🚀 👍 ❤️ 🐍 🌍 and a family 👨‍👩‍👧.",
    "The weather is ☀️ today, tomorrow 🌧️ maybe.",
)


def _train() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        # Sorted: the trainer takes a collection, and a stable order keeps the output stable.
        initial_alphabet=sorted(pre_tokenizers.ByteLevel.alphabet()),
        show_progress=False,
    )
    # Repeat the corpus a few times so frequent pairs clear min_frequency.
    tokenizer.train_from_iterator(list(_CORPUS) * 4, trainer=trainer)
    return tokenizer


def _tokenizer_config() -> dict[str, Any]:
    added = {
        str(index): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for index, content in enumerate(SPECIAL_TOKENS)
    }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "bos_token": BOS_TOKEN,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "model_max_length": MODEL_MAX_LENGTH,
        "pad_token": PAD_TOKEN,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": PAD_TOKEN,
    }


def write_tiny_tokenizer(directory: Path) -> None:
    """Write tokenizer.json and tokenizer_config.json into ``directory`` (created if needed)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = _train()
    for index, content in enumerate(SPECIAL_TOKENS):
        if tokenizer.token_to_id(content) != index:
            raise RuntimeError(f"special token {content!r} did not get id {index}")
    serialized = tokenizer.to_str(pretty=True)
    (directory / "tokenizer.json").write_text(serialized + "\n", encoding="utf-8")
    config = json.dumps(_tokenizer_config(), indent=2, ensure_ascii=False, sort_keys=True)
    (directory / "tokenizer_config.json").write_text(config + "\n", encoding="utf-8")
