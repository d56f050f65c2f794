"""One reader for every family's replies: text in (streamed or whole), answer text and tool calls out.

:class:`ReplyReader` follows a :class:`~.table.ToolFormat`: text before a call is answer text, released as it
comes except for a tail that may still begin a call's markup (never a partial tag in the text); a call region is
held until it closes, then read into :class:`ParsedToolCall` values with their ids fixed at that moment, so a
stream and the final reply name a call the same way. A region that does not read as a call becomes an invalid
call with its raw text (never silent answer text); one cut off before its close by ``max_tokens`` is invalid too,
unless its body is already whole. :func:`read_reply` reads a finished reply in one go.
"""

from __future__ import annotations

import functools
import json
import re
import secrets
import string
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .bodies import read_body
from .response_template import CUT_OFF, FoundCall, TemplateReader
from .table import ToolFormat
from .values import text_value

_NAME_RE = re.compile(  # (each name at most 256 long: an open without its end is not followed further)
    r'"name"\s*:\s*"([^"]{1,256})"|<function=([^>\n]{1,256})>|to=(?:functions\.)?([^\s<]{1,256})'
    r'|invoke name="([^"]{1,256})"|call:([\w.-]{1,256})|^\s*\[\s*([^\s()\[\]{}=,\'"]{1,256})\('
)
_ALNUM = string.ascii_letters + string.digits


@dataclass(frozen=True)
class ParsedToolCall:
    """A tool call found in model output; ``error`` is set when it could not be read (an invalid call)."""

    id: str
    name: str | None
    arguments: dict[str, Any] | None
    raw: str
    error: str | None = None
    written: str | None = None
    """The arguments' JSON text as it was streamed, or as far as it got in a call cut short (see :attr:`cut`)."""

    @property
    def cut(self) -> bool:
        """Whether ``max_tokens`` cut the call short (its name and :attr:`written` are what the model wrote)."""
        return self.error == CUT_OFF

    @property
    def arguments_text(self) -> str:
        """The arguments as JSON text (as streamed, where they were; a malformed call keeps what the model wrote)."""
        if self.written is not None:
            return self.written
        return self.raw if self.error else json.dumps(self.arguments, ensure_ascii=False)


def new_call_id(fmt: ToolFormat) -> str:
    """A fresh call id in the family's style (Mistral's templates accept 9 letters and digits only)."""
    if fmt.ids == "alnum9":
        return "".join(secrets.choice(_ALNUM) for _ in range(9))
    return f"call_{uuid.uuid4().hex[:24]}"


class ReplyReader:
    """Reads one reply of ``fmt``: :meth:`feed` text as it comes, then :meth:`finish`.

    ``tools`` (OpenAI specs) type the values of bodies that carry text only (Qwen3-Coder's XML parameters).
    """

    def __init__(self, fmt: ToolFormat, tools: Sequence[Mapping[str, Any]] = ()) -> None:
        self.fmt = fmt
        self._schemas = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools}
        self._buf = fmt.prompt_tail  # the header the reply's first message completes (Muse Glimmer's)
        self._region: str | None = None  # the open literal of the region being read, or None in the text
        self._body: list[str] = []  # the region's text so far, in pieces (joined once, when it closes)
        self._space = 0  # at_start formats: how much of the reply's start is whitespace, looked at already
        self._started = not fmt.at_start  # at_start formats: False until the reply's start is decided
        self._after_call = False  # whitespace right after a call is the calls' separator, not text
        self._looks = re.compile(fmt.looks_like) if fmt.looks_like else None
        self._markers = tuple(dict.fromkeys((*fmt.opens, *fmt.strip)))
        self._longest = max(map(len, (*fmt.opens, *fmt.strip, *fmt.closes)), default=0)
        self._i = 0  # where reading is in the buffer (during a feed)
        self._next: dict[str, int] = {}  # where each marker is next (during a feed)
        self.text: list[str] = []
        self.calls: list[ParsedToolCall] = []
        # the model's own response template, where it ships one, reads the reply instead (transformers' parser)
        self._template = TemplateReader(fmt.response_template) if fmt.response_template is not None else None

    # ------------------------------------------------------------------ reading

    def feed(self, text: str) -> tuple[str, list[ParsedToolCall]]:
        """Take more reply text; return the answer text now safe to show and the calls completed by it."""
        if self._template is not None:
            return self._keep(*self._template.feed(text))
        self._buf += text
        before_text, before_calls = len(self.text), len(self.calls)
        self._run(final=False)
        return "".join(self.text[before_text:]), self.calls[before_calls:]

    def finish(self, cut: bool = False) -> tuple[str, list[ParsedToolCall]]:
        """End of the reply (``cut``: by ``max_tokens``): the rest of the text and the last calls."""
        if self._template is not None:
            return self._keep(*self._template.finish(cut))
        before_text, before_calls = len(self.text), len(self.calls)
        self._run(final=True)
        if self._region is not None:
            self._close("".join(self._body) + self._buf, closed=False, cut=cut)
        elif self._buf:
            self.text.append(self._buf)
        self._buf = ""
        return "".join(self.text[before_text:]), self.calls[before_calls:]

    def _keep(self, text: str, found: list[FoundCall]) -> tuple[str, list[ParsedToolCall]]:
        """What the response template read, kept as this reader keeps its own (ids, arguments typed by schema)."""
        calls = []
        for name, args, raw, error in found:
            if args is not None and name is not None:
                props = (self._schemas.get(name) or {}).get("properties") or {}
                args = {k: text_value(v, props[k]) if isinstance(v, str) and k in props else v for k, v in args.items()}
            calls.append(ParsedToolCall(new_call_id(self.fmt), name, args, raw, error))
        self.text.append(text)
        self.calls += calls
        return text, calls

    def _run(self, final: bool) -> None:
        # The text is read from a position that only moves forward (self._i), each marker looked for once from
        # where it was last found (self._next), and what was read is dropped once at the end: linear in the text.
        self._i, self._next = 0, {}
        try:
            while True:
                if self._region is not None:
                    if not self._in_region(final):
                        return
                elif not self._started:
                    if not self._at_start(final):
                        return
                elif not self._in_text(final):
                    return
        finally:
            self._buf = self._buf[self._i :]

    def _find(self, markers: Sequence[str]) -> tuple[int, str] | None:
        """The first of ``markers`` at or after the position (the longest where two start at the same place)."""
        best: tuple[int, int, str] | None = None
        for m in markers:
            at = self._next.get(m)
            if at is None or 0 <= at < self._i:
                at = self._next[m] = self._buf.find(m, self._i)  # (-1: nowhere from here on, nor further on)
            if at >= 0 and (best is None or (at, -len(m)) < (best[0], best[1])):
                best = (at, -len(m), m)
        return None if best is None else (best[0], best[2])

    def _at_start(self, final: bool) -> bool:
        """An ``at_start`` format: decide whether the reply is calls (all of it) or text (all of it)."""
        assert self._looks is not None
        while self._space < len(self._buf) and self._buf[self._space].isspace():
            self._space += 1  # (a long run of whitespace is looked at once, not again with each piece)
        if self._space == len(self._buf) and not final:
            return False
        head = self._buf[self._space : self._space + 1024]  # (what a call list's start is told by)
        if self._looks.match(head):
            self._region, self._body, self._i = "", [], self._space
            self._started = True
            return True
        may_be = any(o.startswith(head[: len(o)]) for o in self.fmt.opens) and len(self._buf) - self._space < 64
        if may_be and not final:
            return False  # too short to tell yet
        self._started = True
        self._markers = ()  # a text reply: the opens are text from here on
        return True

    def _in_text(self, final: bool) -> bool:
        """Answer text: release it up to the first marker (or a tail that may begin one)."""
        buf = self._buf
        if self._after_call:
            while self._i < len(buf) and buf[self._i].isspace():
                self._i += 1
            if self._i == len(buf):
                return False
            self._after_call = False
        hit = self._find(self._markers)
        if hit is not None and not final and _longer(buf[hit[0] : hit[0] + self._longest], hit[1], self._markers):
            if hit[0] > self._i:  # a longer marker may still begin here (Glimmer's "to=user<|message|>" or "to=NAME")
                self.text.append(buf[self._i : hit[0]])
                self._i = hit[0]
            return False
        if hit is not None:
            at, marker = hit
            if at > self._i:
                self.text.append(buf[self._i : at])
            self._i = at + len(marker)
            if marker in self.fmt.opens:
                self._region, self._body = marker, []
            return True
        keep = 0 if final else _partial_tail(buf, self._markers)
        if len(buf) - keep > self._i:
            self.text.append(buf[self._i : len(buf) - keep])
            self._i = len(buf) - keep
        return False

    def _in_region(self, final: bool) -> bool:
        """Inside a call region: wait for its close (or, without closes, the next open or the end)."""
        ends = self.fmt.closes or (self.fmt.opens if not self.fmt.at_start else ())
        hit = self._find(ends)
        buf = self._buf
        if hit is None:
            keep = _partial_tail(buf, ends) if ends else 0
            if len(buf) - keep > self._i:
                self._body.append(buf[self._i : len(buf) - keep])
                self._i = len(buf) - keep
            return False
        at, marker = hit
        body = "".join(self._body) + buf[self._i : at]
        self._i = at + len(marker)
        self._close(body, closed=True, cut=False)
        if not self.fmt.closes:  # the next call's open ends this one
            self._region, self._body = marker, []
        return True

    def _close(self, body: str, closed: bool, cut: bool) -> None:
        opened = self._region or ""
        self._region, self._body = None, []
        self._after_call = True
        raw = opened + body
        if not body.strip() and not closed:
            return  # an open with nothing after it at the very end: markup, not a call
        said = self.fmt.body_args.get("text")
        m_text = re.match(said, body, re.S) if said else None
        if m_text is not None:
            self.text.append(m_text.group("text"))
            self._after_call = False
            return
        try:
            found = read_body(self.fmt, body, self._schemas)
            if not found:
                raise ValueError("no call in the region")
        except Exception as e:  # noqa: BLE001 - whatever the model wrote, a region that does not read is an invalid call
            why = CUT_OFF if cut else f"{type(e).__name__}: {e}"
            m = _NAME_RE.search(body, 0, 4096)  # (a name is near a call's start)
            name = next((g for g in m.groups() if g), None) if m else None
            self.calls.append(ParsedToolCall(new_call_id(self.fmt), name, None, raw, why))
            return
        for name, args in found:
            self.calls.append(ParsedToolCall(new_call_id(self.fmt), name, args, raw))


def read_reply(fmt: ToolFormat, text: str, tools: Sequence[Mapping[str, Any]] = ()) -> tuple[str, list[ParsedToolCall]]:
    """A finished reply's answer text and its calls."""
    reader = ReplyReader(fmt, tools)
    shown, calls = reader.feed(text)
    rest, more = reader.finish()
    return shown + rest, calls + more


# ------------------------------------------------------------------ markers


def _longer(rest: str, marker: str, markers: Sequence[str]) -> bool:
    """Whether ``rest`` (which begins with ``marker``) may still grow into a longer one of ``markers``."""
    return any(len(m) > len(rest) and m.startswith(rest) for m in markers if len(m) > len(marker))


def _partial_tail(buf: str, markers: Sequence[str]) -> int:
    """How many characters at the end of ``buf`` may still begin one of ``markers``."""
    starts = _starts(tuple(markers))
    for k in range(min(len(buf), len(starts)), 0, -1):
        if buf[-k:] in starts[k - 1]:
            return k
    return 0


@functools.lru_cache(maxsize=64)
def _starts(markers: tuple[str, ...]) -> tuple[frozenset[str], ...]:
    """The proper beginnings of ``markers``, by length (``[k - 1]``: those ``k`` long)."""
    longest = max((len(m) for m in markers), default=0)
    return tuple(frozenset(m[:k] for m in markers if len(m) > k) for k in range(1, longest))


__all__ = ["CUT_OFF", "ParsedToolCall", "ReplyReader", "new_call_id", "read_reply"]
