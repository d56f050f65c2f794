"""How many tokens to draft each step, from what steps of each window measured: drafting never makes a batch slower.

A drafted window pays only where it is accepted, and costs on every row: each drafted position is one more drafter
forward and one more position in the target's verifying forward. One stream at high acceptance gains most; a large
batch, whose step is already GPU-bound, may lose (vLLM measured 0.71x at 87% acceptance on a graphed 27B, -32% at 64
concurrent). So the window is chosen per step, as a bandit over its arms ``0..max_window`` (0: no drafting, a plain
step), per batch size bucket (1, 2-3, 4-7, ... rows): each arm's tokens per second, measured on the steps it ran
(tokens every row emitted over the step's wall time, an exponential average), and the best arm runs; every arm is
tried ``warmup`` times in a bucket before the best is trusted, and a neighbour of the best is tried again every
``explore_every`` steps of a bucket, so a change of acceptance or load moves the choice. The measure is what the
step cost and gave, acceptance and rows included: nothing is modelled. ``window`` is None for a step the rule does
not decide (no row decoding).

Greedy output does not depend on the window (the target verifies every drafted token); only speed does.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

ALPHA = 0.25
"""Weight of a new step in an arm's average tokens per second."""


def bucket(rows: int) -> int:
    """The batch size bucket of ``rows`` decoding rows: 1, 2, 4, 8, ... (the power of two at or below it)."""
    return 1 << (max(1, rows).bit_length() - 1)


@dataclass
class _Arm:
    steps: int = 0
    rate: float = 0.0  # tokens per second, averaged


@dataclass
class _Bucket:
    arms: dict[int, _Arm]
    steps: int = 0
    last: int | None = None


@dataclass
class DraftRule:
    """The window of each step, chosen from measured steps (see the module docstring)."""

    max_window: int
    warmup: int = 3
    explore_every: int = 32
    _buckets: dict[int, _Bucket] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def window(self, rows: int) -> int:
        """The window for a step of ``rows`` decoding rows (0: draft nothing)."""
        with self._lock:
            b = self._bucket(rows)
            b.steps += 1
            untried = [k for k, a in b.arms.items() if a.steps < self.warmup]
            if untried:  # every arm measured first, the shortest windows first
                choice = untried[0]
            else:
                best = max(b.arms, key=lambda k: b.arms[k].rate)
                choice = best
                if b.steps % self.explore_every == 0:  # a neighbour again, so the choice can move
                    near = [k for k in (best - 1, best + 1) if k in b.arms]
                    choice = near[(b.steps // self.explore_every) % len(near)]
            b.last = choice
            return choice

    def measured(self, rows: int, window: int, tokens: int, seconds: float) -> None:
        """What a step of ``rows`` rows drafting ``window`` gave: ``tokens`` emitted over all rows in ``seconds``."""
        if seconds <= 0 or window not in range(self.max_window + 1):
            return
        with self._lock:
            arm = self._bucket(rows).arms[window]
            rate = tokens / seconds
            arm.rate = rate if arm.steps == 0 else (1 - ALPHA) * arm.rate + ALPHA * rate
            arm.steps += 1

    def _bucket(self, rows: int) -> _Bucket:
        key = bucket(rows)
        b = self._buckets.get(key)
        if b is None:
            b = self._buckets[key] = _Bucket({k: _Arm() for k in range(self.max_window + 1)})
        return b

    def report(self) -> dict[str, Any]:
        """Per batch size bucket: the window chosen last and each window's measured tokens per second and steps."""
        with self._lock:
            return {
                f"{key} rows": {
                    "window": b.last,
                    "tok_s": {k: round(a.rate, 1) for k, a in b.arms.items() if a.steps},
                    "steps": {k: a.steps for k, a in b.arms.items() if a.steps},
                }
                for key, b in sorted(self._buckets.items())
            }


def decoded_tokens(results: list[dict[str, Any]]) -> int | None:
    """Tokens one ``iterate()`` emitted over all rows, or None when it did other work (read a prompt, failed)."""
    total = 0
    for r in results:
        if r.get("stage") != "streaming":
            return None
        ids = r.get("token_ids")
        total += int(ids.numel()) if ids is not None else 0
    return total if results else None
