"""A parameter's value written as text: which kinds of its schema are bare text and which JSON; reading it back.

As the families that write parameters as text do (Qwen3-Coder's XML, GLM's and MiniMax's tags): their own
templates write a string value as its text and any other value as JSON (``v if v is string else v | tojson``).
:func:`text_kinds` splits a schema so (a union, a list of types, no type at all may be both), the forced grammar
writes each part so, and :func:`text_value` reads the text back to what was written. One place for the rule, so the
grammar writes what the reader reads.
"""

from __future__ import annotations

import json
from typing import Any

PY_CONSTANTS: dict[str, Any] = {
    "True": True,
    "False": False,
    "None": None,
    "true": True,
    "false": False,
    "null": None,
}
"""Python's and JSON's spellings of the constants (a model writing freely uses both)."""


_ANY_JSON = ["integer", "number", "boolean", "null", "object", "array"]


def text_kinds(schema: Any) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """How a parameter of ``schema`` is written: ``(as text, as JSON)``, either None where it cannot be that.

    The family's own template writes a string value as its bare text and any other value as JSON
    (``v if v is string else v | tojson``), and so does the forced grammar: the first is the schema of the bare
    text (a string, its ``enum`` or ``maxLength`` kept), the second the schema of the JSON (the other types). A
    union (``anyOf``, ``oneOf``, a list of types, no type at all) may be both.
    """
    if schema is None:  # an argument the tool does not declare: its text, as the family's parsers keep it
        return {"type": "string"}, None
    if not isinstance(schema, dict):  # (``true``: any value)
        return {"type": "string"}, {"type": _ANY_JSON}
    for key in ("anyOf", "oneOf"):
        branches = schema.get(key)
        if isinstance(branches, list) and branches:
            split = [text_kinds(b) for b in branches]
            texts = [t for t, _ in split if t is not None]
            others = [o for _, o in split if o is not None]
            one = texts[0] if len(texts) == 1 else ({"type": "string"} if texts else None)
            return one, (others[0] if len(others) == 1 else {key: others}) if others else None
    kind = schema.get("type")
    if "enum" in schema and kind is None:
        words = [v for v in schema["enum"] if isinstance(v, str)]
        values = [v for v in schema["enum"] if not isinstance(v, str)]
        return ({"type": "string", "enum": words} if words else None), ({"enum": values} if values else None)
    if "const" in schema and kind is None:
        const = schema["const"]
        return ({"type": "string", "enum": [const]}, None) if isinstance(const, str) else (None, schema)
    kinds = [kind] if isinstance(kind, str) else list(kind) if isinstance(kind, list) else ["string", *_ANY_JSON]
    text: dict[str, Any] | None = None
    if "string" in kinds:
        text = {"type": "string", **{k: schema[k] for k in ("enum", "maxLength", "const") if k in schema}}
        if "enum" in text:
            text["enum"] = [v for v in schema["enum"] if isinstance(v, str)]
    rest = [k for k in kinds if k != "string"]
    if not rest:
        return text, None
    other: dict[str, Any] = {
        k: v for k, v in schema.items() if k not in ("type", "maxLength", "minLength", "pattern", "format")
    }
    if "enum" in other:
        other["enum"] = [v for v in schema["enum"] if not isinstance(v, str)]
    other["type"] = rest[0] if len(rest) == 1 else rest
    return text, other


def text_value(raw: str, schema: Any) -> Any:
    """A parameter's text as the value it was written for (:func:`text_kinds`).

    JSON of one of the schema's non-string kinds is that value (``3``, ``null``, ``[1, 2]``); other text is the
    string itself where the schema takes one. A value that reads as neither stays text.
    """
    text, other = text_kinds(schema)
    if other is not None:
        try:
            value = json.loads(raw.strip())
        except ValueError:  # Python's spelling (True, None) from a model writing freely, where no text is taken
            value = raw if text is not None else PY_CONSTANTS.get(raw.strip(), raw)
        if not isinstance(value, str) or text is None:
            return value
    return raw


__all__ = ["PY_CONSTANTS", "text_kinds", "text_value"]
