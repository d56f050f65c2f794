"""``deterministic=True``: a request's tokens as exllamav3's own loop gives it alone, on a cold cache.

What else its tokens would depend on, and the rule here that removes each (docs/determinism.md):

* the rows decoding beside it (exllamav3's kernels choose their split and tiles by a step's rows and table width):
  each row of a decode step runs as a step of its own, with the block table exllamav3 gives that job alone
  (:func:`rows_apart`, :func:`row_width`);
* how its prompt was chunked: prefill runs in blocks of K pages from position 0 (K = ``max_chunk_size`` in pages;
  :func:`refuse_chunks` refuses a generator whose two chunk sizes differ or are not whole pages), a prompt reuses the
  cached pages of whole blocks only and offers later prompts only the pages of blocks it computed whole
  (:mod:`.chunk_plan`, applied by :class:`.seam.prefix.AlignedPrefix`), so a page's K/V is computed by the same chunk
  after the same pages, warm or cold;
* what was cached before it: no partial page is copied into its prompt (:class:`NoPartialPages`), and a page it
  completes while decoding keeps a private hash (decode steps of one row computed it; a later prompt's cold run
  computes it in a chunk), so no later prompt reuses it (:class:`Pins`).

The seam (:class:`~.seam.Seam`) applies :class:`Pins` to every job before ``iterate()`` starts it and removes its
wraps with its own; what the pins wrap is declared in :mod:`.requirements` (``Job.prefill``, its one read of
``all_pages``, ``Job.hash_completed_page``, ``Job.current_new_pages_required`` and ``Job.allocate_pages``, the pages'
``prev_hash``/``can_revert``/``phash``).

The rows of a decode step have a second strategy, :data:`PINNED` (:mod:`.pinned`): the whole batch in one step with
every launch choice that follows the batch pinned; :data:`STRATEGY` chooses, and the prefill rules above hold for both.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import Any, Protocol

from .requirements import PAGE_SIZE
from .step import Forward, padded_width

ROWS_APART = "rows apart"
"""Each row of a decode step as a step of its own (:func:`rows_apart`): proven on the GPU, one forward per row."""

PINNED = "pinned"
"""The whole step at once, its launch choices pinned (:mod:`.pinned`, :mod:`.seam.pins`): awaiting its GPU proof
(``tests/gpu/test_gpu_pinned.py``); where the pins cannot hold (:func:`.seam.pins.pins_stand_aside`), rows apart."""

STRATEGY = ROWS_APART
"""``deterministic=True``'s strategy for the rows of a decode step (read when a FastDecode is made). The one line to
change once the GPU proves :data:`PINNED` (docs/determinism.md)."""


def refuse_chunks(max_chunk_size: int, shared_chunk_size: int) -> int:
    """K, the pages of a prefill chunk: refuses a generator whose chunks would not start on the same blocks.

    Raises:
        ValueError: the two chunk sizes differ (a prompt prefilled while others decode would be cut elsewhere), or
            are not whole pages.
    """
    if max_chunk_size != shared_chunk_size or max_chunk_size < PAGE_SIZE or max_chunk_size % PAGE_SIZE:
        raise ValueError(
            f"deterministic=True prefills in blocks of whole pages from position 0: the Generator's max_chunk_size "
            f"and shared_chunk_size must be the same multiple of {PAGE_SIZE} (they are {max_chunk_size} and "
            f"{shared_chunk_size})"
        )
    return max_chunk_size // PAGE_SIZE


# ---------------------------------------------------------------------- prefill and the prefix cache


class NoPartialPages:
    """The page table as a pinned job's ``Job.prefill`` sees it: no page to copy a partial page from.

    Its one read of ``all_pages`` (a search for a cached page whose first tokens match the rest of the prompt, to
    copy their K/V) finds none; every other read and write reaches the real table.
    """

    __slots__ = ("_table",)
    all_pages: tuple[Any, ...] = ()

    def __init__(self, table: Any) -> None:
        object.__setattr__(self, "_table", table)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._table, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._table, name, value)


class Blocks(Protocol):
    """Whole blocks of K pages (:class:`.seam.prefix.AlignedPrefix`).

    A job's cached pages limited for a call, and which page its prefill completed may take its content hash.
    """

    def limited(self, job: Any, counted: bool = False) -> AbstractContextManager[None]: ...

    def publishes(self, seq: Any, page_idx: int) -> bool: ...


class Pins:
    """The jobs whose prompt is prefilled as on a fresh cache, whatever was cached before; removed as one unit.

    ``blocks``: prefill chunks of more than one page (None: one page a forward, every prompt page published).
    """

    WRAPS = ("prefill", "hash_completed_page", "current_new_pages_required", "allocate_pages")

    def __init__(self, blocks: Blocks | None = None) -> None:
        self._pinned: weakref.WeakSet[Any] = weakref.WeakSet()
        self.blocks = blocks
        self.private_pages = 0  # pages completed while decoding, kept from later prompts

    def pin_new(self, jobs: Iterable[Any]) -> None:
        """Pin each of ``jobs`` not pinned yet (those enqueued since the last ``iterate()``)."""
        for job in jobs:
            if job not in self._pinned:
                self.pin(job)

    def pin(self, job: Any) -> None:
        """``job``'s prefill copies no partial page, and a page it completes while decoding keeps its private hash.

        ``hash_completed_page`` while decoding is exllamav3's less the publishing: the next page is linked as
        ``receive_sample`` links a page whose hash it defers. With :attr:`blocks`, so is a prompt page of a chunk
        shorter than its block, and the job's cached pages are whole blocks (its allocation's count and lookup).
        """
        own_prefill, own_hash, blocks = job.prefill, job.hash_completed_page, self.blocks
        prefilling = [False]

        def prefill(results: list[Any], chunk_size: int | None = None) -> Any:
            table = job.pagetable
            job.pagetable, prefilling[0] = NoPartialPages(table), True
            try:
                return own_prefill(results, chunk_size)
            finally:
                job.pagetable, prefilling[0] = table, False

        def hash_completed_page(seq: Any, page_idx: int) -> Any:
            if prefilling[0] and (blocks is None or blocks.publishes(seq, page_idx)):  # its whole block in a chunk
                return own_hash(seq, page_idx)
            if not prefilling[0]:
                self.private_pages += 1
            pages = seq.allocated_pages
            if page_idx + 1 < len(pages):
                pages[page_idx + 1].prev_hash, pages[page_idx + 1].can_revert = pages[page_idx].phash, False
            return None

        self._pinned.add(job)
        job.prefill, job.hash_completed_page = prefill, hash_completed_page
        if blocks is not None:  # whole cached blocks only: limited while exllamav3 counts and allocates its pages
            own_count, own_allocate = job.current_new_pages_required, job.allocate_pages

            def current_new_pages_required() -> Any:
                with blocks.limited(job):
                    return own_count()

            def allocate_pages() -> Any:
                with blocks.limited(job, counted=True):
                    return own_allocate()

            job.current_new_pages_required, job.allocate_pages = current_new_pages_required, allocate_pages

    def remove(self) -> None:
        """Unpin every job still alive (its own ``prefill`` and ``hash_completed_page`` again)."""
        for job in list(self._pinned):
            for name in self.WRAPS:
                vars(job).pop(name, None)
        self._pinned.clear()


# ---------------------------------------------------------------------- decode: each row a step of its own


def row_width(position: int, page: int) -> int:
    """The block-table width (pages) exllamav3 gives a job alone whose next position is ``position``.

    Its pages, padded as ``Generator.iterate_gen`` pads a step's table (:func:`.step.padded_width`).
    """
    return padded_width(-(-(position + 1) // page))


def rows_apart(one: Callable[[Any, dict[str, Any]], Any], step: Forward) -> tuple[Any, int]:
    """A decode step's logits with each row run by ``one(ids, params)`` as a step of its own, and the rows run apart.

    Each row gets the block table exllamav3 gives its job alone (:func:`row_width`), its cache length and recurrent
    state; a step of one row, or one whose tables are not on the host or that carries explicit positions, runs whole
    (0 rows apart).
    """
    import torch

    ids, params, rows = step.ids, step.params, step.rows
    bt, sl, states = step.block_table, step.cache_seqlens, step.recurrent_states
    if rows == 1 or bt is None or sl is None or bt.device.type != "cpu" or step.positions is not None:
        return one(ids, params), 0
    out: Any = None
    for i in range(rows):
        width = min(row_width(int(sl[i]), PAGE_SIZE), int(bt.shape[1]))
        p = {k: v for k, v in params.items() if k != "dev_cache"}  # (device copies of the whole step's tables)
        p["block_table"] = bt[i : i + 1, :width].contiguous()
        p["cache_seqlens"] = sl[i : i + 1].clone()
        if states is not None:
            p["recurrent_states"] = states[i : i + 1]
        logits = one(ids[i : i + 1], p)
        if out is None:
            out = torch.empty((rows, *logits.shape[1:]), dtype=logits.dtype, device=logits.device)
        out[i : i + 1].copy_(logits)  # a replayed graph's logits live in its static buffer: copied before the next
    return out, rows


__all__ = [
    "PINNED",
    "ROWS_APART",
    "STRATEGY",
    "Blocks",
    "NoPartialPages",
    "Pins",
    "refuse_chunks",
    "row_width",
    "rows_apart",
]
