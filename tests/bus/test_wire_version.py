"""The protocol version moves with the wire: the message types and their fields (names,
types, payloads) are digested here, and each version has its digest. A change of the
messages without a new PROTOCOL_VERSION fails this test, saying what to do."""

from __future__ import annotations

import hashlib
import json

from zmqllm.bus.messages import MESSAGE_TYPES
from zmqllm.bus.protocol import PROTOCOL_VERSION

# PROTOCOL_VERSION -> the digest of its messages (version 1 predates this test).
# 5: speculative decoding (STEP and TOKEN draft, TOKEN more, OPEN speculative, REGISTER
# proposes).
WIRE_DIGESTS = {2: "4484fcb516eaabe2", 3: "f72e1210ab02134a", 4: "a02f5a502d4c6901"}
WIRE_DIGESTS[5] = "39e1b7036214c034"


def wire_digest() -> str:
    shape = []
    for kind, cls in sorted(MESSAGE_TYPES.items()):
        hints = cls.__annotations__
        fields = [
            [name, str(hints.get(name, "")), bool(spec.is_payload)]
            for name, spec in cls.wire_fields()
        ]
        shape.append([kind, fields])
    return hashlib.sha256(json.dumps(shape).encode()).hexdigest()[:16]


def test_the_version_names_this_wire() -> None:
    digest = wire_digest()
    known = WIRE_DIGESTS.get(PROTOCOL_VERSION)
    assert known == digest, (
        f"the messages changed (digest {digest}) but PROTOCOL_VERSION is still "
        f"{PROTOCOL_VERSION}: bump it in zmqllm/bus/protocol.py and add "
        f"{PROTOCOL_VERSION + 1}: {digest!r} to WIRE_DIGESTS"
    )
