"""The exllamav3 driver: one thread that owns the Generator. Requests from an inbox in, token steps out.

It takes what callers handed in between steps (an idle driver waits a moment for a burst, see
:class:`~..inbox.Inbox`), builds their Jobs on its own thread (under load every Python step a caller takes
before its request is in waits for the GIL the driver holds), runs ``iterate()`` while jobs exist, and hands
each request its tokens: every step, or every ``stream_interval`` steps while other jobs decode (its first token
at once, and every step while stop strings are watched; ``"auto"``: more steps the more jobs decode). A reasoning
request's control sees every token at once, whatever the interval: it may write the end of the thinking
block (``constrain_output_now``) or attach the grammar for the answer (``set_filters``) before the next step.
A cancelled request leaves the batch at the next step; ``close`` stops the thread after the step in flight.

It is handed the generator and a job factory, so its bookkeeping is tested with a fake generator.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from ..base import BackendRequest, TokenStep, fail_all
from ..inbox import Inbox, WorkerTask
from .draft_rule import DraftRule, decoding_only
from .mtp_parking import CATCH_UP, DRAFTING, MtpParking, Step
from .translate import DraftCounts, LiveJob, finish_of, tokens_of

logger = logging.getLogger(__name__)

JobFactory = Callable[[BackendRequest], tuple[Any, bool]]
"""A request -> its Job, and whether its grammar filter waits to be attached (see ``translate.job_for``)."""
FilterFactory = Callable[[BackendRequest], Any]


AUTO_READERS = 8
"""``stream_interval="auto"``: about this many requests get their tokens in each step (see the option). On the
H200 (EXL3, 64 ``stream()`` threads, ``benchmarks/results/gpu_load_run1[89]*streams64*.json``, run 20) intervals of
1, 4, 8 and 16 gave 0.64, 0.82-0.91, 0.91-1.01 and 0.91 of raw threads' tokens/s: the gain levels off at 8."""


def delivery_interval(option: int | str, live: int) -> int:
    """Steps between deliveries to a request while ``live`` jobs decode (``option``: ``stream_interval``)."""
    if option == "auto":
        return max(1, live // AUTO_READERS)
    return int(option) if live > 1 else 1


class Driver:
    """Runs a Generator on its own thread (see the module docstring)."""

    def __init__(
        self,
        generator: Any,
        inbox: Inbox,
        make_job: JobFactory,
        make_filter: FilterFactory,
        interval: int | str = 1,
        step_context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
        drafts: DraftCounts | None = None,
        draft_rule: DraftRule | None = None,
        parking: MtpParking | None = None,
    ) -> None:
        """The driver of ``generator``; its thread starts with :meth:`start`.

        ``step_context``: entered around each ``iterate()`` (``torch.inference_mode`` on the GPU); ``drafts``: where
        a finished job's drafted tokens are counted (speculative decoding); ``draft_rule``: chooses each step's draft
        window from what the steps measured (:mod:`.draft_rule`); ``parking``: an MTP drafter detached on the steps
        the rule drafts nothing on (:mod:`.mtp_parking`).
        """
        self.generator, self.inbox = generator, inbox
        self.drafts, self.draft_rule, self.parking = drafts, draft_rule, parking
        self._make_job, self._make_filter = make_job, make_filter
        self.interval = interval
        self._step_context = step_context
        self._live: dict[int, LiveJob] = {}
        self._thread = threading.Thread(target=self._run, name="exllama-exllamav3-driver", daemon=True)

    def start(self) -> None:
        """Start the thread."""
        self._thread.start()

    def stop(self) -> None:
        """Take no more requests (those waiting end cancelled) and wait for the step in flight."""
        fail_all(self.inbox.close())
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    @property
    def live(self) -> int:
        """Jobs decoding now."""
        return len(self._live)

    # ------------------------------------------------------------------ the loop

    def _run(self) -> None:
        gen, live = self.generator, self._live
        try:
            while True:
                incoming = self.inbox.take(idle=not live)
                if incoming is None:
                    break
                for req in incoming:
                    if isinstance(req, WorkerTask):  # work handed in beside requests (label scoring), between steps
                        with self._step_context():
                            req.run()
                    else:
                        self._enqueue(req)
                for key, entry in list(live.items()):
                    if entry.req.cancel.is_set():
                        gen.cancel(entry.job)
                        del live[key]
                        entry.req.emit(TokenStep(finish="cancelled"))
                if not live:
                    continue
                rows, rule = len(live), self.draft_rule
                step = self._plan(rows)
                drafted = step is not None and step.kind == DRAFTING and step.window > 0
                before = [(e.job, e.job.new_tokens) for e in live.values()] if drafted else None
                try:
                    t0 = time.perf_counter()
                    with self._step_context():
                        results = self._iterate(step)
                    if rule is not None and step is not None and not incoming and decoding_only(results):
                        # a step of decoding only (no prompt was read): what every job advanced, in its time (not
                        # what it emitted: exllamav3 holds a token back while its text ends in a partial character);
                        # a step drafting nothing advances every job one token and gives one result for each
                        seconds = time.perf_counter() - t0
                        tokens = sum(job.new_tokens - n for job, n in before) if before is not None else len(results)
                        if step.kind == CATCH_UP:  # the drafter back, drafting nothing: a cost, not the window's rate
                            rule.caught_up(rows, tokens, seconds)
                        else:
                            rule.measured(rows, step.window, tokens, seconds)
                except Exception as e:  # noqa: BLE001 - fail every caller, keep serving
                    logger.exception("exllamav3 iterate() failed")
                    for entry in live.values():
                        gen.cancel(entry.job)
                        entry.req.emit(TokenStep(finish="error", error=e))
                    live.clear()
                    continue
                interval = delivery_interval(self.interval, len(live))
                for r in results:
                    found = live.get(id(r.get("job")))
                    if found is not None and self._deliver(r, found, interval):
                        del live[id(r["job"])]
        except BaseException as e:  # noqa: BLE001 - never leave a reader waiting
            logger.exception("exllamav3 driver stopped")
            fail_all([entry.req for entry in live.values()], e)
            live.clear()
        finally:
            for entry in live.values():
                with contextlib.suppress(Exception):  # the generator is going away anyway
                    gen.cancel(entry.job)
                entry.req.emit(TokenStep(finish="cancelled"))
            live.clear()
            fail_all(self.inbox.close())

    def _plan(self, rows: int) -> Step | None:
        """This step's draft window (None without a rule), and with an MTP drafter whether it runs parked."""
        rule = self.draft_rule
        if rule is None:
            return None
        if self.parking is not None:
            return self.parking.plan(rows, rule.window)
        return Step(DRAFTING, rule.window(rows))

    def _iterate(self, step: Step | None) -> list[dict[str, Any]]:
        gen = self.generator
        if step is None:
            return gen.iterate()  # type: ignore[no-any-return]
        if self.parking is not None:
            return self.parking.run(step, gen.iterate)
        gen.num_draft_tokens = step.window  # read by iterate() when it drafts (exllamav3's row_limited)
        return gen.iterate()  # type: ignore[no-any-return]

    def _enqueue(self, req: BackendRequest) -> None:
        try:
            job, deferred = self._make_job(req)
            self.generator.enqueue(job)
            self._live[id(job)] = LiveJob(job, req, deferred)
        except Exception as e:  # noqa: BLE001 - a bad request fails alone; the driver goes on
            req.emit(TokenStep(finish="error", error=e))

    def _steer(self, entry: LiveJob, tokens: list[int]) -> None:
        """A reasoning request's control sees this step's tokens and may act on the job before the next step."""
        steer = entry.req.steering
        if steer is None:
            return
        steer.observe(tokens)
        forced = steer.forced()
        if forced:
            import torch

            entry.job.constrain_output_now(torch.tensor([forced], dtype=torch.long))
            entry.deferred = entry.req.constraint is not None  # forcing turned the job's filters off for good
        if entry.deferred and steer.constrained and getattr(entry.job, "forced_ids", None) is None:
            entry.job.set_filters([self._make_filter(entry.req)])
            entry.deferred = False

    def _deliver(self, r: dict[str, Any], entry: LiveJob, interval: int) -> bool:
        """Hand one iteration's result to its request (every ``interval`` steps); True when the job has ended."""
        req = entry.req
        if r.get("stage") == "error":
            req.emit(TokenStep(finish="error", error=r.get("error") or RuntimeError("exllamav3 job failed")))
            return True
        if r.get("stage") != "streaming":
            return False  # prefill progress
        tokens, lps = tokens_of(r, req.settings.logprobs)
        entry.hold(tokens, lps)
        if not r.get("eos"):
            self._steer(entry, tokens)
            if entry.tokens and (entry.steps >= interval or not entry.sent or req.settings.stop):
                req.emit(entry.take())  # the first token and stop-string watching never wait for the interval
            return False
        drafted = self.drafts.add(r) if self.drafts is not None else None
        finish = finish_of(r)
        if finish == "stop_token":
            # exllamav3 holds the stop token (and any pieces before it) back; pass them on so that the
            # runtime names the finish (eos or stop) and counts it, as on every other backend
            held, held_lps = tokens_of(r.get("held") or {}, req.settings.logprobs)
            entry.hold(held, held_lps, step=False)
            stop = int(r["eos_triggering_token_id"])
            if entry.tokens[-1:] != [stop]:
                entry.hold([stop], None, step=False)
        cached = r.get("cached_tokens")
        req.emit(entry.take(finish, cached if isinstance(cached, int) else None, drafted))
        return True

    def jobs(self) -> Iterator[tuple[Any, BackendRequest]]:
        """The live jobs and their requests (diagnostics)."""
        for entry in list(self._live.values()):
            yield entry.job, entry.req
