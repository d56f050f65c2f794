"""``deterministic=True``'s prefill plan: prompts prefilled in blocks of K pages from position 0, cold or warm.

A page's K/V depends on the forward that computed it: the GEMMs round each row by the chunk's row count (exllamav3
reconstructs EXL3 weights for a chunk over 144 rows and cuBLAS picks its algorithm by the chunk's shape), and the
attention reads the K/V of every page before it. So a request's cache is the same cold or warm only if every page of
it was computed by the same chunk after the same pages. The plan (for exllamav3 1.6.5's ``Job.prefill``, which starts
at the end of the cached prefix and chunks ``max_chunk_size`` from there):

* a **block** is K pages (:func:`block_pages`: ``max_chunk_size`` of them, 2,048 tokens = 8 pages by default); every
  chunk starts on a block boundary, so a prompt of ``end`` tokens before its last (the one the first decode step
  reads) is prefilled in the chunks :func:`chunks` lists, whatever was cached;
* a page is **canonical** when its prompt computed its whole block in one chunk (:func:`canonical_pages`): its K/V are
  then a function of the tokens up to its block's end only (hash chains name exactly those). Only canonical pages are
  offered to later prompts; the full pages of a prompt's last, shorter chunk keep private hashes (as pages completed
  while decoding do);
* a prompt reuses the cached pages of whole blocks only (:func:`reused_pages`): the leading pages found complete in the
  cache, rounded down to a block. The pages after that, up to a block's worth, are computed again: bitwise the same
  K/V as the cached ones (the same chunk after the same pages), so the cold and the warm request hold the same cache.

What that costs (:func:`plan`): a prompt whose cached prefix ends inside a block computes again up to K-1 pages of it
(1,792 tokens at K = 8) in the chunk it computes anyway; a chat's next turn reuses its last turn's prompt up to that
prompt's last block boundary and computes the rest of it (at most a chunk), its answer and the new message, in whole
chunks. Prompts arriving together share no page still being computed: each computes its blocks, and a page completed
under a hash another request already holds is swapped for that one (exllamav3's own ``hash_completed_page``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def block_pages(chunk_tokens: int, page: int) -> int:
    """K: the pages of one prefill chunk (``max_chunk_size`` whole pages, at least one).

    Raises:
        ValueError: the chunk is not a whole number of pages.
    """
    if chunk_tokens < page or chunk_tokens % page:
        raise ValueError(f"a prefill chunk of {chunk_tokens} tokens is not a whole number of {page}-token pages")
    return chunk_tokens // page


def canonical_pages(end: int, k: int, page: int) -> int:
    """The pages of a prompt computed in whole blocks: those before the last block boundary at or before ``end``.

    ``end``: the positions prefill computes (exllamav3's ``len(sequence_ids) - 1``: the last token is the first decode
    step's input).
    """
    return end // (k * page) * k


def reused_pages(complete: Sequence[bool], end: int, k: int, page: int) -> int:
    """The cached pages a prompt reuses: the leading pages found complete, rounded down to whole blocks.

    ``complete[i]``: whether the page with the prompt's ``i``-th page hash is complete in the cache.
    """
    found = next((i for i, c in enumerate(complete) if not c), len(complete))
    return min(found // k * k, canonical_pages(end, k, page))


def chunks(end: int, start: int, k: int, page: int) -> list[tuple[int, int]]:
    """The chunks ``[a, b)`` prefill computes from ``start`` (a block boundary) to ``end``: whole blocks, then the rest.

    Raises:
        ValueError: ``start`` is not a block boundary.
    """
    size = k * page
    if start % size:
        raise ValueError(f"a prefill starting at {start} is not on a block of {k} pages")
    return [(a, min(a + size, end)) for a in range(start, end, size)]


@dataclass(frozen=True)
class Plan:
    """One prompt's prefill: the pages it matched in the cache, those it reuses and recomputes, and its chunks."""

    matched: int
    reused: int
    chunks: tuple[tuple[int, int], ...]

    @property
    def recomputed(self) -> int:
        """Matched pages computed again (the rest of a block the cached prefix ends in)."""
        return self.matched - self.reused


def plan(complete: Sequence[bool], end: int, k: int, page: int) -> Plan:
    """The prefill of a prompt whose page hashes are found complete as ``complete`` says (see :func:`reused_pages`)."""
    matched = next((i for i, c in enumerate(complete) if not c), len(complete))
    reused = reused_pages(complete, end, k, page)
    return Plan(matched, reused, tuple(chunks(end, reused * page, k, page)))


__all__ = ["Plan", "block_pages", "canonical_pages", "chunks", "plan", "reused_pages"]
