"""The fast path's one seam onto exllamav3: where its wraps are installed and removed, and what the features read.

What it relies on is declared in :mod:`..requirements` and checked against the installed library before anything is
wrapped (exllamav3's names come from the backend's one boundary, :mod:`...upstream`); the features (the batched
sampler, the captured step, running ahead, batched prefill) see exllamav3 only through the typed views of
:mod:`.views` and the hooks :class:`Seam` calls. :class:`Seam` installs every wrap of one generator as one unit and
removes them as one unit, whatever fails (as SGLang's ``patch_model`` does in one context), ``deterministic``'s
per-job pins (:mod:`..deterministic`, its policy) included.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any, Protocol

from ..deterministic import Pins, refuse_chunks
from ..requirements import EXPORT_PARAMS, PAGE_SIZE, PREFILL_PARAMS, STEP_PARAMS, VERIFIED, stands_aside
from ..step import TABLE_PAD, Forward, PageCopy
from . import prefix
from .moe import moe_report
from .views import GeneratorView, JobView, ModelView, PageView, qkv_pointers, view

logger = logging.getLogger(__name__)

__all__ = [
    "EXPORT_PARAMS",
    "PREFILL_PARAMS",
    "STEP_PARAMS",
    "TABLE_PAD",
    "VERIFIED",
    "Forward",
    "GeneratorView",
    "JobView",
    "ModelView",
    "PageCopy",
    "PageView",
    "moe_report",
    "qkv_pointers",
    "stands_aside",
    "view",
]


def page_size() -> int:
    """Tokens per page of exllamav3's paged cache (:data:`.requirements.PAGE_SIZE`, checked against exllamav3's)."""
    return PAGE_SIZE


# ---------------------------------------------------------------------- the hooks, installed as one unit


class Hooks(Protocol):
    """What the fast path does at each point the seam wraps (each call as a typed value: :mod:`..step`)."""

    def step(self, drafted: bool) -> Any:
        """A context for one ``iterate_gen`` (a decode step; ``drafted``: a window of draft tokens)."""

    def forward(self, call: Forward) -> Any:
        """A ``Model.forward`` (a decode step, or any other forward: ``call.step`` says)."""

    def prefill_chunk(self, call: Forward) -> Any:
        """A ``Model.prefill`` (a Job's prompt chunk)."""

    def copy_page(self, call: PageCopy) -> Any:
        """A ``Cache.copy_page`` (Job.prefill's reuse of a partly matching page)."""

    def tokens_read(self, ids: list[int]) -> None:
        """The step's tokens are on the host (exllamav3 read them back and synchronized)."""

    def iterate_end(self) -> None:
        """The end of ``Generator.iterate()`` (nothing is held between calls)."""


class Seam:
    """Every wrap of one exllamav3 generator, installed as one unit and removed as one unit."""

    def __init__(self, generator: Any) -> None:
        self.generator = generator
        self.jobs = GeneratorView(generator)
        self._undo: list[tuple[Any, str, bool, Any]] = []  # (object, name, had an instance value, that value)
        self._job_wraps: weakref.WeakSet[Any] = weakref.WeakSet()  # adopted jobs still alive
        self.pins: Pins | None = None  # deterministic: jobs whose prefill ignores the cache's history
        self.one_page: str | None = None  # deterministic: why prompts are prefilled one page a forward here
        self.own_forward: Callable[..., Any] = generator.model.forward  # exllamav3's own Model.forward

    def _wrap(self, obj: Any, name: str, new: Any) -> None:
        had = name in vars(obj)
        self._undo.append((obj, name, had, vars(obj).get(name)))
        setattr(obj, name, new)  # an instance attribute shadows the class's method

    def install(
        self, hooks: Hooks, prefill: bool, pointer_table: Callable[[Any], Any] | None, deterministic: bool = False
    ) -> None:
        """Wrap the generator, its model and cache for ``hooks``: all or nothing.

        ``prefill``: also ``Model.prefill`` and ``Cache.copy_page``; ``pointer_table(mq)``: a ``c_ptrs`` for each sliced
        Q/K/V GEMM; ``deterministic``: every job's prefill ignores what was cached before it
        (:class:`~..deterministic.Pins`), in blocks of ``max_chunk_size`` from position 0
        (:class:`.prefix.AlignedPrefix`; one page a forward on a model with recurrent layers, whose checkpoints
        exllamav3 places on pages).

        Raises:
            ValueError: ``deterministic`` with a generator whose two chunk sizes differ or are not whole pages.
        """
        gen = self.generator
        model, cache = gen.model, gen.cache
        k = refuse_chunks(gen.max_chunk_size, gen.shared_chunk_size) if deterministic else 1
        pins = self.pins = None
        try:
            if deterministic:
                self.one_page = prefix.one_page_why(gen) if k > 1 else None
                if self.one_page is not None:  # blocks of pages do not hold for this model: one page a forward
                    self._wrap(gen, "max_chunk_size", PAGE_SIZE)
                    self._wrap(gen, "shared_chunk_size", PAGE_SIZE)
                    k = 1
                pins = self.pins = Pins(prefix.AlignedPrefix(k) if k > 1 else None)
            iterate, iterate_gen, forward = gen.iterate, gen.iterate_gen, model.forward
            self.own_forward = forward

            def fast_iterate(*args: Any, **kwargs: Any) -> Any:
                if pins is not None:  # jobs enqueued since: before iterate() starts and prefills them
                    pins.pin_new((*gen.pending_jobs, *gen.active_jobs))
                try:
                    return iterate(*args, **kwargs)
                finally:
                    hooks.iterate_end()

            def fast_iterate_gen(results: list[Any], draft_tokens: Any = None) -> Any:
                with hooks.step(draft_tokens is not None):
                    return iterate_gen(results, draft_tokens)

            self._wrap(gen, "iterate", fast_iterate)
            self._wrap(gen, "iterate_gen", fast_iterate_gen)
            self._wrap(model, "forward", lambda *a, **k: hooks.forward(Forward.of(forward, a, k)))
            prefetch = model.prefetch_tokens

            def prefetch_tokens(ids: list[int]) -> None:
                prefetch(ids)
                hooks.tokens_read(ids)

            self._wrap(model, "prefetch_tokens", prefetch_tokens)
            if prefill:
                own_prefill, copy_page = model.prefill, cache.copy_page
                self._wrap(model, "prefill", lambda *a, **k: hooks.prefill_chunk(Forward.of(own_prefill, a, k)))
                self._wrap(cache, "copy_page", lambda *a, **k: hooks.copy_page(PageCopy.of(copy_page, a, k, cache)))
            if pointer_table is not None:  # (recurrent: a ring or GDN model's attention runs sliced Q/K/V GEMMs too)
                captured = ModelView(model, recurrent=True)
                for mq in captured.sliced_qkv() if captured.why_not is None else []:
                    if "c_ptrs" not in vars(mq):
                        self._wrap(mq, "c_ptrs", pointer_table(mq))
        except Exception:
            self.remove()
            raise

    def adopt(self, job: Any, token_for: Callable[[Any], Any]) -> None:
        """``job``'s tokens come from ``token_for(job)`` where it gives one, else from exllamav3's own sampler."""
        own = job.receive_logits

        def receive_logits(logits: Any) -> Any:
            token = token_for(job)
            if token is None:
                return own(logits)
            return token, None, None, None

        self._job_wraps.add(job)
        job.receive_logits = receive_logits

    def remove(self) -> None:
        """Undo every wrap, newest first (idempotent; never raises)."""
        while self._undo:
            obj, name, had, old = self._undo.pop()
            try:
                if had:
                    setattr(obj, name, old)
                else:
                    vars(obj).pop(name, None)
            except Exception:  # noqa: BLE001 - the other wraps must still go
                logger.exception("decode='fast': removing the wrap of %s", name)
        for job in list(self._job_wraps):
            vars(job).pop("receive_logits", None)
        self._job_wraps.clear()
        if self.pins is not None:
            self.pins.remove()

    def blocks(self) -> dict[str, Any]:
        """``deterministic``: the prefill's block and what its rule reused and computed again, or why one page."""
        blocks = self.pins.blocks if self.pins is not None else None
        if isinstance(blocks, prefix.AlignedPrefix):
            return blocks.report()
        return {"pages_a_chunk": 1, **({"why": self.one_page} if self.one_page else {})}

    @property
    def private_pages(self) -> int:
        """``deterministic``: pages completed while decoding, kept from later prompts."""
        return self.pins.private_pages if self.pins is not None else 0

    @property
    def installed(self) -> bool:
        return bool(self._undo)
