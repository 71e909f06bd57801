"""OpenAI's ``response_format`` as a grammar for the last stage to decode with.

``json_object`` asks for any JSON object, ``json_schema`` for one following the schema it
carries; both become an llguidance grammar (JSON text) here, checked before anything is
sent: a schema llguidance cannot compile is a 400 naming what is wrong, not a session
that fails later. The last stage masks the tokens the grammar forbids before sampling.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from zmqllm.bus.sampling_params import MAX_GRAMMAR_BYTES
from zmqllm.gateway.errors import APIError
from zmqllm.gateway.schemas import ResponseFormat

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

__all__ = ["COMPACT", "grammar_of"]

COMPACT: JsonCompileOptions = {"whitespace_flexible": False}


def grammar_of(fmt: ResponseFormat | None) -> str:
    """The grammar ``fmt`` asks for; "" for free text."""
    if fmt is None or fmt.type == "text":
        return ""
    schema: Any
    if fmt.type == "json_object":
        schema = {"type": "object"}
    else:
        spec = fmt.json_schema
        if spec is None or spec.json_schema is None:
            raise _bad("response_format json_schema needs json_schema.schema")
        schema = spec.json_schema
    import llguidance  # light: no numpy, torch or transformers behind it

    try:
        # Compact JSON (", " and ": " between items, no other whitespace): free whitespace
        # lets a model pad a reply with blanks until its token budget runs out.
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=COMPACT)
        error = llguidance.LLMatcher.validate_grammar(grammar)
    except (ValueError, TypeError, RuntimeError) as exc:
        error = str(exc) or type(exc).__name__
    if error:
        raise _bad(f"response_format: the schema cannot be used: {error[:300]}")
    size = len(grammar.encode())
    if size > MAX_GRAMMAR_BYTES:
        raise _bad(
            f"response_format: the schema is {size} bytes as a grammar, "
            f"at most {MAX_GRAMMAR_BYTES} are taken"
        )
    return str(grammar)


def _bad(message: str) -> APIError:
    return APIError(400, message, param="response_format", code="invalid_value")
