"""Tag-shaped call bodies (GLM-4.5, MiniMax-M2, DeepSeek DSML) and Gemma 4's argument syntax: read and written.

Two body kinds of :mod:`.table`, described by each entry's ``body_args``:

- ``tagged``: read by :mod:`.markup` in one pass (several calls in one region where the family writes them so:
  MiniMax's ``<invoke>``s inside one ``<minimax:tool_call>``); a value is read as the tool's schema types it (the
  reader's ``typed``), or as DeepSeek's ``string="true|false"`` says. Written with ``write_param`` (slots ``{key}``,
  ``{value}``, ``{string}``) for each argument.
- ``gemma``: ``call:NAME{key:value,...}`` where strings sit between ``<|"|>`` tokens, keys are bare and other values
  are JSON's; written with keys in sorted order, as Gemma 4's template writes them; :class:`GemmaJson` turns them
  into JSON as they are written (what a forced call streams).

Only what the table cannot say as data lives here; the reader (:mod:`.reader`) and the grammar (:mod:`.grammar`)
call in for these two kinds.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any, Protocol

from .markup import Typed, read_tags
from .values import text_kinds

GEMMA_QUOTE = '<|"|>'
"""Gemma 4's string delimiter (one token of its vocabulary)."""

_GEMMA_STRING = re.compile(r'<\|"\|>(.*?)<\|"\|>|"((?:[^"\\]|\\.)*)"', re.S)
_GEMMA_KEY = re.compile(r"([{,]\s*)([^\s{}\[\],:\"\x00]+)\s*:")  # a bare key (strings are set aside first)


def read_tagged(
    body_args: Mapping[str, Any], kind: str, body: str, schemas: Mapping[str, Any], typed: Typed
) -> list[tuple[str, dict[str, Any]]]:
    """The calls of one region's ``body`` (``kind`` ``tagged`` or ``gemma``); ValueError where it is not that shape."""
    if kind == "tagged":
        return read_tags(body_args, body, schemas, typed)
    m = re.match(body_args["call"], body, re.S)  # (anchored at both ends: read once)
    if m is None:
        raise ValueError(f"the call does not have the expected shape: {body[:40]!r}")
    name = m.group("name").strip()
    return [(name, gemma_object(m.group("params")))]


def gemma_object(text: str) -> dict[str, Any]:
    """``{key:<|"|>text<|"|>,n:3}`` (Gemma 4's arguments) as a dict; ValueError where it does not read."""
    strings: list[str] = []

    def keep(m: re.Match[str]) -> str:
        strings.append(m.group(1) if m.group(1) is not None else json.loads(f'"{m.group(2)}"'))
        return f"\x00{len(strings) - 1}\x00"

    protected = _GEMMA_STRING.sub(keep, text.strip())
    if not protected.startswith("{"):
        raise ValueError("Gemma arguments must be an object {...}")
    quoted = _GEMMA_KEY.sub(lambda m: f'{m.group(1)}"{m.group(2)}":', protected)
    restored = re.sub("\x00(\\d+)\x00", lambda m: json.dumps(strings[int(m.group(1))]), quoted)
    value = json.loads(restored)
    if not isinstance(value, dict):
        raise TypeError("the arguments must be an object")
    return value


def gemma_value(value: Any) -> str:
    """One argument value as Gemma 4 writes it."""
    if isinstance(value, str):
        return GEMMA_QUOTE + value + GEMMA_QUOTE
    if isinstance(value, Mapping):
        return "{" + ",".join(f"{k}:{gemma_value(v)}" for k, v in sorted(value.items())) + "}"
    if isinstance(value, list | tuple):
        return "[" + ",".join(gemma_value(v) for v in value) + "]"
    return json.dumps(value)


class GemmaJson:
    """Gemma 4's arguments read as they come, written out as JSON.

    A bare key is quoted once whole (``"key": ``), a string between ``<|"|>`` tokens escaped as it comes, the rest
    (numbers, JSON strings, brackets) as written.
    """

    def __init__(self) -> None:
        self._stack: list[str] = []  # the containers open
        self._key = False  # a key comes next
        self._string = ""  # inside a string: "gemma" (between quote tokens) or "json"
        self._escape = False

    def feed(self, text: str, at: int) -> tuple[int, str, str]:
        """``text`` from ``at`` on (it begins with ``{``).

        Returns where reading stopped, the JSON text it makes, and ``"done"`` (the object closed), ``"lost"`` (not
        these arguments) or ``""`` (more to come).
        """
        i, pieces = at, []
        while i < len(text):
            if self._string == "gemma":  # raw text up to the closing quote token
                j = text.find(GEMMA_QUOTE, i)
                upto = j if j >= 0 else len(text) - _held(text, GEMMA_QUOTE)
                pieces.append(json.dumps(text[i:upto], ensure_ascii=False)[1:-1])
                if j < 0:
                    return upto, "".join(pieces), ""
                pieces.append('"')
                i, self._string = j + len(GEMMA_QUOTE), ""
                continue
            c = text[i]
            if self._string == "json":  # a JSON string, as it is
                pieces.append(c)
                i += 1
                if self._escape:
                    self._escape = False
                elif c == "\\":
                    self._escape = True
                elif c == '"':
                    self._string = ""
                continue
            if text.startswith(GEMMA_QUOTE, i):
                pieces.append('"')
                i, self._string, self._key = i + len(GEMMA_QUOTE), "gemma", False
                continue
            if len(text) - i < len(GEMMA_QUOTE) and GEMMA_QUOTE.startswith(text[i:]):
                break  # may be the quote token yet
            if self._key and not c.isspace() and c not in '}"':
                colon = text.find(":", i)
                if colon < 0:
                    return i, "".join(pieces), "lost" if len(text) - i > 512 else ""
                pieces.append(json.dumps(text[i:colon].strip(), ensure_ascii=False) + ": ")
                i, self._key = colon + 1, False
                continue
            pieces.append(", " if c == "," else c)  # (spaced as json.dumps spaces it)
            i += 1
            if c == '"':
                self._string, self._key = "json", False
            elif c in "{[":
                self._stack.append(c)
                self._key = c == "{"
            elif c in "}]" and self._stack:
                self._stack.pop()
                if not self._stack:
                    return i, "".join(pieces), "done"
            elif c == ",":
                self._key = self._stack[-1:] == ["{"]
        return i, "".join(pieces), ""


def _held(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` may begin ``marker``."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def write_slots(body_args: Mapping[str, Any], arguments: Mapping[str, Any]) -> dict[str, str]:
    """The ``{tagged_parameters}`` and ``{gemma_arguments}`` slots of a call with these arguments."""
    template = body_args.get("write_param", "")
    tagged = "".join(
        template.format(
            key=k,
            value=v if isinstance(v, str) else json.dumps(v, ensure_ascii=False),
            string="true" if isinstance(v, str) else "false",
        )
        for k, v in arguments.items()
    )
    gemma = "{" + ",".join(f"{k}:{gemma_value(v)}" for k, v in sorted(arguments.items())) + "}"
    return {"tagged_parameters": tagged, "gemma_arguments": gemma}


SLOTS = ("tagged_parameters", "gemma_arguments")
"""The call-text slots this module fills (see :func:`write_slots` and :func:`slot_rule`)."""


class Builder(Protocol):
    """What :func:`slot_rule` needs of the grammar builder."""

    rules: list[str]

    def lit(self, text: str) -> str: ...

    def json_rule(self, rule: str, schema: Any) -> str: ...

    def text_rule(self, rule: str, schema: Mapping[str, Any], trimmed: bool = False) -> str: ...


def slot_rule(g: Builder, body_args: Mapping[str, Any], slot: str, rule: str, params: Mapping[str, Any]) -> str:
    """Lark for the arguments slot ``slot``: each property written as the family writes it, required first."""
    props: Mapping[str, Any] = params.get("properties") or {}
    required = set(params.get("required") or ())
    names = [k for k in props if k in required] + [k for k in props if k not in required]
    if slot == "gemma_arguments":
        names = sorted(names)  # Gemma's template writes keys in sorted order
    items = []
    for j, key in enumerate(names):
        text, other = text_kinds(props[key])  # a string as text, the rest as JSON (the reader reads it so)
        if slot == "gemma_arguments":
            quote = g.lit(GEMMA_QUOTE)
            alternatives = [f"{quote} {g.text_rule(f'{rule}_{j}_text', text)} {quote}"] if text is not None else []
            if other is not None:
                alternatives.append(g.json_rule(f"{rule}_{j}_json", other))
            items.append((f"{json.dumps(key + ':')} ({' | '.join(alternatives)})", key in required))
            continue
        before, after = body_args["write_param"].split("{value}")
        alternatives = []
        if text is not None:  # (the reader strips a value: the text neither begins nor ends with a space)
            value = g.text_rule(f"{rule}_{j}_text", text, trimmed=True)
            alternatives.append(_param(g, before, after, key, "true", value))
        if other is not None:
            alternatives.append(_param(g, before, after, key, "false", g.json_rule(f"{rule}_{j}_json", other)))
        items.append((f"({' | '.join(alternatives)})", key in required))
    if slot == "gemma_arguments":
        return _gemma_sequence(g, rule, items)
    seq = " ".join(item if req else f"({item})?" for item, req in items)
    g.rules.append(f"{rule}: {seq or chr(34) * 2}")
    return rule


def _param(g: Builder, before: str, after: str, key: str, string: str, value: str) -> str:
    """One parameter as lark: its opening (with ``string`` where the family says a value's kind), value, closing."""
    pieces = [g.lit(before.format(key=key, string=string)), value, g.lit(after.format(key=key, string=string))]
    return " ".join(p for p in pieces if p)


def _gemma_sequence(g: Builder, rule: str, items: list[tuple[str, bool]]) -> str:
    """``{`` items joined by ``,`` ``}`` in their (sorted) order: each required one present, an optional one or not."""
    needed = [any(req for _, req in items[j:]) for j in range(len(items) + 1)]  # a required item at j or after
    for j in reversed(range(len(items))):  # {rule}_from{j}: the items from j on, at least one of them
        item, req = items[j]
        later = f"{rule}_from{j + 1}" if j + 1 < len(items) else None
        body = item if later is None else f'{item} "," {later}' if needed[j + 1] else f'{item} ("," {later})?'
        if not req and later is not None:
            body += f" | {later}"
        g.rules.append(f"{rule}_from{j}: {body}")
    inner = f"{rule}_from0" if needed[0] else f"({rule}_from0)?"
    g.rules.append(f'{rule}: "{{" {inner} "}}"' if items else f'{rule}: "{{}}"')
    return rule


__all__ = [
    "GEMMA_QUOTE",
    "SLOTS",
    "GemmaJson",
    "gemma_object",
    "gemma_value",
    "read_tagged",
    "slot_rule",
    "write_slots",
]
