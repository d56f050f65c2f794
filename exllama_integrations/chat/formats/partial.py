"""A cut JSON object read as far as it got: what a tool call's arguments hold when the reply stopped mid-call.

Anthropic's clients show a cut call's ``input`` so (:mod:`...serve.anthropic.convert`).
"""

from __future__ import annotations

import json
from typing import Any


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


__all__ = ["partial_object"]
