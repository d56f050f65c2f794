"""Tag-shaped call bodies read in one pass (the ``tagged`` and ``xml`` body kinds of :mod:`.table`).

GLM's and Hy3's key/value tags, MiniMax's, DeepSeek DSML's and Muse Glimmer's ``<invoke>``/``<parameter>``,
Qwen3-Coder's ``<function=..>``/``<parameter=..>``.

A body is model output, so it is read in linear time: a :class:`Cursor` finds each literal with ``str.find`` from a
moving position and never looks at a character twice (no regex with lazy groups that an open without its close
makes cubic). An open without its close ends the body as an invalid call (:class:`ValueError`).

A parameter's value is its text up to its close, read as the tool's schema types it (:func:`~.values.text_value`);
where the schema takes a JSON kind the value is read as JSON first (:func:`json_value`), so that JSON holding the
close's text inside a string (an array item ``"</arg_value>"``) reads back as the JSON it is, not as its first
piece and an argument the tool never declared.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from typing import Any

from .values import text_kinds

Typed = Callable[[str, Any], Any]
"""How a value's text becomes the schema's type (:func:`.values.text_value`)."""

JSON_RETRIES = 2
"""JSON reads a body may spend that do not end at the parameter's close (each may scan the rest of the body once)."""

_DECODER = json.JSONDecoder()
_WORD_END = re.compile(r"[\s<]")


class Cursor:
    """A position in ``text`` that only moves forward."""

    def __init__(self, text: str) -> None:
        self.text, self.pos = text, 0
        self.json_retries = JSON_RETRIES

    def space(self) -> None:
        """Past whitespace."""
        n = len(self.text)
        while self.pos < n and self.text[self.pos].isspace():
            self.pos += 1

    def done(self) -> bool:
        """Whether only whitespace is left."""
        self.space()
        return self.pos >= len(self.text)

    def at(self, literal: str) -> bool:
        """Whether the text goes on with ``literal`` here (the cursor stays)."""
        pos = self.pos
        found = self.take(literal)
        self.pos = pos
        return found

    def take(self, literal: str) -> bool:
        """Past ``literal`` (whitespace in it: any whitespace, maybe none) if the text goes on with it here."""
        pos = self.pos
        for piece in literal.split():
            self.space()
            if not self.text.startswith(piece, self.pos):
                self.pos = pos
                return False
            self.pos += len(piece)
        return True

    def expect(self, literal: str, what: str) -> None:
        if not self.take(literal):
            raise ValueError(f"expected {literal.strip()!r} {what}, not {self.text[self.pos : self.pos + 40]!r}")

    def upto(self, literal: str, what: str) -> str:
        """The text up to the next ``literal`` (its first non-space piece), the cursor past it."""
        piece = literal.split()[0]
        at = self.text.find(piece, self.pos)
        if at < 0:
            raise ValueError(f"{what} without its {piece!r}")
        out, self.pos = self.text[self.pos : at], at
        self.expect(literal, f"after {what}")
        return out

    def word(self) -> str:
        """A bare name: up to whitespace or ``<``."""
        self.space()
        m = _WORD_END.search(self.text, self.pos)
        end = m.start() if m else len(self.text)
        out, self.pos = self.text[self.pos : end], end
        return out


def json_value(c: Cursor, close: str) -> tuple[Any, bool]:
    """A JSON value at the cursor that ends at ``close`` (whitespace between): ``(value, True)``, the cursor past it.

    ``(None, False)`` where none does: the cursor stays. A body spends at most :data:`JSON_RETRIES` reads that do
    not end at the close, so no body is read more than a few times over.
    """
    if c.json_retries <= 0:
        return None, False
    start = c.pos
    c.space()
    try:
        value, end = _DECODER.raw_decode(c.text, c.pos)
    except (ValueError, RecursionError):
        value, end = None, -1
    if end >= 0:
        c.pos = end
        if c.take(close):
            return value, True
    c.pos = start
    c.json_retries -= 1
    return None, False


def param_value(c: Cursor, close: str, schema: Any, typed: Typed, strip: bool, edge: str = "") -> Any:
    """One parameter's value up to ``close``, the cursor past it (``edge``: a character each side that is markup)."""
    text, other = text_kinds(schema)
    start = c.pos
    if other is not None:  # JSON first: the close's text may sit inside one of its strings
        value, whole = json_value(c, edge + close if edge else close)
        if whole and (not isinstance(value, str) or text is None):
            return value
        c.pos = start
    raw = c.upto(close, "a parameter") if not edge else _upto_edged(c, edge, close)
    return typed(raw.strip() if strip else raw, schema)


def _upto_edged(c: Cursor, edge: str, close: str) -> str:
    at = c.text.find(close, c.pos)
    if at < 0:
        raise ValueError(f"a parameter without its {close!r}")
    raw, c.pos = c.text[c.pos : at], at + len(close)
    return raw[:-1] if raw.endswith(edge) else raw


# ------------------------------------------------------------------ the tag formats


def read_tags(body_args: Mapping[str, Any], body: str, schemas: Mapping[str, Any], typed: Typed) -> list[Any]:
    """The calls of one region's ``body`` in the tags ``body_args`` describes (see :mod:`.table`).

    ``invoke``: a call's open, what ends its name (None: whitespace or ``<``; then ``sep`` may follow it) and its
    close ("" for a region that is one call); ``wrap``: a block around the calls, which a recipient and ``header``
    may open (Muse Glimmer's ``NAME<|message|><atem:function_calls>``); parameters as ``write_param`` writes them.
    """
    opening, name_end, closing = body_args["invoke"]
    sep, wrap, header = body_args.get("sep"), body_args.get("wrap"), str(body_args.get("header", ""))
    layout = _layout(body_args["write_param"])
    strip = body_args.get("strip", True)
    c = Cursor(body)
    if wrap and not c.at(opening):
        c.word()
        c.expect(header, "after the recipient")
        c.expect(wrap[0], "to open the calls")
    calls: list[Any] = []
    while not c.done():
        if wrap and c.take(wrap[1]):
            if not c.done():
                raise ValueError(f"text after the calls: {c.text[c.pos : c.pos + 40]!r}")
            break
        if opening and not c.take(opening):
            raise ValueError(f"unexpected text between calls: {c.text[c.pos : c.pos + 40]!r}")
        if name_end is None:
            name = c.word()
            if sep:
                c.take(sep)
        else:
            name = c.upto(name_end, "a call's name")
            if name_end.startswith('"') and '"' in name:
                raise ValueError(f"a call's name holds a quote: {name[:40]!r}")
        if not name.strip():
            raise ValueError("a call without a name")
        name = name.strip()
        props = (schemas.get(name) or {}).get("properties") or {}
        args: dict[str, Any] = {}
        while True:
            c.space()
            if closing and c.take(closing):
                break
            if not closing and c.done():
                break
            if not c.take(layout[0]):
                what = "between parameters" if args else "after the name"
                raise ValueError(f"unexpected text {what}: {c.text[c.pos : c.pos + 40]!r}")
            key, value = _param(c, layout, props, typed, strip)
            args[key] = value
        calls.append((name, args))
        if not opening:
            break
    if not c.done():
        raise ValueError(f"the call does not have the expected shape: {c.text[c.pos : c.pos + 40]!r}")
    return calls


def _layout(write_param: str) -> _Layout:
    """``write_param`` (slots ``{key}``, ``{string}``, ``{value}``) as: open, between, after the flag, close."""
    opening, rest = write_param.split("{key}", 1)
    between, closing = rest.split("{value}", 1)
    flagged = None
    if "{string}" in between:
        between, flagged = between.split("{string}", 1)
    return opening, between, flagged, closing.strip()


_Layout = tuple[str, str, str | None, str]


def _param(c: Cursor, layout: _Layout, props: Mapping[str, Any], typed: Typed, strip: bool) -> tuple[str, Any]:
    """One parameter after its open: its name, then its value (DeepSeek's: after its string flag)."""
    _, between, flagged, closing = layout
    key = c.upto(between, "a parameter's name")
    if between.startswith('"') and '"' in key:
        raise ValueError(f"a parameter name holds a quote: {key[:40]!r}")
    key = key.strip()
    if not key:
        raise ValueError("a parameter without a name")
    schema: Any = props.get(key)
    if flagged is not None:  # DeepSeek's string="true|false": the value's kind, said
        flag = "true" if c.take("true") else "false" if c.take("false") else None
        if flag is None:
            raise ValueError(f'expected string="true" or "false" for {key!r}')
        c.expect(flagged, f"after the string flag of {key!r}")
        if flag == "true":
            raw = c.upto(closing, "a parameter")
            return key, raw.strip() if strip else raw
        return key, param_value(c, closing, _ANY_JSON, _strict_json, strip)
    return key, param_value(c, closing, schema, typed, strip)


_ANY_JSON = {"type": ["integer", "number", "boolean", "null", "object", "array"]}
"""A value DeepSeek flags ``string="false"``: JSON, whatever its kind (a JSON string too: read as written)."""


def _strict_json(raw: str, schema: Any) -> Any:
    return json.loads(raw)


# ------------------------------------------------------------------ Qwen3-Coder's XML

_FUNCTION, _FUNCTION_END = "<function=", "</function>"
_PARAMETER, _PARAMETER_END = "<parameter=", "</parameter>"
_TAG_NAME = re.compile(r"([^>\n]{1,256})>")


def read_xml(body: str, schemas: Mapping[str, Any], typed: Typed) -> tuple[str, dict[str, Any]]:
    """``<function=NAME>`` ``<parameter=KEY>`` VALUE ``</parameter>`` ... ``</function>``: one call."""
    text = body.strip()
    if not text.startswith(_FUNCTION) or not text.endswith(_FUNCTION_END):
        raise ValueError("expected <function=NAME>...</function>")
    m = _TAG_NAME.match(text, len(_FUNCTION))
    if m is None or m.end() > len(text) - len(_FUNCTION_END):
        raise ValueError("expected <function=NAME>...</function>")
    name = m.group(1).strip()
    props = (schemas.get(name) or {}).get("properties") or {}
    c = Cursor(text[m.end() : len(text) - len(_FUNCTION_END)])
    args: dict[str, Any] = {}
    while True:  # (text between parameters is passed over, as Qwen3-Coder's own parser does)
        at = c.text.find(_PARAMETER, c.pos)
        if at < 0:
            break
        k = _TAG_NAME.match(c.text, at + len(_PARAMETER))
        if k is None:
            c.pos = at + 1
            continue
        key = k.group(1).strip()
        c.pos = k.end() + (c.text.startswith("\n", k.end()))
        try:
            args[key] = param_value(c, _PARAMETER_END, props.get(key), typed, strip=False, edge="\n")
        except ValueError:
            break  # a parameter without its close: the ones before it stand
    return name, args


__all__ = ["Cursor", "json_value", "param_value", "read_tags", "read_xml"]
