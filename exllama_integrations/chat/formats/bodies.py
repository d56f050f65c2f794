"""A call region's body read into calls, one way per body kind of the table (see :mod:`.table`).

:func:`read_body` turns the text between a call's open and close into ``(name, arguments)`` pairs, or raises
(``ValueError``, ``TypeError``, ``KeyError``) where the text is not a call of that kind. What each kind reads is
what the forced-call grammar (:mod:`.grammar`) writes for it: Python keyword arguments are read by a scanner, not
by Python's parser, so that names and keys Python would not take (``from=``, ``content-type=``, ``get-weather(``)
read back as written; an XML or tagged parameter's value is read by :func:`~.values.text_value` with the same
split of its schema into text and JSON (:func:`~.values.text_kinds`) that the grammar writes it with.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Mapping
from typing import Any

from .markup import read_xml
from .table import ToolFormat
from .tagged import read_tagged
from .values import PY_CONSTANTS, text_value

Call = tuple[str, dict[str, Any]]


def read_body(fmt: ToolFormat, body: str, schemas: Mapping[str, Any]) -> list[Call]:
    """The calls in one region's ``body`` (``schemas``: each tool's parameters, by name, for XML values)."""
    kind = fmt.body
    if kind == "json":
        return [_json_call(json.loads(body), fmt)]
    if kind == "json-list":
        value = json.loads(body)
        items = value if isinstance(value, list) else [value]
        return [_json_call(v, fmt) for v in items]
    if kind == "json-seq":
        text = body.strip()
        if text.startswith("<|python_tag|>"):
            text = text[len("<|python_tag|>") :]
        return [_json_call(v, fmt) for v in _json_values(text, ";")]
    if kind == "pattern":
        m = re.match(fmt.body_args["pattern"], body, re.S)
        if m is None:
            raise ValueError(f"the call does not have the {fmt.name} shape")
        return [(m.group("name").strip(), _object(json.loads(m.group("arguments").strip() or "{}")))]
    if kind == "xml":
        return [_xml_call(body, schemas)]
    if kind == "python":
        return python_calls(body)
    if kind in ("tagged", "gemma"):
        return read_tagged(fmt.body_args, kind, body, schemas, text_value)
    raise ValueError(f"unknown body kind {kind!r}")


# ------------------------------------------------------------------ JSON


def _object(value: Any) -> dict[str, Any]:
    if isinstance(value, str):
        value = json.loads(value) if value.strip() else {}
    if not isinstance(value, dict):
        raise TypeError("the arguments must be a JSON object")
    return value


def _json_call(obj: Any, fmt: ToolFormat) -> Call:
    if not isinstance(obj, dict):
        raise TypeError("a call must be a JSON object")
    if isinstance(obj.get("function"), dict):  # {"type": "function", "function": {...}}
        obj = obj["function"]
    name = obj["name"]
    keys = fmt.body_args.get("keys", ("arguments", "parameters"))
    args: Any = next((obj[k] for k in keys if k in obj), {})
    if not isinstance(name, str) or not name:
        raise TypeError("the call's name must be a non-empty string")
    return name, _object(args)


def _json_values(text: str, sep: str) -> list[Any]:
    """JSON values one after another, separated by ``sep`` (and whitespace)."""
    decoder = json.JSONDecoder()
    out: list[Any] = []
    i = 0
    while True:
        while i < len(text) and (text[i].isspace() or text[i] == sep):
            i += 1
        if i >= len(text):
            return out
        value, i = decoder.raw_decode(text, i)
        out.append(value)


# ------------------------------------------------------------------ XML (Qwen3-Coder)


def _xml_call(body: str, schemas: Mapping[str, Any]) -> Call:
    return read_xml(body, schemas, text_value)


# ------------------------------------------------------------------ Python (Llama 4, Llama 3.2 pythonic)

_STOPS = frozenset("()[]{}=,'\"")
_OPENS, _CLOSES = "([{", ")]}"


class _Scan:
    """A cursor over a pythonic call list, for :func:`python_calls`."""

    def __init__(self, text: str) -> None:
        self.text, self.i = text, 0

    def skip(self) -> None:
        while self.i < len(self.text) and self.text[self.i].isspace():
            self.i += 1

    def eat(self, char: str) -> bool:
        self.skip()
        if self.text.startswith(char, self.i):
            self.i += len(char)
            return True
        return False

    def expect(self, char: str, what: str) -> None:
        if not self.eat(char):
            raise ValueError(f"expected {char!r} {what} at character {self.i}")

    def word(self, what: str) -> str:
        """A name or a key: everything up to a space or a delimiter (so ``from``, ``content-type``, ``météo``)."""
        self.skip()
        start = self.i
        while self.i < len(self.text) and not (self.text[self.i].isspace() or self.text[self.i] in _STOPS):
            self.i += 1
        if self.i == start:
            raise ValueError(f"expected {what} at character {start}")
        return self.text[start : self.i]

    def value(self) -> Any:
        """One literal: JSON as the grammar writes it, or Python's (single quotes, ``True``, ``None``)."""
        self.skip()
        start, depth, quote = self.i, 0, ""
        while self.i < len(self.text):
            c = self.text[self.i]
            if quote:
                if c == "\\":
                    self.i += 1
                elif c == quote:
                    quote = ""
            elif c in "'\"":
                quote = c
            elif c in _OPENS:
                depth += 1
            elif c in _CLOSES:
                if depth == 0:
                    break
                depth -= 1
            elif c == "," and depth == 0:
                break
            self.i += 1
        literal = self.text[start : self.i].strip()
        if quote or not literal:
            raise ValueError(f"expected a value at character {start}")
        return _literal_text(literal)


def _literal_text(literal: str) -> Any:
    try:
        return json.loads(literal)  # the grammar writes JSON (its \\u escapes are JSON's, not Python's)
    except ValueError:
        pass
    try:
        return _literal(ast.parse(literal, mode="eval").body)
    except SyntaxError as e:
        raise ValueError(f"{literal[:40]!r} is not a literal: {e.msg}") from None


def _literal(node: Any) -> Any:
    if isinstance(node, ast.Name) and node.id in PY_CONSTANTS:
        return PY_CONSTANTS[node.id]
    if isinstance(node, ast.List):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values)}
    return ast.literal_eval(node)


def python_calls(body: str) -> list[Call]:
    """``[f(a=1), g(b="x")]``: calls with keyword arguments, their values literals (nothing is evaluated)."""
    s = _Scan(body.strip())
    s.expect("[", "to open the list of calls")
    out: list[Call] = []
    while True:
        name = s.word("a function name")
        s.expect("(", f"after {name!r}")
        args: dict[str, Any] = {}
        while not s.eat(")"):  # (a trailing comma is Python's too)
            key = s.word("an argument name")
            s.expect("=", f"after {key!r} (arguments are given by name)")
            if key in args:
                raise ValueError(f"the argument {key!r} is given twice")
            args[key] = s.value()
            if not s.eat(","):
                s.expect(")", "or ',' after an argument")
                break
        out.append((name, args))
        if s.eat("]"):
            break
        s.expect(",", "between calls")
    s.skip()
    if s.i < len(s.text):
        raise ValueError(f"text after the list of calls: {s.text[s.i : s.i + 40]!r}")
    return out


__all__ = ["Call", "python_calls", "read_body"]
