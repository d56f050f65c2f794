"""A reply's calls as the model writes them: each call's name once it is whole, its arguments as JSON as they come.

:class:`CallProgress` follows the table entry's ``call`` text (``P {name} L {arguments} S``, the arguments a JSON
object, Python keyword arguments, XML or tagged parameters, or Gemma 4's ``{key:<|"|>text<|"|>}``) through a reply,
fed the same text as the reader. It is what lets a forced call's arguments stream as they are generated (the grammar
writes the call exactly so), and what a call cut short by ``max_tokens`` keeps of its arguments instead of its
markup. Python, XML and Gemma arguments come out as JSON: a key and its separator when the key is whole, a JSON value
as it is written, an XML or Gemma string escaped as it is written, any other XML value when its parameter closes.
A call text that names the tool twice (Muse Glimmer's recipient, then its ``<atem:invoke name=..>``) is followed by
the first; a bare name that holds markup or spaces was not a call's (Glimmer's ``to=user``): the search goes on.
A reply that leaves the call's shape stops being followed (the reader still reads it); nothing here raises on what a
model writes. A cut JSON object read as far as it got: :mod:`.partial`.
"""

from __future__ import annotations

import json
import re
import string
from collections.abc import Mapping, Sequence
from typing import Any

from .layout import XML, Params, Progress, escaped, held, joined, pattern, tagged_layout
from .table import ToolFormat
from .tagged import GemmaJson
from .values import text_kinds, text_value

_LONGEST_NAME = 512
_SHAPES = (
    ("name", "arguments"),
    ("name_json", "arguments"),
    ("name", "xml_parameters"),
    ("name", "tagged_parameters"),
    ("name", "python_arguments"),
    ("name", "gemma_arguments"),
)
"""The call texts followed: a name, then its arguments (the table's slots)."""


class CallProgress:
    """Follows one reply of ``fmt`` (see the module docstring): :meth:`feed` text, read :attr:`calls`."""

    def __init__(self, fmt: ToolFormat, tools: Sequence[Mapping[str, Any]] = ()) -> None:
        self.calls: list[Progress] = []
        self._schemas = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools}
        self._text, self._pos, self._state = "", 0, "lost"
        self._name_at = self._depth = self._keys = self._sent = 0
        self._value_at = self._looked = self._json_end = -1
        self._scanned = 0  # a trimmed string value: how far its text has been looked at for spaces at its end
        self._quote = self._escape = self._bare = self._plain = False
        self._schema: Any = None
        self._flag: str | None = None
        self._kind = ""
        self._layout = XML
        self._gemma: GemmaJson | None = None  # a Gemma call's arguments being read
        literals, slots = [""], []  # the text before each slot ("{{" is a literal brace)
        for literal, slot, _, _ in string.Formatter().parse(fmt.call):
            literals[-1] += literal
            if slot is not None:
                slots.append(slot)
                literals.append("")
        if slots[:2] == ["name", "name"]:  # the name again (Glimmer's invoke): part of what follows the first
            literals[1:3] = [literals[1] + "\x00" + literals[2]]
            del slots[1]
        if tuple(slots[:2]) not in _SHAPES:
            return  # a call text of another shape: not followed
        head, between = literals[0], literals[1]
        opens = [i for i in (head.find(o) for o in fmt.opens) if i >= 0]
        head = head[min(opens) :] if opens else head  # what comes before the open may be in the prompt already
        # with no text before the name (pythonic) the name follows the list's opening, or the separator
        self._heads = [head] if head.strip() else [fmt.before, fmt.between]
        self._anchored = not head.strip()
        self._between = pattern(between)
        self._window = _LONGEST_NAME + 4 * len(between) + 64  # how far a name's end is looked for
        if "\x00" in between:  # a name written again inside it
            self._between = re.compile(r'[^\s<>"]*'.join(pattern(p).pattern for p in between.split("\x00")))
        elif not between and slots[1] == "gemma_arguments":
            self._between = re.compile(r"(?=\{)")  # Gemma's name runs into its arguments
        self._json_name = slots[0] == "name_json"
        self._kind = "text_parameters" if slots[1] in ("xml_parameters", "tagged_parameters") else slots[1]
        self._layout = (
            XML if slots[1] != "tagged_parameters" else tagged_layout(fmt.body_args["write_param"], literals[2])
        )
        self._state = "seek"

    @property
    def follows(self) -> bool:
        """Whether this format's calls are followed at all.

        A call text of another shape (a response template's, where the checkpoint ships one) is not: such a call
        comes whole, when the reader has read it.
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
        return joined(out)

    # ------------------------------------------------------------------ a call's start and name

    def _seek(self, out: list[tuple[int, str]]) -> bool:
        literal = self._heads[min(len(self.calls), len(self._heads) - 1)]
        if not literal.strip():
            self._state, self._name_at = "name", self._pos
            return True
        found = pattern(literal)
        if self._anchored:  # right where the last call ended (or the reply began)
            self._pos = self._space(self._pos)
            m = found.match(self._text, self._pos)
            if m is None:
                head = self._text[self._pos : self._pos + len(literal.strip())]
                if head and not literal.strip().startswith(head):
                    self._state = "lost"
                return False
        else:
            m = found.search(self._text, self._pos)
            if m is None:
                self._pos = max(self._pos, len(self._text) - 4 * len(literal) - 64)
                return False
        self._pos = self._name_at = m.end()
        self._state = "name"
        return True

    def _space(self, at: int) -> int:
        """Where the whitespace from ``at`` ends (each character of a run looked at once: callers move past it)."""
        text, n = self._text, len(self._text)
        while at < n and text[at].isspace():
            at += 1
        return at

    def _name(self, out: list[tuple[int, str]]) -> bool:
        # (bounded: a name is at most _LONGEST_NAME long, so no open is followed to the end of the reply)
        m = self._between.search(self._text, self._name_at, self._name_at + self._window)
        if m is None:
            if len(self._text) - self._name_at > _LONGEST_NAME:
                self._state, self._pos = ("lost", self._pos) if self._anchored else ("seek", self._name_at)
                return not self._anchored
            return False
        raw = self._text[self._name_at : m.start()]
        if not self._json_name and not self._anchored and re.search(r"[\s<>]", raw.strip()):
            self._state, self._pos = "seek", self._name_at  # not a call's name (Glimmer's "to=user"): look further
            return True
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
        self._gemma = None
        return True

    def _emit(self, out: list[tuple[int, str]], text: str) -> None:
        self.calls[-1].pieces.append(text)
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

    def _object_begins(self) -> bool:
        """Past the whitespace to the ``{`` the arguments begin with (False: none yet, or lost on something else)."""
        self._pos = self._space(self._pos)
        if self._pos >= len(self._text) or self._text[self._pos] != "{":
            if self._pos < len(self._text):
                self._state = "lost"
            return False
        return True

    def _arguments(self, out: list[tuple[int, str]]) -> bool:
        """A JSON object, every character of it as it comes."""
        if self._depth == 0 and not self._object_begins():
            return False
        start = self._pos
        end = self._scan("")
        self._pos = len(self._text) if end is None else end
        if self._pos > start:
            self._emit(out, self._text[start : self._pos])
        return self._done() if end is not None else False

    def _python_arguments(self, out: list[tuple[int, str]]) -> bool:
        """``K=V, ...)``: each key when whole, each value (JSON, as the grammar writes it) as it comes."""
        if self._value_at < 0:
            self._pos = self._space(self._pos)
            if self._keys and self._text.startswith(",", self._pos):
                self._pos = self._space(self._pos + 1)
            body = self._text[self._pos : self._pos + _LONGEST_NAME + 1]
            if not body:
                return False
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
            self._pos = self._value_at = self._space(self._pos)
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

    def _gemma_arguments(self, out: list[tuple[int, str]]) -> bool:
        """Gemma 4's ``{key:<|"|>text<|"|>,n:3}``, as JSON as it comes (:class:`~.tagged.GemmaJson`)."""
        if self._gemma is None:
            if not self._object_begins():
                return False
            self._gemma = GemmaJson()
        self._pos, piece, state = self._gemma.feed(self._text, self._pos)
        if piece:
            self._emit(out, piece)
        if state == "lost":
            self._state = "lost"
        return self._done() if state == "done" else False

    def _text_parameters(self, out: list[tuple[int, str]]) -> bool:
        """Parameters written as text (Qwen3-Coder's XML, the tag formats'), then the call's end.

        Each value as :func:`~.values.text_value` reads it: a string for sure streamed as it comes, any other whole.
        """
        shape = self._layout
        if self._value_at < 0:
            at = self._pos = self._space(self._pos)
            body = self._text[at : at + _LONGEST_NAME + 4 * len(shape.open + shape.between) + 64]
            if body.startswith(shape.end):
                self._emit(out, "}" if self._keys else "{}")
                self._pos = at + len(shape.end)
                return self._done()
            if not body.startswith(shape.open):
                if body and not (shape.open.startswith(body) or shape.end.startswith(body)):
                    self._state = "lost"
                return False
            m = pattern(shape.between).search(body, len(shape.open))
            if m is None:
                if len(body) > _LONGEST_NAME:
                    self._state = "lost"
                return False
            key, end, flag = body[len(shape.open) : m.start()].strip(), m.end(), None
            if shape.flagged is not None:  # DeepSeek's string="true|false", then the value
                f = re.compile(r"(true|false)" + pattern(shape.flagged).pattern).match(body, end)
                if f is None:
                    if len(body) - end > 16:
                        self._state = "lost"
                    return False
                flag, end = f.group(1), f.end()
            if at + end == len(self._text) and not shape.trimmed:  # (a newline after it: where the value begins)
                return False
            self._pos = at + end + (not shape.trimmed and self._text[at + end] == "\n")
            self._schema = ((self._schemas.get(self.calls[-1].name) or {}).get("properties") or {}).get(key)
            self._flag = flag
            self._bare = flag == "true" if flag is not None else text_kinds(self._schema)[1] is None
            self._emit(out, ("{" if not self._keys else ", ") + json.dumps(key, ensure_ascii=False) + ": ")
            if self._bare:
                self._emit(out, '"')
            self._keys += 1
            self._value_at = self._sent = self._looked = self._pos
            self._json_end, self._plain, self._depth, self._quote, self._escape = -1, self._bare, 0, False, False
            return True
        if not self._plain:  # a JSON kind: an array or object is read to its end (its strings may hold the close)
            read = self._json_container(out, shape)
            if read is not None:
                return read
        # (looked for from where the last look ended: a long value is looked through once)
        close = self._text.find(shape.close, max(self._value_at, self._looked - len(shape.close) + 1))
        self._looked = len(self._text)
        if close < 0:
            if self._bare:
                self._stream_text(out, shape)
            return False
        raw = self._text[self._value_at : close]
        raw = raw.strip() if shape.trimmed else raw[:-1] if raw.endswith("\n") else raw
        if self._bare:
            skipped = len(self._text[self._value_at : close]) - len(self._text[self._value_at : close].lstrip())
            done = self._sent - self._value_at - (skipped if shape.trimmed else 0)
            self._emit(out, escaped(raw[max(done, 0) :]) + '"')
        else:
            value = json.loads(raw) if self._flag == "false" else text_value(raw, self._schema)
            self._emit(out, json.dumps(value, ensure_ascii=False))
        self._pos, self._value_at = close + len(shape.close), -1
        return True

    def _json_container(self, out: list[tuple[int, str]], shape: Params) -> bool | None:
        """A value of a JSON kind that is an array or object, read whole to its end, then its close.

        None where it is not one, or is not followed by its close: the value is then its text up to the first
        close, as for any other (and is not looked at as JSON again).
        """
        if self._json_end < 0:
            if self._depth == 0:
                start = self._space(self._value_at)
                if start >= len(self._text):
                    return False
                if self._text[start] not in "[{":
                    self._plain = True
                    return None
                self._pos = start
            end = self._scan("")
            if end is None:
                self._pos = len(self._text)
                return False
            self._json_end = end
        after = self._space(self._json_end)
        rest = self._text[after : after + len(shape.close)]
        if len(rest) < len(shape.close) and shape.close.startswith(rest):
            return False  # (may be its close yet)
        if rest == shape.close:
            try:
                value = json.loads(self._text[self._value_at : self._json_end])
            except ValueError:
                pass
            else:
                self._emit(out, json.dumps(value, ensure_ascii=False))
                self._pos, self._value_at, self._depth = after + len(shape.close), -1, 0
                return True
        self._plain, self._depth, self._quote, self._escape = True, 0, False, False
        return None

    def _stream_text(self, out: list[tuple[int, str]], shape: Params) -> None:
        """A string value's text so far, less what may yet be its close (and, trimmed, its spaces at either end)."""
        if shape.trimmed and self._sent == self._value_at:  # its leading spaces are not the value's
            self._sent = self._value_at = self._looked = self._space(self._value_at)
        upto = len(self._text) - held(self._text, ("" if shape.trimmed else "\n") + shape.close)
        if shape.trimmed:  # spaces at its end are held back; what came before the last look is not looked at again
            since = max(self._sent, self._scanned)
            kept = len(self._text[since:upto].rstrip())
            self._scanned = max(self._scanned, upto)
            upto = since + kept if kept else self._sent
        if upto > self._sent:
            self._emit(out, escaped(self._text[self._sent : upto]))
            self._sent = upto


__all__ = ["CallProgress", "Progress"]
