"""One reader for every family's replies: text in (streamed or whole), answer text and tool calls out.

:class:`ReplyReader` follows a :class:`~.table.ToolFormat`: text before a call is answer text, released as it
comes except for a tail that may still begin a call's markup (never a partial tag in the text); a call region is
held until it closes, then read into :class:`ParsedToolCall` values with their ids fixed at that moment, so a
stream and the final reply name a call the same way. A region that does not read as a call becomes an invalid
call with its raw text (never silent answer text); one cut off before its close by ``max_tokens`` is invalid too,
unless its body is already whole. :func:`read_reply` reads a finished reply in one go.
"""

from __future__ import annotations

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

_NAME_RE = re.compile(
    r'"name"\s*:\s*"([^"]+)"|<function=([^>\n]+)>|to=(?:functions\.)?([^\s<]+)|invoke name="([^"]+)"|call:([\w.-]+)'
    r'|^\s*\[\s*([^\s()\[\]{}=,\'"]+)\('
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
        self._body = ""
        self._started = not fmt.at_start  # at_start formats: False until the reply's start is decided
        self._after_call = False  # whitespace right after a call is the calls' separator, not text
        self._looks = re.compile(fmt.looks_like) if fmt.looks_like else None
        self._markers = tuple(dict.fromkeys((*fmt.opens, *fmt.strip)))
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
            self._close(self._body + self._buf, closed=False, cut=cut)
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
        while True:
            if self._region is not None:
                if not self._in_region(final):
                    return
            elif not self._started:
                if not self._at_start(final):
                    return
            elif not self._in_text(final):
                return

    def _at_start(self, final: bool) -> bool:
        """An ``at_start`` format: decide whether the reply is calls (all of it) or text (all of it)."""
        assert self._looks is not None
        head = self._buf.lstrip()
        if not head and not final:
            return False
        if self._looks.match(self._buf):
            self._region, self._body, self._buf = "", self._buf.lstrip(), ""
            self._started = True
            return True
        may_be = any(o.startswith(head[: len(o)]) for o in self.fmt.opens) and len(head) < 64
        if may_be and not final:
            return False  # too short to tell yet
        self._started = True
        self._markers = ()  # a text reply: the opens are text from here on
        return True

    def _in_text(self, final: bool) -> bool:
        """Answer text: release it up to the first marker (or a tail that may begin one)."""
        if self._after_call:
            self._buf = self._buf.lstrip()
            if not self._buf:
                return False
            self._after_call = False
        hit = _earliest(self._buf, self._markers)
        if hit is not None and not final and _longer(self._buf[hit[0] :], hit[1], self._markers):
            if hit[0]:  # a longer marker may still begin here (Glimmer's "to=user<|message|>" or "to=NAME")
                self.text.append(self._buf[: hit[0]])
                self._buf = self._buf[hit[0] :]
            return False
        if hit is not None:
            at, marker = hit
            if at:
                self.text.append(self._buf[:at])
            self._buf = self._buf[at + len(marker) :]
            if marker in self.fmt.opens:
                self._region, self._body = marker, ""
            return True
        keep = 0 if final else _partial_tail(self._buf, self._markers)
        if len(self._buf) > keep:
            self.text.append(self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep :]
        return False

    def _in_region(self, final: bool) -> bool:
        """Inside a call region: wait for its close (or, without closes, the next open or the end)."""
        ends = self.fmt.closes or (self.fmt.opens if not self.fmt.at_start else ())
        hit = _earliest(self._buf, ends)
        if hit is None:
            keep = _partial_tail(self._buf, ends) if ends else 0
            self._body += self._buf[: len(self._buf) - keep]
            self._buf = self._buf[len(self._buf) - keep :]
            return False
        at, marker = hit
        body = self._body + self._buf[:at]
        if self.fmt.closes:
            self._buf = self._buf[at + len(marker) :]
            self._close(body, closed=True, cut=False)
        else:  # the next call's open ends this one
            self._buf = self._buf[at + len(marker) :]
            self._close(body, closed=True, cut=False)
            self._region, self._body = marker, ""
        return True

    def _close(self, body: str, closed: bool, cut: bool) -> None:
        opened = self._region or ""
        self._region, self._body = None, ""
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
            m = _NAME_RE.search(body)
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


def _earliest(buf: str, markers: Sequence[str]) -> tuple[int, str] | None:
    """The first marker in ``buf`` (the longest where two start at the same place)."""
    best: tuple[int, int, str] | None = None
    for m in markers:
        i = buf.find(m)
        if i >= 0 and (best is None or (i, -len(m)) < (best[0], best[1])):
            best = (i, -len(m), m)
    return None if best is None else (best[0], best[2])


def _longer(rest: str, marker: str, markers: Sequence[str]) -> bool:
    """Whether ``rest`` (which begins with ``marker``) may still grow into a longer one of ``markers``."""
    return any(len(m) > len(rest) and m.startswith(rest) for m in markers if len(m) > len(marker))


def _partial_tail(buf: str, markers: Sequence[str]) -> int:
    """How many characters at the end of ``buf`` may still begin one of ``markers``."""
    longest = max((len(m) for m in markers), default=0)
    for k in range(min(len(buf), longest - 1), 0, -1):
        tail = buf[-k:]
        if any(m.startswith(tail) for m in markers):
            return k
    return 0


__all__ = ["CUT_OFF", "ParsedToolCall", "ReplyReader", "new_call_id", "read_reply"]
