"""How many tokens to draft each step, from what steps of each window measured: drafting never makes a batch slower.

A drafted window pays only where it is accepted, and costs on every row: each drafted position is one more drafter
forward and one more position in the target's verifying forward. One stream at high acceptance gains most; a large
batch, whose step is already GPU-bound (and, with ``decode="fast"``, captured, which a drafted step is not), loses
(vLLM measured 0.71x at 87% acceptance on a graphed 27B, -32% at 64 concurrent). So the window is chosen per step,
as a bandit over its arms ``0..max_window`` (0: no drafting, a plain step), per batch size bucket (1, 2-3, 4-7, ...
rows):

* an arm's rate is the median tokens per second (tokens every row emitted over the step's wall time) of its last
  :data:`RECENT` steps, after its first ``settle`` steps in the bucket, which are not counted: exllamav3 runs a new
  (rows, positions) shape eagerly twice and captures a graph of it on the third call, and the fast path captures its
  step's shape on the first, so a window's first steps measure its warm-up, not the window;
* arms are measured in order from 0, each ``warmup`` times; a window is tried only while the one before it still
  gained on the one before that (a batch where one drafted token loses does not pay for trying four: at 64 rows a
  step drafting 4 tokens verifies 320 positions), the rest left to exploration;
* a new bucket above one where drafting a token already lost (a larger batch, whose step is even more GPU-bound)
  starts without drafting: its drafted windows are left to exploration too;
* then the best arm runs, and a neighbour of the best runs at most once every ``explore_every`` steps of a bucket,
  and only where what exploring cost so far *and what this exploration is predicted to cost* stay within
  ``explore_share`` of the bucket's measured time. A step of another window costs its time less the time the best
  arm takes for the tokens it gave (a drafted step gives more tokens than a plain one, so its cost is in seconds,
  not in rates), and an MTP drafter's catch-up step before it (the first step back after steps it was parked on,
  :mod:`.mtp_parking`; :meth:`DraftRule.caught_up`) costs the same way. The prediction is the window's slowest
  recent step so costed, plus the bucket's last catch-up where the best runs parked, and at least what its last
  exploration cost; a window the bucket never measured (a bucket that started without drafting) takes the nearest
  smaller bucket's prediction, scaled by the two buckets' best step times (else the costliest window it measured).
  So the cap holds after every step, not only between explorations, wherever a step costs no more than predicted
  (one slower than its window's slowest recent step overshoots by the difference): checked without the cost, one
  exploration overshot it, by all of it on a bucket of a few hundred steps (an H100, MTP run 5: 0.0122-0.0282 at
  16-64 rows; ``tests/unit/test_draft_rule_replay.py`` replays its step times). A change of acceptance or load still
  moves the choice (and a window left out above is reached one neighbour at a time).

Exploring is paced by the measured gap, not stopped: a window whose step costs little over the best is explored
every ``explore_every`` steps, one that costs much rarely. At 16 rows on that H100 a parked step took 6.8 ms for 16
tokens and a step drafting one token 48 ms for ~27 (its catch-up 11 ms for 16): one exploration costs ~41 ms, about
6 parked steps, so 1% of the time pays for one every ~600 steps (~4 s of decoding), and at 64 rows (~118 ms an
exploration, 27 ms a step) one every ~440. Could it stop once window 0 is far ahead? At full acceptance window 1
gives at most 2 tokens a row, so there it wins only once its step costs under twice a parked one (measured: 7x);
acceptance cannot close that gap, but the step's costs can (a long context makes the plain step read its cache
once per token, which a drafted step shares over two; a captured drafted step drops its host cost), and nothing
else would notice. At most 1% is what noticing costs.

What the rule does not cap, it reports (``report()``): the catch-up before a window's first measure in a bucket
(``measuring_share``; the window's measuring steps are not counted as exploring either) and a catch-up before the
best window after steps parked in another bucket (``switching_share``: a batch shrinking into a bucket where
drafting wins, its tail). Each comes with such an event (a bucket entered after parked steps), not on a schedule.

The measure is what the step cost and gave, acceptance and rows included: nothing is modelled. ``window`` is None for
a step the rule does not decide (no row decoding). Greedy output does not depend on the window (the target verifies
every drafted token); only speed does.
"""

from __future__ import annotations

import statistics
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

RECENT = 5
"""Steps of an arm whose median is its rate."""


def bucket(rows: int) -> int:
    """The batch size bucket of ``rows`` decoding rows: 1, 2, 4, 8, ... (the power of two at or below it)."""
    return 1 << (max(1, rows).bit_length() - 1)


@dataclass
class _Arm:
    steps: int = 0  # measured, the settling ones included
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))
    rate: float = 0.0  # the median of ``recent`` (kept: the rule reads it several times a step)
    tokens: int = 0  # what its last counted step gave

    def add(self, tokens: int, seconds: float) -> None:
        self.recent.append(tokens / seconds)
        self.rate = statistics.median(self.recent)
        self.tokens = tokens

    def slowest(self) -> float:
        """The time its slowest recent rate takes for the tokens its last step gave (seconds)."""
        return self.tokens / min(self.recent)


@dataclass
class _Bucket:
    key: int
    arms: dict[int, _Arm]
    steps: int = 0
    last: int | None = None
    since: int = 0  # steps the best ran since the last exploration
    explored: int = 0  # explorations so far (the neighbours take turns)
    drafting_lost_below: bool = False  # a smaller bucket measured a drafted token losing: start without drafting
    best: int = 0  # the arm with the highest rate (kept: read every step)
    seconds: float = 0.0  # the bucket's measured time (catch-up steps included)
    spent: float = 0.0  # of it, what exploring cost: time over what the best arm takes for the same tokens
    measuring: float = 0.0  # what the first measure of a window cost the same way (its catch-up)
    switching: float = 0.0  # what the catch-ups before the best window cost (after parked steps of another bucket)
    catch_ups: int = 0
    catch_up: tuple[int, float] | None = None  # the last catch-up's tokens and seconds
    exploring: int | None = None  # the window of the exploration under way (its catch-up, then its step)
    episode: float = 0.0  # what the exploration under way cost so far
    explored_cost: dict[int, float] = field(default_factory=dict)  # what the last exploration of each window cost


@dataclass
class DraftRule:
    """The window of each step, chosen from measured steps (see the module docstring)."""

    max_window: int
    warmup: int = 2
    explore_every: int = 32
    settle: int = 3
    explore_share: float = 0.01
    _buckets: dict[int, _Bucket] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def window(self, rows: int) -> int:
        """The window for a step of ``rows`` decoding rows (0: draft nothing)."""
        with self._lock:
            b = self._bucket(rows)
            b.steps += 1
            b.exploring = None  # an exploration is its catch-up and its one step: over by the next choice
            choice = self._untried(b)
            if choice is None:
                best = choice = b.best
                b.since += 1
                if b.since > self.explore_every:
                    near = [k for k in (best - 1, best + 1) if k in b.arms]
                    k = near[b.explored % len(near)]  # a neighbour again, so that the choice can move
                    # its cost predicted from what it measured, so that the exploration fits in the budget after it
                    if b.spent + self._predicted(b, k) <= self.explore_share * b.seconds:
                        choice = b.exploring = k
                        b.episode = 0.0
                        b.explored += 1
                        b.since = 0
            b.last = choice
            return choice

    def _predicted(self, b: _Bucket, k: int) -> float:
        """What exploring window ``k`` once costs in ``b`` (seconds), predicted from measured steps.

        Its slowest recent step's time over the best arm's time for as many tokens, and, where the best runs parked
        (window 0, after a catch-up was measured in ``b``), the last catch-up's cost; at least what its last
        exploration cost (settling steps included). A window ``b`` has not measured takes the nearest smaller
        bucket's prediction, scaled by the two buckets' best step times, or else the costliest window ``b`` measured.
        """
        best = b.arms[b.best]
        if best.rate <= 0:
            return 0.0
        arm, cost = b.arms[k], b.explored_cost.get(k, 0.0)
        if arm.recent:
            catch = self._lost(b, *b.catch_up) if b.catch_up is not None and b.best == 0 < k else 0.0
            return max(cost, self._lost(b, arm.tokens, arm.slowest()) + catch)
        below = [v for key, v in sorted(self._buckets.items()) if key < b.key and v.arms[k].recent]
        if below and below[-1].arms[below[-1].best].rate > 0:
            src = below[-1]
            src_step = src.arms[src.best].tokens / src.arms[src.best].rate
            if src_step > 0:
                return max(cost, self._predicted(src, k) * (best.tokens / best.rate) / src_step)
        measured = [self._predicted(b, j) for j, a in b.arms.items() if a.recent and j != b.best]
        return max([cost, *measured])

    @staticmethod
    def _lost(b: _Bucket, tokens: int, seconds: float) -> float:
        """What a step of ``tokens`` in ``seconds`` cost over the best arm's time for as many tokens (>= 0)."""
        best = b.arms[b.best].rate
        return max(0.0, seconds - tokens / best) if best > 0 else 0.0

    def _untried(self, b: _Bucket) -> int | None:
        """The next arm still to measure in order (see the module docstring), or None when the best may run."""
        for k, arm in b.arms.items():
            if len(arm.recent) >= self.warmup:
                continue
            if k >= 1 and b.drafting_lost_below:
                return None
            if k >= 2 and b.arms[k - 1].rate <= b.arms[k - 2].rate:
                return None  # one more drafted token did not pay: the longer windows are left to exploration
            return k
        return None

    def measured(self, rows: int, window: int, tokens: int, seconds: float) -> None:
        """What a step of ``rows`` rows drafting ``window`` gave: ``tokens`` emitted over all rows in ``seconds``."""
        if seconds <= 0 or window not in range(self.max_window + 1):
            return
        with self._lock:
            b = self._bucket(rows)
            if window != b.best and self._untried(b) is None:  # an exploration: its cost, before its rate
                lost = self._lost(b, tokens, seconds)
                b.spent += lost
                if b.exploring == window:
                    b.explored_cost[window] = b.episode + lost
                    b.exploring = None
            b.seconds += seconds
            arm = b.arms[window]
            arm.steps += 1
            if arm.steps > self.settle:
                arm.add(tokens, seconds)
                b.best = max((k for k, a in b.arms.items() if a.recent), key=lambda k: b.arms[k].rate)

    def caught_up(self, rows: int, tokens: int, seconds: float) -> None:
        """A catch-up step of ``rows`` rows (the drafter back after parked steps, drafting nothing).

        Its time over the best arm's for its ``tokens`` is counted in what exploring costs where an exploration
        follows it; before a window's first measure in the bucket, in what measuring costs; before the bucket's best
        window (the drafter back after steps parked in another bucket), in what switching costs; never in a
        window's rate.
        """
        if seconds <= 0:
            return
        with self._lock:
            b = self._bucket(rows)
            lost = self._lost(b, tokens, seconds)
            if b.exploring is not None:
                b.spent += lost
                b.episode += lost
            elif self._untried(b) is not None:
                b.measuring += lost
            else:  # the best window back after steps parked in another bucket (a batch that shrank, its tail)
                b.switching += lost
            b.seconds += seconds
            b.catch_ups += 1
            b.catch_up = (tokens, seconds)

    def _bucket(self, rows: int) -> _Bucket:
        key = bucket(rows)
        b = self._buckets.get(key)
        if b is None:
            b = self._buckets[key] = _Bucket(key, {k: _Arm() for k in range(self.max_window + 1)})
            below = [v for k, v in sorted(self._buckets.items()) if k < key and self._trusted(v, 1)]
            if below:  # the largest smaller bucket that measured one drafted token against none
                b.drafting_lost_below = below[-1].arms[1].rate < below[-1].arms[0].rate
        return b

    def _trusted(self, b: _Bucket, k: int) -> bool:
        """Whether arms 0..k of ``b`` have each been measured ``warmup`` times."""
        return all(len(b.arms[i].recent) >= self.warmup for i in range(min(k, self.max_window) + 1))

    def report(self) -> dict[str, Any]:
        """Per batch size bucket: the window chosen last, each window's measured tokens per second and steps.

        And the bucket's catch-up steps, and the shares of its measured time that exploring (capped at
        ``explore_share``), the first measures and the switches back from another bucket's parked steps cost,
        each with its catch-ups.
        """
        with self._lock:
            return {
                f"{key} rows": {
                    "window": b.last,
                    "tok_s": {k: round(a.rate, 1) for k, a in b.arms.items() if a.recent},
                    "steps": {k: a.steps for k, a in b.arms.items() if a.steps},
                    "catch_up_steps": b.catch_ups,
                    "exploring_share": round(b.spent / b.seconds, 4) if b.seconds else 0.0,
                    "measuring_share": round(b.measuring / b.seconds, 4) if b.seconds else 0.0,
                    "switching_share": round(b.switching / b.seconds, 4) if b.seconds else 0.0,
                }
                for key, b in sorted(self._buckets.items())
            }


def decoding_only(results: list[dict[str, Any]]) -> bool:
    """Whether one ``iterate()`` only decoded (False when it read a prompt, failed, or did nothing)."""
    return bool(results) and all(r.get("stage") == "streaming" for r in results)
