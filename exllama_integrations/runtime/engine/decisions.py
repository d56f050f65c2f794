"""Decision label scoring across the engine wire: a :class:`~...contract.decisions.LabelScoring` in, scores out.

The runtime's side (:func:`score_on`) sends one ``labels`` message per job and returns a future at once; the engine's
side (:class:`EngineScorer`) hands the job to its backend's :meth:`~...contract.decisions.ScoresLabels.score_labels`
(run on the backend's own thread between steps, as in process) and answers with the label log-probabilities, or
with the typed error. The scores travel as JSON floats (``repr`` round-trips a float64 exactly), so an answer is
bitwise the one the backend computed: the same as ``engine="thread"`` on the same backend.

A job is counted as work the engine holds while it runs: its watchdog sees a driver stalled in a scoring, an engine
that dies or hangs ends the job's future with :class:`~...errors.EngineUnavailableError` like its streams. A
caller that cancels the future (a client gone) sends ``cancel_labels``: a job not started yet is dropped.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol

from ...contract.decisions import LabelBranch, LabelLogprobs, LabelScoring, ScoresLabels
from ...errors import EngineUnavailableError, ProtocolError, UnsupportedTaskError, error_from_wire
from .wire import error_wire

if TYPE_CHECKING:
    from .client import EngineProcess


class Messages(Protocol):
    """Where the engine side sends a message to its runtime (the engine's :class:`~.process.Outbox`)."""

    def message(self, message: dict[str, Any], frames: tuple[bytes, ...] = ()) -> None: ...


MAX_JOB_TOKENS = 1 << 20
"""Most token ids one job may carry across the wire (a request's bounds keep real ones far below)."""


def job_to_wire(job: LabelScoring) -> dict[str, Any]:
    """A scoring job as data."""
    return {
        "prefix": list(job.prefix),
        "branches": [[list(b.suffix), [list(lab) for lab in b.labels]] for b in job.branches],
    }


def job_from_wire(data: Any) -> LabelScoring:
    """A scoring job back from data.

    Raises:
        ProtocolError: another shape, or more than ``MAX_JOB_TOKENS`` ids.
    """
    try:
        prefix = tuple(int(t) for t in data["prefix"])
        branches = tuple(
            LabelBranch(tuple(int(t) for t in suffix), tuple(tuple(int(t) for t in lab) for lab in labs))
            for suffix, labs in data["branches"]
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ProtocolError(f"a label-scoring job the engine cannot read: {e!r}") from None
    job = LabelScoring(prefix, branches)
    size = len(prefix) + sum(len(b.suffix) + sum(len(lab) for lab in b.labels) for b in branches)
    if size > MAX_JOB_TOKENS:
        raise ProtocolError(f"a label-scoring job of {size} tokens, more than the {MAX_JOB_TOKENS} allowed.")
    return job


def scores_from_wire(data: Any, job: LabelScoring) -> LabelLogprobs:
    """The scores of ``job`` back from data.

    Raises:
        ProtocolError: not one score per label of each branch.
    """
    try:
        out = tuple(tuple(float(s) for s in row) for row in data)
    except (TypeError, ValueError) as e:
        raise ProtocolError(f"label scores this side cannot read: {e!r}") from None
    if [len(r) for r in out] != [len(b.labels) for b in job.branches]:
        raise ProtocolError("the engine answered label scores of another shape than the job's.")
    return out


class EngineScorer:
    """The engine's side: jobs handed to the backend, answered on the outbox when done."""

    def __init__(self, backend: Any, out: Messages, name: str) -> None:
        self.backend, self.out, self.name = backend, out, name
        self._lock = threading.Lock()
        self._running: dict[int, Future[LabelLogprobs]] = {}
        self.since = 0.0
        """When a job last started or ended (progress, for the engine's stall watch)."""

    def busy(self) -> bool:
        """Whether a job is in flight (the driver owes progress)."""
        with self._lock:
            return bool(self._running)

    def start(self, message: dict[str, Any]) -> None:
        """Start one job (``{"call", "job"}``); a job that cannot start is answered with its typed error at once."""
        call = int(message["call"])
        try:
            if not isinstance(self.backend, ScoresLabels):
                raise UnsupportedTaskError(
                    f"decisions are read from label probabilities, which backend {self.name!r} does not compute; "
                    "serve the model on backend 'transformers' or 'exllamav3'."
                )
            future = self.backend.score_labels(job_from_wire(message["job"]))
        except Exception as e:  # noqa: BLE001 - answered typed; the engine goes on
            self.out.message({"op": "labels", "call": call, "error": error_wire(e, self.name)})
            return
        with self._lock:
            self._running[call] = future
            self.since = time.monotonic()
        future.add_done_callback(lambda f: self._answer(call, f))

    def _answer(self, call: int, future: Future[LabelLogprobs]) -> None:
        with self._lock:
            self._running.pop(call, None)
            self.since = time.monotonic()
        if future.cancelled():
            return  # the runtime cancelled it and waits for nothing
        error = future.exception()
        if error is not None:
            self.out.message({"op": "labels", "call": call, "error": error_wire(error, self.name)})
        else:
            self.out.message({"op": "labels", "call": call, "scores": [list(r) for r in future.result()]})

    def cancel(self, calls: Sequence[Any]) -> None:
        """Drop jobs not started yet (one running finishes; its answer is not awaited)."""
        with self._lock:
            found = [self._running.get(int(c)) for c in calls]
        for future in found:
            if future is not None:
                future.cancel()


def score_on(engine: EngineProcess, job: LabelScoring) -> Future[LabelLogprobs]:
    """The runtime's side: ``job`` sent to ``engine``; its future ends with the scores or the typed error.

    Cancelling the future tells the engine (a job not started there is dropped).
    """
    from .client import _Call

    result: Future[LabelLogprobs] = Future()  # left pending: a caller's cancel() takes

    def done(call: _Call) -> None:
        if result.done():
            return
        reply = call.reply or {}
        try:
            if call.error is not None:
                raise call.error
            if reply.get("error") is not None:
                raise error_from_wire(reply["error"])
            result.set_result(scores_from_wire(reply.get("scores"), job))
        except BaseException as e:  # noqa: BLE001 - the caller gets it
            result.set_exception(e)

    call_id = engine.open_call(done)
    if call_id is None:
        result.set_exception(
            EngineUnavailableError(f"{engine.problem or 'the runtime was closed'}; retry in a moment.")
        )
        return result

    def cancelled(f: Future[LabelLogprobs]) -> None:
        if f.cancelled() and engine.drop_call(call_id):
            try:
                engine._send({"op": "cancel_labels", "calls": [call_id]})
            except EngineUnavailableError:
                pass  # a dead engine's work is gone with it

    result.add_done_callback(cancelled)
    try:
        engine._send({"op": "labels", "call": call_id, "job": job_to_wire(job)})
    except Exception as e:  # noqa: BLE001 - nothing stays registered; the caller gets it typed
        engine.drop_call(call_id)
        if not result.done():
            result.set_exception(e)
    return result


__all__ = ["MAX_JOB_TOKENS", "EngineScorer", "job_from_wire", "job_to_wire", "score_on", "scores_from_wire"]
