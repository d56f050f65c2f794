"""A reply's calls as the model writes them: each call's name once it is whole, its arguments as JSON as they come.

:class:`CallProgress` follows the table entry's ``call`` text (``P {name} L {arguments} S``, the arguments a JSON
object, Python keyword arguments or XML parameters) through a reply, fed the same text as the reader. It is what
lets a forced call's arguments stream as they are generated (the grammar writes the call exactly so), and what a
call cut short by ``max_tokens`` keeps of its arguments instead of its markup. Python and XML arguments come out as
JSON: a key and its separator when the key is whole, a JSON value as it is written, an XML string escaped as it is
written, any other XML value when its parameter closes. A reply that leaves the call's shape stops being followed
(the reader still reads it); nothing here raises on what a model writes.

:func:`partial_object` reads a cut JSON object as far as it got (Anthropic's clients show a cut tool input so).
"""

from __future__ import annotations

import json
import re
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .table import ToolFormat
from .values import text_kinds, text_value

_LONGEST_NAME = 512
_PARAM_OPEN, _PARAM_CLOSE, _FUNCTION_CLOSE = "<parameter=", "</parameter>", "</function>"
_SHAPES = (("name", "arguments"), ("name_json", "arguments"), ("name", "xml_parameters"), ("name", "python_arguments"))
"""The call texts followed: a name, then its arguments (the table's slots)."""


@dataclass
class Progress:
    """One call as written so far."""

    name: str
    arguments: str = ""
    """Its arguments as JSON text so far (whole once ``done``)."""
    done: bool = False


def _pattern(literal: str) -> re.Pattern[str]:
    """``literal`` as a regex in which a run of whitespace is any whitespace (a model writing freely)."""
    return re.compile(r"\s*".join(re.escape(p) for p in re.split(r"\s+", literal)))


def _escaped(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)[1:-1]


class CallProgress:
    """Follows one reply of ``fmt`` (see the module docstring): :meth:`feed` text, read :attr:`calls`."""

    def __init__(self, fmt: ToolFormat, tools: Sequence[Mapping[str, Any]] = ()) -> None:
        self.calls: list[Progress] = []
        self._schemas = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools}
        self._text, self._pos, self._state = "", 0, "lost"
        self._name_at = self._depth = self._keys = self._sent = 0
        self._value_at = -1
        self._quote = self._escape = self._bare = False
        self._schema: Any = None
        self._kind = ""
        literals, slots = [""], []  # the text before each slot ("{{" is a literal brace)
        for literal, slot, _, _ in string.Formatter().parse(fmt.call):
            literals[-1] += literal
            if slot is not None:
                slots.append(slot)
                literals.append("")
        if tuple(slots[:2]) not in _SHAPES:
            return  # a call text of another shape: not followed
        head, between = literals[0], literals[1]
        opens = [i for i in (head.find(o) for o in fmt.opens) if i >= 0]
        head = head[min(opens) :] if opens else head  # what comes before the open may be in the prompt already
        # with no text before the name (pythonic) the name follows the list's opening, or the separator
        self._heads = [head] if head.strip() else [fmt.before, fmt.between]
        self._anchored = not head.strip()
        self._between = _pattern(between)
        self._json_name = slots[0] == "name_json"
        self._kind = slots[1]
        self._state = "seek"

    @property
    def follows(self) -> bool:
        """Whether this format's calls are followed at all.

        A call text of another shape (the tagged and Gemma formats' among them) is not: such a call comes whole,
        when the reader has read it.
        """
        return bool(self._kind)

    @property
    def open(self) -> Progress | None:
        """The call being written, if one is."""
        return self.calls[-1] if self.calls and not self.calls[-1].done else None

    def feed(self, text: str) -> list[tuple[int, str]]:
        """Take more reply text; return ``(call index, new argument text)`` pieces (a call's first may be "")."""
        if self._state == "lost":
            return []
        self._text += text
        out: list[tuple[int, str]] = []
        while self._state != "lost" and getattr(self, f"_{self._state}")(out):
            pass
        return _joined(out)

    # ------------------------------------------------------------------ a call's start and name

    def _seek(self, out: list[tuple[int, str]]) -> bool:
        literal = self._heads[min(len(self.calls), len(self._heads) - 1)]
        if not literal.strip():
            self._state, self._name_at = "name", self._pos
            return True
        pattern = _pattern(literal)
        if self._anchored:  # right where the last call ended (or the reply began)
            body = self._text[self._pos :].lstrip()
            m = pattern.match(self._text, len(self._text) - len(body))
            if m is None:
                if body and not literal.strip().startswith(body[: len(literal.strip())]):
                    self._state = "lost"
                return False
        else:
            m = pattern.search(self._text, self._pos)
            if m is None:
                self._pos = max(self._pos, len(self._text) - 4 * len(literal) - 64)
                return False
        self._pos = self._name_at = m.end()
        self._state = "name"
        return True

    def _name(self, out: list[tuple[int, str]]) -> bool:
        m = self._between.search(self._text, self._name_at)
        if m is None:
            if len(self._text) - self._name_at > _LONGEST_NAME:
                self._state = "lost"
            return False
        raw = self._text[self._name_at : m.start()]
        try:
            name = json.loads(raw) if self._json_name else raw.strip()
        except ValueError:
            name = None
        if not isinstance(name, str) or not name:
            self._state = "lost"
            return False
        self.calls.append(Progress(name))
        out.append((len(self.calls) - 1, ""))
        self._pos, self._state = m.end(), self._kind
        self._depth, self._quote, self._escape, self._keys, self._value_at = 0, False, False, 0, -1
        if self._kind == "python_arguments":
            self._emit(out, "{")
        return True

    def _emit(self, out: list[tuple[int, str]], text: str) -> None:
        self.calls[-1].arguments += text
        out.append((len(self.calls) - 1, text))

    def _done(self) -> bool:
        self.calls[-1].done = True
        self._state = "seek"
        return True

    # ------------------------------------------------------------------ arguments

    def _scan(self, stops: str) -> int | None:
        """JSON from the cursor: where it ends, or None where it has not yet.

        ``stops`` empty: just after its outermost container closes; else at the first of ``stops`` outside strings
        and containers.
        """
        text, i = self._text, self._pos
        while i < len(text):
            c = text[i]
            if self._quote:
                if self._escape:
                    self._escape = False
                elif c == "\\":
                    self._escape = True
                elif c == '"':
                    self._quote = False
            elif c == '"':
                self._quote = True
            elif c in "[{":
                self._depth += 1
            elif c in "]}" and self._depth > 0:
                self._depth -= 1
                if self._depth == 0 and not stops:
                    return i + 1
            elif c in stops and self._depth == 0:
                return i
            i += 1
        return None

    def _arguments(self, out: list[tuple[int, str]]) -> bool:
        """A JSON object, every character of it as it comes."""
        if self._depth == 0:  # not begun yet: it begins with "{"
            body = self._text[self._pos :].lstrip()
            if not body:
                return False
            if body[0] != "{":
                self._state = "lost"
                return False
            self._pos = len(self._text) - len(body)
        start = self._pos
        end = self._scan("")
        self._pos = len(self._text) if end is None else end
        if self._pos > start:
            self._emit(out, self._text[start : self._pos])
        return self._done() if end is not None else False

    def _python_arguments(self, out: list[tuple[int, str]]) -> bool:
        """``K=V, ...)``: each key when whole, each value (JSON, as the grammar writes it) as it comes."""
        if self._value_at < 0:
            body = self._text[self._pos :].lstrip()
            if self._keys and body.startswith(","):
                body = body[1:].lstrip()
            if not body:
                return False
            self._pos = len(self._text) - len(body)
            if body[0] == ")":
                self._emit(out, "}")
                self._pos += 1
                return self._done()
            eq = body.find("=")
            if eq < 0:
                if len(body) > _LONGEST_NAME:
                    self._state = "lost"
                return False
            self._emit(out, (", " if self._keys else "") + json.dumps(body[:eq].strip(), ensure_ascii=False) + ": ")
            self._keys += 1
            self._pos += eq + 1
            self._value_at = self._pos
            return True
        if self._pos == self._value_at:  # a value's leading spaces are not written out
            body = self._text[self._pos :].lstrip()
            self._pos = self._value_at = len(self._text) - len(body)
        start = self._pos
        end = self._scan(",)")
        self._pos = len(self._text) if end is None else end
        if self._pos > start:
            self._emit(out, self._text[start : self._pos])
        if end is None:
            return False
        self._value_at, self._depth, self._quote = -1, 0, False
        if self._text[end] == ")":
            self._emit(out, "}")
            self._pos = end + 1
            return self._done()
        return True

    def _xml_parameters(self, out: list[tuple[int, str]]) -> bool:
        """``<parameter=K>`` V ``</parameter>`` items, then ``</function>`` (V as :func:`~.values.text_value` reads)."""
        if self._value_at < 0:
            body = self._text[self._pos :].lstrip()
            at = len(self._text) - len(body)
            if body.startswith(_FUNCTION_CLOSE):
                self._emit(out, "}" if self._keys else "{}")
                self._pos = at + len(_FUNCTION_CLOSE)
                return self._done()
            if not body.startswith(_PARAM_OPEN):
                if body and not (_PARAM_OPEN.startswith(body) or _FUNCTION_CLOSE.startswith(body)):
                    self._state = "lost"
                return False
            close = body.find(">")
            if close < 0 or close + 1 == len(body):  # (the newline after it decides where the value begins)
                return False
            key = body[len(_PARAM_OPEN) : close].strip()
            self._pos = at + close + 1 + (body[close + 1] == "\n")
            self._schema = ((self._schemas.get(self.calls[-1].name) or {}).get("properties") or {}).get(key)
            self._bare = text_kinds(self._schema)[1] is None  # a string for sure: streamed as it comes
            self._emit(out, ("{" if not self._keys else ", ") + json.dumps(key, ensure_ascii=False) + ": ")
            if self._bare:
                self._emit(out, '"')
            self._keys += 1
            self._value_at = self._sent = self._pos
            return True
        close = self._text.find(_PARAM_CLOSE, self._value_at)
        if close < 0:
            if self._bare:
                upto = len(self._text) - _held(self._text, "\n" + _PARAM_CLOSE)
                if upto > self._sent:
                    self._emit(out, _escaped(self._text[self._sent : upto]))
                    self._sent = upto
            return False
        raw = self._text[self._value_at : close]
        raw = raw[:-1] if raw.endswith("\n") else raw
        if self._bare:
            self._emit(out, _escaped(raw[self._sent - self._value_at :]) + '"')
        else:
            self._emit(out, json.dumps(text_value(raw, self._schema), ensure_ascii=False))
        self._pos, self._value_at = close + len(_PARAM_CLOSE), -1
        return True


def _held(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` may begin ``marker``."""
    for k in range(min(len(text), len(marker)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def _joined(pieces: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """Consecutive pieces of one call as one (a call's first, empty piece kept: it announces the call)."""
    out: list[tuple[int, str]] = []
    for i, piece in pieces:
        if out and out[-1][0] == i and out[-1][1] and piece:
            out[-1] = (i, out[-1][1] + piece)
        elif not (out and out[-1][0] == i and not piece):
            out.append((i, piece))
    return out


def partial_object(text: str) -> dict[str, Any]:
    """The JSON object a cut ``text`` begins, as far as it got (``{}`` where nothing reads).

    Open strings and containers are closed; an unfinished key or value is left out.
    """
    for candidate in _closings(text):
        try:
            value = json.loads(candidate)
        except ValueError:
            continue
        return value if isinstance(value, dict) else {}
    return {}


def _closings(text: str) -> list[str]:
    """``text`` closed where it stands, then closed at each earlier place a value ended (most first)."""
    stack: list[str] = []
    quote = escape = False
    ends: list[tuple[int, list[str]]] = []  # (where a value or container ended, the containers open there)
    for i, c in enumerate(text):
        if quote:
            if escape:
                escape = False
            elif c == "\\":
                escape = True
            elif c == '"':
                quote = False
                ends.append((i + 1, list(stack)))
        elif c == '"':
            quote = True
        elif c in "[{":
            stack.append("]" if c == "[" else "}")
            ends.append((i + 1, list(stack)))
        elif c in "]}" and stack:
            stack.pop()
            ends.append((i + 1, list(stack)))
        elif c in ",":
            ends.append((i, list(stack)))
    out = [text + ('"' if quote else "") + "".join(reversed(stack))]
    for at, open_ in reversed(ends):
        out.append(text[:at].rstrip().rstrip(",").rstrip() + "".join(reversed(open_)))
    return out


__all__ = ["CallProgress", "Progress", "partial_object"]
