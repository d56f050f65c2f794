"""Part of the seam: ``deterministic=True``'s prompts reuse whole cached blocks only (:mod:`..chunk_plan`'s rules).

exllamav3 (1.6.5) allocates a job's pages when it starts (``Job.allocate_pages``: each sequence's first
``max_cached_pages`` page hashes looked up in the page table, a page found reused, the rest taken fresh) and its
``Job.prefill`` starts at the end of the leading pages found complete. :class:`AlignedPrefix` limits, for the length of
exllamav3's own ``current_new_pages_required`` and ``allocate_pages`` calls, each sequence's ``max_cached_pages`` to
:func:`..chunk_plan.reused_pages` (the leading page hashes the page table holds complete, ``PageTable.get_live_page``,
rounded down to a block) and the job's ``all_unique_hashes`` (what the count and the eviction's protection read) to
those pages' hashes; both are put back after the call. The job then starts on a block boundary, every page it reuses
complete, every other page its own; and :meth:`AlignedPrefix.publishes` says which page a prefill completed may take
its content hash (a canonical one). :class:`..deterministic.Pins` applies both per job. :func:`one_page_why` says
where blocks of pages do not hold (the seam then prefills one page a forward).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ..chunk_plan import canonical_pages, plan
from ..requirements import PAGE_SIZE
from .views import ModelView


def one_page_why(generator: Any) -> str | None:
    """Why this generator's prompts must be prefilled one page a forward, or None when blocks of pages hold.

    Blocks hold where a position's K/V depend only on the chunk's bounds and the tokens up to it: embeddings, norms,
    RoPE, dense GEMMs (row by row, the kernel chosen by the row count), causal paged attention (its kernel and splits
    chosen by the chunk's rows, start and the table's width) -- the layers of a model whose decode step the fast path
    captures, less MoE and recurrent layers. An MoE layer's expert GEMMs take the rows the chunk routes to each expert
    (a page's K/V then depend on the tokens after it in its chunk, which exllamav3's swap of a completed page for a
    held one with its hash does not see), and a recurrent model starts a warm prompt at a checkpoint exllamav3 placed
    on a page, not a block.
    """
    if generator.recurrent_cache is not None:
        return "recurrent layers (a warm prompt starts at a checkpoint on a page)"
    view = ModelView(generator.model)
    if view.why_not is not None:
        return f"a model the fast path does not capture ({view.why_not})"
    if view.moe:
        return "MoE layers (a page's K/V depend on the tokens after it in its chunk)"
    return None


class AlignedPrefix:
    """Prompts prefilled in blocks of ``k`` pages from position 0, reusing whole cached blocks only."""

    def __init__(self, k: int, page: int = PAGE_SIZE) -> None:
        self.k, self.page = k, page
        self.jobs = 0  # jobs allocated under the rule
        self.matched = 0  # prompt pages found complete in the cache when they started
        self.reused = 0  # of those, reused (whole blocks)
        self.kept_private = 0  # full prompt pages of a last, shorter chunk: never offered to later prompts

    @contextmanager
    def limited(self, job: Any, counted: bool = False) -> Iterator[None]:
        """``job``'s cached pages limited to whole blocks for the call inside (``counted``: its allocation)."""
        table, seqs = job.pagetable, list(job.sequences)
        before = [seq.max_cached_pages for seq in seqs]
        unique = job.all_unique_hashes
        hashes: list[Any] = []
        plans = []
        for seq, cap in zip(seqs, before):
            own = list(seq.page_hashes if cap is None else seq.page_hashes[:cap])
            p = plan([table.get_live_page(h) is not None for h in own], self.end(seq), self.k, self.page)
            plans.append(p)
            seq.max_cached_pages = p.reused
            hashes += own[: p.reused]
        job.all_unique_hashes = list(dict.fromkeys(hashes))
        try:
            yield
        finally:
            for seq, cap in zip(seqs, before):
                seq.max_cached_pages = cap
            job.all_unique_hashes = unique
        if counted:
            self.jobs += 1
            self.matched += sum(p.matched for p in plans)
            self.reused += sum(p.reused for p in plans)

    def end(self, seq: Any) -> int:
        """The positions prefill computes for ``seq`` (all but its last token, the first decode step's input)."""
        return len(seq.sequence_ids) - 1

    def publishes(self, seq: Any, page_idx: int) -> bool:
        """Whether a page prefill completed is canonical (its whole block computed in one chunk)."""
        if page_idx < canonical_pages(self.end(seq), self.k, self.page):
            return True
        self.kept_private += 1
        return False

    def report(self) -> dict[str, Any]:
        """The block, and what the rule reused, computed again and kept private so far."""
        return {
            "pages_a_chunk": self.k,
            "jobs": self.jobs,
            "pages_matched": self.matched,
            "pages_reused": self.reused,
            "pages_recomputed": self.matched - self.reused,
            "prompt_pages_kept_private": self.kept_private,
        }


__all__ = ["AlignedPrefix", "one_page_why"]
