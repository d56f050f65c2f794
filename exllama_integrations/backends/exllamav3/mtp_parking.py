"""MTP drafting with ``draft_window="measured"``: the drafter parked on the steps the rule drafts nothing on.

exllamav3 (1.6.5) pays for an MTP drafter on every step once it has one, whatever the window: a prompt runs through
the final norm (its hidden states exported) and then through the head into the head's own cache (``Job.prefill``),
and every decode step exports the target's last hidden state and keeps a copy per job, the *carry* the head drafts
from next (``Job.mtp_last_hidden``, set in ``Generator.iterate_gen``). A batch where drafting loses (the rule's
window 0) still paid all of it: 0.885 of a runtime without a drafter at 16 jobs on an H100
(benchmarks/results/gpu_mtp_run3_h100.json).

**Parked** (window 0): the one ``iterate()`` runs as a generator without a drafter runs it (``Generator.draft_model``
None and ``mtp_draft`` False for the call, restored after it): no export, no carry, no head, a prompt admitted
meanwhile prefilled as without a drafter; with ``decode="fast"`` it replays the graph a runtime without a drafter
replays (kept beside the exporting one, :mod:`.fast.graphs`).

**Catch-up** (a window above 0 after a parked step): every job's carry is stale (it stands before the parked steps)
or missing (a job admitted while parked). exllamav3 takes a fresh carry from every target forward of an attached
drafter, and drafts only from carries, so the first step back runs attached at window 0: a step like any other
(every row emits its token) whose forward hands every decoding job its carry at its current position. The window
the rule chose runs on the next step (the plan keeps it), so a drafted step never reads a stale carry, and the rule
counts the catch-up in what exploring costs (:meth:`.draft_rule.DraftRule.caught_up`), not in the window's rate.

The head's own cache gets nothing for the positions the parked steps went through (nor for the prompt of a job
admitted while parked), as exllamav3 leaves it for any step it runs at window 0 (``row_limited``): the head attends
over what those pages held, which can lower its acceptance, never change a token (the target verifies every drafted
token). The rule measures acceptance as it comes.

A job that ends on a parked step: exllamav3 leaves its drafted counts out of the last result when the generator has
no drafter (``Job`` keeps them); :meth:`MtpParking.run` puts them back, so that the request's usage and the model's
counts (``diagnostics()["drafting"]``, ``/metrics``) hold every drafted token.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from typing import Any, NamedTuple

from .draft_rule import bucket

PARKED, CATCH_UP, DRAFTING = "parked", "catch_up", "drafting"


class Step(NamedTuple):
    """One step's plan: its kind (:data:`PARKED`, :data:`CATCH_UP`, :data:`DRAFTING`) and the rule's window.

    A catch-up step runs at window 0; the window it carries runs on the next step.
    """

    kind: str
    window: int


class MtpParking:
    """Parks an exllamav3 generator's MTP drafter on the steps that draft nothing (see the module docstring)."""

    def __init__(self, generator: Any) -> None:
        self.generator = generator
        self.drafter, self.mtp = generator.draft_model, generator.mtp_draft
        self.parked = False  # the last step ran parked: a window above 0 needs a catch-up step first
        self._pending: tuple[int, int] | None = None  # (bucket, window) the rule chose for the step after a catch-up
        self._steps: Counter[str] = Counter()
        self._lock = threading.Lock()

    def plan(self, rows: int, choose: Callable[[int], int]) -> Step:
        """This step's plan for ``rows`` decoding rows; ``choose(rows)`` gives the rule's window.

        The rule is not asked on the step after a catch-up of the same bucket: the window it chose then runs now.
        """
        pending, self._pending = self._pending, None
        window = pending[1] if pending is not None and pending[0] == bucket(rows) else choose(rows)
        if window == 0:
            return Step(PARKED, 0)
        if self.parked:
            self._pending = (bucket(rows), window)
            return Step(CATCH_UP, window)
        return Step(DRAFTING, window)

    def run(self, step: Step, iterate: Callable[[], list[dict[str, Any]]]) -> list[dict[str, Any]]:
        """One ``iterate()`` as ``step`` plans it; its results (a job that ended parked with its drafted counts)."""
        gen, kind = self.generator, step.kind
        gen.num_draft_tokens = step.window if kind == DRAFTING else 0  # read by iterate() (row_limited)
        parked = kind == PARKED
        if parked:
            gen.draft_model, gen.mtp_draft = None, False
        try:
            results = iterate()
        finally:
            if parked:
                gen.draft_model, gen.mtp_draft = self.drafter, self.mtp
            self.parked = parked
            with self._lock:
                self._steps[kind] += 1
        if parked:
            for r in results:
                job = r.get("job")
                if r.get("eos") and r.get("stage") == "streaming" and "accepted_draft_tokens" not in r and job:
                    r["accepted_draft_tokens"] = int(job.accepted_draft_tokens)
                    r["rejected_draft_tokens"] = int(job.rejected_draft_tokens)
        return results

    def report(self) -> dict[str, int]:
        """Steps run parked (no drafter), as catch-ups (the drafter back, drafting nothing) and drafting."""
        with self._lock:
            return {f"{k}_steps": self._steps[k] for k in (PARKED, CATCH_UP, DRAFTING)}


__all__ = ["CATCH_UP", "DRAFTING", "PARKED", "MtpParking", "Step"]
