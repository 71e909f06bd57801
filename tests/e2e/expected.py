"""What the gateway sends for a model's tokens, to compare its answers with a reference."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

REPLACEMENT = "\ufffd"


def sent_text(tok: Any, ids: Sequence[int]) -> str:
    """The text of ``ids`` as the gateway streams it: decode's, less a character cut by
    the end (decode renders it as U+FFFD; the gateway leaves it out)."""
    return str(tok.decode(list(ids))).rstrip(REPLACEMENT)
