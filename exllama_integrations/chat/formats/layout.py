"""How :class:`~.progress.CallProgress` sees a call's text: parameter layouts, literals as patterns, the pieces out.

Each helper looks at a bounded stretch of the text (a literal's length, a call's pieces), so following a reply
stays linear in its length.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Params:
    """How parameters written as text are laid out.

    ``open`` KEY ``between`` [FLAG ``flagged``] VALUE ``close``, until ``end``; ``trimmed``: the reader strips a
    value (else one newline each side goes).
    """

    open: str
    between: str
    close: str
    end: str
    trimmed: bool
    flagged: str | None = None  # what follows DeepSeek's string="true|false" flag before the value


XML = Params("<parameter=", ">", "</parameter>", "</function>", trimmed=False)


def tagged_layout(write_param: str, after: str) -> Params:
    """The layout a table entry's ``write_param`` (slots ``{key}``, ``{string}``, ``{value}``) describes."""
    opening, rest = write_param.split("{key}", 1)
    between, closing = rest.split("{value}", 1)
    flagged = None
    if "{string}" in between:
        between, flagged = between.split("{string}", 1)
    end = after.strip().split("\n")[0].strip()
    return Params(opening, between, closing.strip(), end, trimmed=True, flagged=flagged)


@dataclass
class Progress:
    """One call as written so far."""

    name: str
    pieces: list[str] = field(default_factory=list)
    """Its arguments' JSON text as it came (joined when read: a long call is not copied with each piece)."""
    done: bool = False

    @property
    def arguments(self) -> str:
        """Its arguments as JSON text so far (whole once ``done``)."""
        if len(self.pieces) > 1:
            self.pieces[:] = ["".join(self.pieces)]
        return self.pieces[0] if self.pieces else ""


@functools.lru_cache(maxsize=256)
def pattern(literal: str) -> re.Pattern[str]:
    """``literal`` as a regex in which a run of whitespace is any whitespace (a model writing freely).

    A literal of whitespace alone (GLM's newline after a call's name) is some whitespace, at least one.
    """
    if literal and not literal.strip():
        return re.compile(r"\s+")
    return re.compile(r"\s*".join(re.escape(p) for p in re.split(r"\s+", literal)))


def escaped(text: str) -> str:
    """``text`` as the inside of a JSON string."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


def held(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` may begin ``marker``."""
    for k in range(min(len(text), len(marker)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def joined(pieces: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """Consecutive pieces of one call as one (a call's first, empty piece kept: it announces the call)."""
    out: list[tuple[int, str]] = []
    for i, piece in pieces:
        if out and out[-1][0] == i and out[-1][1] and piece:
            out[-1] = (i, out[-1][1] + piece)
        elif not (out and out[-1][0] == i and not piece):
            out.append((i, piece))
    return out


__all__ = ["XML", "Params", "Progress", "escaped", "held", "joined", "pattern", "tagged_layout"]
