"""One generation as an object: backend steps in, stream chunks out.

The backend's thread hands steps to the ``emit`` of :meth:`Run.emit_to` (which timestamps them) and never
waits for the reader; the reader turns them into chunks with :meth:`Run.feed` (detokenizing, stop strings,
the reasoning split, usage), through :class:`LocalStream` (a thread) or :func:`aiter_run` (an event loop).
A reader that stops reading, or closes, cancels the request: the backend ends it within a step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from typing import TYPE_CHECKING, Any

from ...backends.base import BackendRequest, RawLogprob, TokenStep
from ...contract.api import GenerationResult, StreamChunk, Timings, TokenLogprob, TopLogprob, Usage, result_of
from ...errors import ExLlamaIntegrationsError, GenerationError
from ...model.detokenizer import IncrementalDetokenizer, StopStringMatcher
from .reasoning import ReasoningControl, ReasoningSplitter

if TYPE_CHECKING:
    from ...contract.settings import GenerationSettings
    from ...model.grammar import ConstraintMatcher
    from ...model.tokenizer import NativeTokenizer

WATCH_EVERY = 8
"""Steps a whole-completion reader's tokens are held at most while it watches for stop strings."""

_NATIVE_FINISH = {"length": "length", "end": "eos", "cancelled": "cancelled", "stop_token": "eos"}


class Run:
    """The state of one generation on the reader's side."""

    def __init__(
        self,
        tokenizer: NativeTokenizer,
        settings: GenerationSettings,
        prompt_ids: list[int],
        stop_token_ids: frozenset[int],
        matcher: ConstraintMatcher | None,
        backend: str,
        control: ReasoningControl | None = None,
        shown: Mapping[int, str] | None = None,
    ) -> None:
        self.tokenizer, self.settings, self.matcher, self.backend = tokenizer, settings, matcher, backend
        self.prompt_len = len(prompt_ids)
        self.stop_token_ids = stop_token_ids
        self.control = control
        self._detok = IncrementalDetokenizer(tokenizer, shown=shown)
        self._stops = StopStringMatcher(settings.stop)
        self._split = ReasoningSplitter(control.reasoning) if control is not None else None
        self._cached: int | None = None
        self._drafted = (0, 0)  # drafted tokens accepted and rejected (the backend says on the last step)
        self._accepting: bool | None = None
        self._t0 = time.perf_counter()
        self._t_first: float | None = None
        self._t_last = self._t0
        self._n = 0
        self._chunks: list[StreamChunk] = []
        self.result: GenerationResult | None = None
        self._prompt_lps: tuple[TokenLogprob, ...] | None = None

    @property
    def finished(self) -> bool:
        """Whether the final chunk was produced."""
        return self.result is not None

    def emit_to(
        self, put: Callable[[list[tuple[TokenStep, float]]], None], incremental: bool = True
    ) -> Callable[[TokenStep], None]:
        """The ``emit`` for the backend: timestamp each step and hand it on.

        ``incremental=False`` (a reader of the whole completion): the steps are held and handed on together
        when the generation ends, or every ``WATCH_EVERY`` steps while stop strings must be watched, so the
        reader's thread wakes once instead of once per token (under load those wake-ups cost the driver
        its GIL). Each step keeps its own timestamp, so time to first token stays exact.
        """
        held: list[tuple[TokenStep, float]] = []
        lock = threading.Lock()
        every = WATCH_EVERY if self.settings.stop else 0

        def emit(step: TokenStep) -> None:
            t = time.perf_counter()
            if incremental:
                put([(step, t)])
                return
            with lock:  # steps come from the backend's thread; a final one may come from close()
                held.append((step, t))
                if step.finish is None and (not every or len(held) < every):
                    return
                items = held[:]
                held.clear()
            put(items)

        return emit

    def _logprobs(self, raw: tuple[RawLogprob, ...]) -> tuple[TokenLogprob, ...]:
        def text(tid: int) -> str:
            return self.tokenizer.decode([tid], skip_special_tokens=False)

        return tuple(
            TokenLogprob(
                lp.token_id, text(lp.token_id), lp.logprob, tuple(TopLogprob(t, text(t), v) for t, v in lp.top)
            )
            for lp in raw
        )

    def feed(self, step: TokenStep, t: float) -> list[StreamChunk]:
        """The chunks for one backend step (the final one included when the generation ends here)."""
        if step.error is not None:
            if isinstance(step.error, ExLlamaIntegrationsError):
                raise step.error
            raise GenerationError(
                f"the {self.backend} backend failed: {type(step.error).__name__}: {step.error}"
            ) from (step.error)
        if step.token_ids:
            self._t_first = self._t_first if self._t_first is not None else t
            self._t_last = t
        finish: str | None = None
        visible: list[int] = []
        for tid in step.token_ids:
            self._n += 1
            if tid in self.stop_token_ids:
                finish = "stop" if tid in self.settings.stop_token_ids else "eos"
                break
            visible.append(tid)
        if step.cached is not None:
            self._cached = step.cached
        if step.prompt_logprobs is not None:
            self._prompt_lps = self._logprobs(step.prompt_logprobs)
        if step.accepting is not None:
            self._accepting = step.accepting
        if step.drafted is not None:
            self._drafted = step.drafted
        lps = self._logprobs(step.logprobs[: len(visible)]) if step.logprobs else None
        text = self._stops.push(self._detok.add(visible)) if visible else ""
        stop_string = self._stops.stopped
        if stop_string is not None:
            finish = "stop"
        out: list[StreamChunk] = []
        if visible or text:  # a token that shows no text yet (half a character) still travels with its id
            answer, reasoning = self._split.push(text) if self._split is not None else (text, "")
            out.append(StreamChunk(answer, tuple(visible), lps, reasoning=reasoning, cached_tokens=self._cached))
            self._chunks.append(out[-1])
        if finish is None and step.finish is not None:
            finish = _NATIVE_FINISH[step.finish]
        if finish is not None:
            out.append(self._final(finish, stop_string))
        return out

    def feed_all(self, steps: list[tuple[TokenStep, float]]) -> list[StreamChunk]:
        """The chunks for several steps that were waiting, as one chunk of text (and the final one when it ends).

        A reader that falls behind under load takes everything queued at once: one chunk, one callback,
        instead of one per token, so the readers' work does not grow with the load (the GIL is shared with
        the backend's driver).
        """
        if len(steps) > 2 and not self.settings.stop:
            steps = [steps[0], _joined(steps[1:])]
        out: list[StreamChunk] = []
        for step, t in steps:
            if self.finished:
                break
            out += self.feed(step, t)
        body = [c for c in out if c.finish_reason is None]
        if len(body) < 2:
            return out
        lps = [lp for c in body for lp in (c.logprobs or ())] if any(c.logprobs for c in body) else None
        merged = StreamChunk(
            "".join(c.text for c in body),
            tuple(t for c in body for t in c.token_ids),
            tuple(lps) if lps else None,
            reasoning="".join(c.reasoning for c in body),
            cached_tokens=body[-1].cached_tokens,
        )
        return [merged, *(c for c in out if c.finish_reason is not None)]

    def _final(self, finish: Any, stop_string: str | None) -> StreamChunk:
        tail = ""
        if stop_string is None:
            tail = self._stops.push(self._detok.flush())
            if self._stops.stopped is not None:  # a stop string completed in the last held-back bytes
                finish, stop_string = "stop", self._stops.stopped
            else:
                tail += self._stops.flush()
        reasoning = ""
        if self._split is not None:
            tail, reasoning = self._split.push(tail)
            more_answer, more_reasoning = self._split.flush()
            tail, reasoning = tail + more_answer, reasoning + more_reasoning
        now = time.perf_counter()
        t_first = self._t_first
        tps = (self._n - 1) / (self._t_last - t_first) if t_first is not None and self._t_last > t_first else None
        complete = self._accepting
        if complete is None and self.matcher is not None:
            complete = self.matcher.is_accepting()
        thought = self.control.reasoning_tokens if self.control is not None else 0
        final = StreamChunk(
            tail,
            (),
            None,
            finish,
            Usage(self.prompt_len, self._n, min(thought, self._n), self._cached or 0, *self._drafted),
            Timings(None if t_first is None else t_first - self._t0, now - self._t0, tps),
            stop_string,
            complete,
            reasoning,
            self._prompt_lps,
            self._cached,
        )
        self.result = result_of([*self._chunks, final], self.backend)
        if self.settings.logprobs is not None and self.result.logprobs is None:
            self.result = dataclasses.replace(self.result, logprobs=())
        return final


def _joined(steps: list[tuple[TokenStep, float]]) -> tuple[TokenStep, float]:
    """Steps with nothing to watch between them as one step, detokenized at once, at the last one's time.

    Only without stop strings (a backend itself ends a run at its stop ids); :meth:`Run.feed_all` keeps the
    first step apart, for the time to first token.
    """
    raw = [lp for s, _ in steps for lp in (s.logprobs or ())] if any(s.logprobs for s, _ in steps) else None
    last = steps[-1][0]
    ids = tuple(t for s, _ in steps for t in s.token_ids)
    joined = dataclasses.replace(last, token_ids=ids, logprobs=tuple(raw) if raw else None)
    return joined, steps[-1][1]


class LocalStream:
    """A generation read from a thread: iterate for chunks; ``close()`` (or ``break``) cancels it.

    After it is exhausted, :attr:`result` holds the :class:`~exllama_integrations.contract.api.GenerationResult`.
    """

    def __init__(self, run: Run, request: BackendRequest, steps: queue.SimpleQueue[Any], done: Callable[[], None]):
        self._run, self._request, self._steps, self._done_cb = run, request, steps, done
        self._pending: deque[StreamChunk] = deque()
        self._closed = False

    @property
    def result(self) -> GenerationResult | None:
        """The finished generation (None until the stream is exhausted)."""
        return self._run.result

    def __iter__(self) -> LocalStream:
        return self

    def __next__(self) -> StreamChunk:
        while not self._pending:
            if self._closed or self._run.finished:
                self._release()
                raise StopIteration
            waiting = list(self._steps.get())
            while True:  # take what else is already there (a reader that fell behind catches up at once)
                try:
                    waiting += self._steps.get_nowait()
                except queue.Empty:
                    break
            try:
                self._pending.extend(self._run.feed_all(waiting))
            except BaseException:
                self._release()
                raise
            if self._run.finished:
                self._release()
        return self._pending.popleft()

    def cancel(self) -> None:
        """Ask the generation to stop at its next step (safe from any thread)."""
        self._request.cancel.set()

    def _release(self) -> None:
        if not self._closed:
            self._closed = True
            self._request.cancel.set()  # after a stop string, the backend may still be decoding
            self._done_cb()

    def close(self) -> None:
        """Stop the generation now; the backend ends it within a step."""
        self._pending.clear()
        self._release()

    def __enter__(self) -> LocalStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - never raise from a finalizer
            pass


def async_queue() -> tuple[asyncio.Queue[Any], Callable[[Any], None]]:
    """A queue on the running loop, and a thread-safe ``put`` for the backend's side."""
    loop = asyncio.get_running_loop()
    q: asyncio.Queue[Any] = asyncio.Queue()

    def put(item: Any) -> None:
        try:
            loop.call_soon_threadsafe(q.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    return q, put


async def aiter_run(run: Run, steps: asyncio.Queue[Any]) -> AsyncIterator[StreamChunk]:
    """A generation read from an event loop (no thread per stream), all waiting steps at a time.

    Its caller cancels the request when it stops reading (synchronously, in its own ``finally``: an
    async generator abandoned mid-way is finalized only later).
    """
    while not run.finished:
        waiting = list(await steps.get())
        while not steps.empty():
            waiting += steps.get_nowait()
        for chunk in run.feed_all(waiting):
            yield chunk
