"""Incremental detokenizing and stop-string matching, shared by every backend."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol


class _Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


_REPLACEMENT = "\ufffd"
_MAX_HELD = 8
"""Tokens held back at most while the text ends in an incomplete character."""
_MAX_BACK = 64
"""Whitespace-only tokens a decoding window may reach back over to open on a token with text."""


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, safely.

    A token may carry half of a UTF-8 character (byte-fallback tokens, byte-level BPE) and
    sentencepiece drops the leading space of the first piece of a decode. Decoding a short window
    (the tokens since the last emitted text plus a few before them) and emitting only the part past
    what was already shown handles both: text ending in an incomplete character is held back until
    the next token completes it. ``"".join(deltas) + flush()`` equals ``decode(all_ids)``.

    Example:
        >>> class Chars:  # a toy tokenizer: one character per id
        ...     def decode(self, ids, skip_special_tokens=True):
        ...         return "".join(chr(i) for i in ids)
        >>> d = IncrementalDetokenizer(Chars())
        >>> d.add([72, 105]) + d.add([33]) + d.flush()
        'Hi!'
    """

    def __init__(
        self, tokenizer: _Decoder, skip_special_tokens: bool = True, shown: Mapping[int, str] | None = None
    ) -> None:
        """``shown``: special tokens decoded as their text all the same (a family's tool-call markup)."""
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._shown = dict(shown or {})
        self.ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._emitted: list[str] = []

    def _decode(self, ids: Sequence[int]) -> str:
        if not self._shown or not any(i in self._shown for i in ids):
            return self._tok.decode(ids, skip_special_tokens=self._skip)
        parts: list[str] = []
        run: list[int] = []
        for i in ids:
            if i in self._shown:
                if run:
                    parts.append(self._tok.decode(run, skip_special_tokens=self._skip))
                    run = []
                parts.append(self._shown[i])
            else:
                run.append(i)
        if run:
            parts.append(self._tok.decode(run, skip_special_tokens=self._skip))
        return "".join(parts)

    def add(self, token_ids: Iterable[int]) -> str:
        """Append tokens and return the new text that is safe to show (may be empty)."""
        self.ids.extend(token_ids)
        prefix_text = self._decode(self.ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self.ids[self._prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT):
            if new_text.startswith(prefix_text):
                delta = new_text[len(prefix_text) :]
                self._prefix_offset = self._window_start(self._read_offset)
                self._read_offset = len(self.ids)
                self._emitted.append(delta)
                return delta
            # The window's decode rewrote earlier text (rare normalizers): fall back to the
            # whole sequence, which is exact.
            return self._resync()
        if len(self.ids) - self._read_offset > _MAX_HELD:
            # The text keeps ending in an incomplete character: a run of invalid bytes, not one character
            # (UTF-8 needs at most 4 bytes). Emit all but the last 3 tokens, which may still start one, so
            # the window stays bounded (no quadratic re-decoding) and the reader sees the text.
            cut = len(self.ids) - 3
            done = self._decode(self.ids[self._prefix_offset : cut])
            if len(done) > len(prefix_text) and done.startswith(prefix_text) and new_text.startswith(done):
                delta = done[len(prefix_text) :]
                self._prefix_offset, self._read_offset = self._window_start(self._read_offset), cut
                self._emitted.append(delta)
                return delta
        return ""

    def _window_start(self, start: int) -> int:
        """Where the next decoding window starts: ``start``, or earlier, so that it opens on a token with text.

        A tokenizer strips the leading whitespace of what it decodes (sentencepiece all of it), so a window
        that opened on a lone space piece would decode it, and the space of the token after it, to nothing.
        It looks back ``_MAX_BACK`` tokens at most (the window stays bounded): a longer run of tokens that
        are only whitespace can still lose a space at a chunk boundary.
        """
        floor = max(0, start - _MAX_BACK)
        while start > floor and not self._decode(self.ids[start : start + 1]).strip():
            start -= 1
        return start

    def _resync(self) -> str:
        full = self._decode(self.ids)
        shown = "".join(self._emitted)
        if not full.startswith(shown) or full.endswith(_REPLACEMENT):
            return ""
        delta = full[len(shown) :]
        self._prefix_offset = max(0, len(self.ids) - 6)
        self._read_offset = len(self.ids)
        self._emitted = [full]
        return delta

    def flush(self) -> str:
        """Return whatever is still held back (an incomplete character at the very end)."""
        full = self._decode(self.ids)
        shown = "".join(self._emitted)
        if full.startswith(shown):
            delta = full[len(shown) :]
        else:
            prefix_text = self._decode(self.ids[self._prefix_offset : self._read_offset])
            delta = self._decode(self.ids[self._prefix_offset :])[len(prefix_text) :]
        self._emitted.append(delta)
        self._prefix_offset = self._read_offset = len(self.ids)
        return delta


class StopStringMatcher:
    """Finds stop strings in streamed text, across chunk boundaries, and never emits one.

    Text that could still turn into a stop string is held back. When several stop strings could
    match, the one that is complete first in the stream wins (on a tie, the one starting first), so
    the result does not depend on how the text was cut into chunks.

    Example:
        >>> m = StopStringMatcher(["###"])
        >>> m.push("Hello #"), m.push("## world"), m.stopped
        ('Hello ', '', '###')
    """

    def __init__(self, stops: Iterable[str]) -> None:
        self.stops = [s for s in dict.fromkeys(stops) if s]
        self._max = max((len(s) for s in self.stops), default=0)
        self._held = ""
        self.stopped: str | None = None

    @property
    def held(self) -> str:
        """Text held back because it may begin a stop string."""
        return self._held

    def push(self, text: str) -> str:
        """Feed new text; return the part that is safe to emit. After a stop, always ''."""
        if self.stopped is not None:
            return ""
        if not self.stops:
            return text
        buf = self._held + text
        best: tuple[int, int, str] | None = None
        for s in self.stops:
            i = buf.find(s)
            if i >= 0:
                key = (i + len(s), i, s)
                if best is None or key[:2] < best[:2]:
                    best = key
        if best is not None:
            self.stopped = best[2]
            self._held = ""
            return buf[: best[1]]
        keep = 0
        for k in range(min(len(buf), self._max - 1), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self.stops):
                keep = k
                break
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """End of stream without a stop: release held text."""
        out, self._held = self._held, ""
        return "" if self.stopped is not None else out
