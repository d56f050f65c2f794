"""A cut JSON object read as far as it got: what a tool call's arguments hold when the reply stopped mid-call.

Anthropic's clients show a cut call's ``input`` so (:mod:`...serve.anthropic.convert`). The text is model output:
it is scanned once, and closed and parsed at a few places only (each parse error says where the next try must end
before), so a long cut argument costs linear time.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

TRIES = 16
"""Most places a cut text is closed and parsed at before it is read as ``{}``."""


def partial_object(text: str) -> dict[str, Any]:
    """The JSON object a cut ``text`` begins, as far as it got (``{}`` where nothing reads).

    Open strings and containers are closed; an unfinished key or value is left out.
    """
    closed, ends, closers = _scan(text)
    candidate, at, kept = closed, len(text), len(text)  # (kept: how much of the candidate is the text's own)
    k = len(ends)
    for _ in range(TRIES):
        try:
            value = json.loads(candidate)
        except json.JSONDecodeError as e:  # the next try ends before the error, or before this one's end
            limit = e.pos if e.pos < kept else at - 1
        except RecursionError:
            return {}
        else:
            return value if isinstance(value, dict) else {}
        while k > 0 and ends[k - 1][0] > limit:
            k -= 1
        if k == 0:
            return {}
        k -= 1
        at, node = ends[k]
        head = text[:at].rstrip().rstrip(",").rstrip()
        candidate, kept = head + closers(node), len(head)
    return {}


def _scan(text: str) -> tuple[str, list[tuple[int, int]], Callable[[int], str]]:
    """``text`` closed where it stands; where a value or container ended, with the containers open there; closers.

    The containers open at each place are a chain of parents (one entry a container), so no place copies a stack.
    """
    nodes: list[tuple[str, int]] = []  # (its closing bracket, the container it sits in)
    top = -1
    quote = escape = False
    ends: list[tuple[int, int]] = []
    for i, c in enumerate(text):
        if quote:
            if escape:
                escape = False
            elif c == "\\":
                escape = True
            elif c == '"':
                quote = False
                ends.append((i + 1, top))
        elif c == '"':
            quote = True
        elif c in "[{":
            nodes.append(("]" if c == "[" else "}", top))
            top = len(nodes) - 1
            ends.append((i + 1, top))
        elif c in "]}" and top >= 0:
            top = nodes[top][1]
            ends.append((i + 1, top))
        elif c == ",":
            ends.append((i, top))

    def closers(node: int) -> str:
        out = []
        while node >= 0:
            out.append(nodes[node][0])
            node = nodes[node][1]
        return "".join(out)

    return text + ('"' if quote else "") + closers(top), ends, closers


__all__ = ["partial_object"]
