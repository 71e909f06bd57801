"""The one rule for a name that travels on the bus: a model's served name, a worker's
host, a routing id. 1 to 255 printable ASCII characters (0x21 to 0x7E), so no spaces and
nothing a log line or a header could be split by.

Settings are checked with it when they load (``config``), messages when they decode
(``bus.wire_types``), the broker's routing ids when a worker registers: one rule, so a name
a setting accepts is never refused on the wire.
"""

from __future__ import annotations

import re

__all__ = ["MAX_NAME_LEN", "NAME_RULE", "is_name"]

MAX_NAME_LEN = 255
NAME_RULE = f"1 to {MAX_NAME_LEN} printable ASCII characters without spaces"
_NAME = re.compile(rf"[\x21-\x7e]{{1,{MAX_NAME_LEN}}}")


def is_name(value: object) -> bool:
    """Whether ``value`` (a str, or bytes such as a routing id) keeps the name rule."""
    if type(value) is bytes:
        # latin-1 maps each byte to the code point of its value: the same rule on bytes.
        value = value.decode("latin-1")
    return type(value) is str and _NAME.fullmatch(value) is not None
