"""``decode="fast"``, part four: the prompt chunks exllamav3 prefills in one ``iterate()``, run in a few forwards.

exllamav3 (1.6.5) prefills job by job: each ``Job.prefill`` runs ``Model.prefill`` on its chunk, one forward per
prompt. A chunk of up to 144 rows goes through exllamav3's EXL3 GEMM kernel, which decodes the quantized weights
again for every 16-row tile: on the H200 a 127-token chunk of a 1B-class EXL3 model takes 7.3 ms, 6.6 of them in
that kernel, so 64 prompts arriving together wait 0.52 s for anyone's first token (``gpu_fast_decode.py --sections
prefill``, run 13). Past 144 rows exllamav3 itself reconstructs each weight once per forward and runs an fp16
GEMM, whose cost hardly grows with the rows: the same chunks side by side in a few forwards cost a fraction.

Here each ``Model.prefill`` call of a job's prompt is held (``Job.prefill`` does not use its result: its
bookkeeping goes on at once) and the held chunks run together, longest first, in forwards of at most
``max_chunk_size`` rows, each row at its own cache position (:func:`groups`). They run before anything reads
the cache: any other model forward (the decode step that follows, a call held chunks cannot join), a
``copy_page``, a chunk that reads or writes a page a held chunk writes; and at the end of ``iterate()``, so
nothing is held between calls. A lone chunk runs exactly as exllamav3 runs it. A shorter chunk is padded to the
width of its forward only into positions of pages its job alone holds, past what is valid there
(:func:`padding_refused`): the job writes those positions again (its decode steps) before anything reads them.

Stands aside (every call runs as exllamav3 runs it): a draft model, a recurrent cache, tensor parallelism, host
page tiers; and, call by call, anything but a plain text chunk of one sequence (images, MRoPE, recurrent states).

The tokens: the cache holds the same K/V up to the GEMM's rounding (exllamav3's own two GEMM paths differ by as
much: which one a prompt takes depends on its length). Greedy tokens equal exllamav3's own prefill's except where
its logits tie or nearly tie; ``gpu_fast_decode.py --sections prefill`` shows each parting with its margin.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

from .seam import PREFILL_PARAMS, GeneratorView, PageView, page_size
from .step import Forward, PageCopy

logger = logging.getLogger(__name__)

MOST_PADDING = 0.25
"""A chunk joins a forward only while the forward's padding stays within this share of its rows."""


def call_stands_aside(call: Forward, cache: Any) -> str | None:
    """Why one ``Model.prefill`` call cannot be held, or None when it is a plain text chunk of one sequence."""
    params, ids = call.params, call.ids
    if not call.step or not isinstance(params, dict) or ids is None:
        return "not a Job's chunk"
    if not set(params) <= PREFILL_PARAMS or params.get("attn_mode") != "flash_attn" or params.get("cache") is not cache:
        return "other parameters"
    if call.recurrent_states or params.get("indexed_embeddings") or params.get("inv_freq") is not None:
        return "images, MRoPE or recurrent states"
    if params.get("mm_span_prefix"):
        return "images, MRoPE or recurrent states"
    bt, sl = call.block_table, call.cache_seqlens
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] < 1 or bt is None or sl is None:
        return "not one sequence"
    if any(t.device.type != "cpu" for t in (ids, bt, sl)) or bt.dim() != 2 or bt.shape[0] != 1 or sl.numel() != 1:
        return "not one sequence"
    return None


class Chunk:
    """A held prefill: its ids, its block table, where it starts, and the call's own params."""

    __slots__ = ("ids", "table", "start", "params")

    def __init__(self, ids: Any, params: dict[str, Any]) -> None:
        # copies: the job's own tensors are views into buffers it goes on writing
        self.ids, self.params = ids.clone(), dict(params, block_table=params["block_table"].clone())
        self.table = self.params["block_table"][0]
        self.start = int(params["cache_seqlens"].reshape(-1)[0])

    @property
    def length(self) -> int:
        return int(self.ids.shape[1])

    def reach_back(self, tokens: Any) -> None:
        """Start ``len(tokens)`` positions earlier, with these ids there (the positions a page copy would fill)."""
        import torch

        n = int(tokens.shape[-1])
        self.ids = torch.cat([tokens.reshape(1, n).to(self.ids.dtype), self.ids], dim=1)
        self.start -= n
        sl = self.params["cache_seqlens"]
        self.params["cache_seqlens"] = torch.tensor([self.start], dtype=sl.dtype)

    def pages(self, page: int, reads: bool) -> set[int]:
        """The cache pages this chunk writes (``reads``: and the ones before it, which it attends to)."""
        first = 0 if reads else self.start // page
        last = -(-(self.start + self.length) // page)
        return {int(p) for p in self.table[first:last].tolist()}


def padding_refused(chunk: Chunk, width: int, pages: dict[int, PageView], page: int) -> str | None:
    """Why ``chunk`` may not be padded to ``width`` rows, or None when it may.

    Every padded position must lie in a page of its block table (``pages``: exllamav3's pages by ``page_index``,
    which its defragmentation moves) that only its job holds (``ref_count`` 1), past the tokens valid there, but for
    the one right after the chunk: the job's next input, which exllamav3 counts in the page before the decode forward
    that writes its K/V (``get_input_ids_list``), after the held chunks.
    """
    end, last = chunk.start + chunk.length, chunk.start + width - 1
    for k in range(end // page, last // page + 1):
        if k >= chunk.table.shape[0]:
            return "past its pages"
        p = pages.get(int(chunk.table[k]))
        if p is None:
            return "a page not in the page table"
        if p.ref_count != 1:
            return "a page other jobs hold"
        if p.kv_position > max(0, end + 1 - k * page):
            return "valid tokens past its chunk"
    return None


def groups(chunks: list[Chunk], most_rows: int, fits: Any) -> list[list[Chunk]]:
    """The held chunks in forwards: longest first, each forward as wide as its first chunk.

    At most ``most_rows`` rows in a forward and :data:`MOST_PADDING` of them padding; ``fits(chunk, width)``: whether
    a chunk may be padded to that width.
    """
    out: list[list[Chunk]] = []
    for c in sorted(chunks, key=lambda c: -c.length):
        g = out[-1] if out else None
        if g is not None:
            width = g[0].length
            pad = sum(width - x.length for x in g) + width - c.length
            if (len(g) + 1) * width <= most_rows and pad <= MOST_PADDING * (len(g) + 1) * width:
                if c.length == width or fits(c, width):
                    g.append(c)
                    continue
        out.append([c])
    return out


class BatchedPrefill:
    """Holds the prompt chunks of one exllamav3 ``Generator``'s ``iterate()`` and runs them in a few forwards.

    The seam (:class:`.seam.Seam`) routes ``Model.prefill`` and ``Cache.copy_page`` here (:meth:`prefill`,
    :meth:`copy_page`); the fast path calls :meth:`flush` before any other forward and at the end of ``iterate()``.
    """

    def __init__(self, generator: GeneratorView, page: int | None = None) -> None:
        """``page``: tokens per cache page (None: exllamav3's)."""
        self.generator = generator
        self.why_not = generator.prefill_stands_aside()
        self.held: list[Chunk] = []
        self._writes: set[int] = set()  # pages the held chunks write
        self._copies: dict[int, tuple[int, int]] = {}  # page copies held: destination -> (source, tokens)
        self._pages: dict[int, PageView] = {}  # exllamav3's pages by page_index, while chunks are held
        self._prefill: Any = None  # exllamav3's own Model.prefill and Cache.copy_page (from the last call)
        self._copy_page: Any = None
        self.chunks = 0  # chunks held
        self.forwards = 0  # forwards of several chunks
        self.batched = 0  # chunks run in them
        self.padded = 0  # padding rows
        self.copies_computed = 0  # page copies whose positions their job's chunk computed instead
        self.alone: Counter[str] = Counter()  # chunks run as exllamav3 runs them, and why
        self.not_padded: Counter[str] = Counter()  # chunks kept out of a wider forward, and why
        self.flushes: Counter[str] = Counter()  # what made the held chunks run
        self.on = self.why_not is None
        self.page: int = page if page is not None else page_size()

    def prefill(self, call: Forward) -> Any:
        """A job's ``Model.prefill`` call: held where it is a plain chunk, else run (after what is held)."""
        self._prefill = call.eager
        cache = self.generator.cache
        why = "batched prefill off" if not self.on else call_stands_aside(call, cache)
        if why is not None:
            self.flush("a prefill that cannot be held")
            self.alone[why] += 1
            return call.run()
        chunk = Chunk(call.ids, call.params)
        self._take_copy(chunk)
        if chunk.pages(self.page, reads=True) & self._busy():
            self.flush("a chunk over pages a held one writes")
        self.held.append(chunk)
        self._writes |= chunk.pages(self.page, reads=False)
        self.chunks += 1
        return None  # Job.prefill does not use it

    def copy_page(self, call: PageCopy) -> Any:
        """``Cache.copy_page(cache, from, to, tokens)``: Job.prefill's reuse of a partly matching page.

        From a page a held chunk writes (prompts that share a prefix, arriving together), it is held too: the chunk
        of the job it copies for then computes those positions itself, in the same forward (see :meth:`_take_copy`).
        """
        self._copy_page = call.eager
        if call.pages is not None and self.on and call.pages[0] in self._writes:
            src, dst, n = call.pages
            self._copies[dst] = (src, n)
            return None
        if call.pages is not None and not set(call.pages[:2]) & self._busy():
            return call.run()  # nothing held touches either page
        self.flush("a page copy")
        return call.run()

    def _busy(self) -> set[int]:
        """The pages held work writes: by held chunks, or as the destination of a held copy."""
        return self._writes | set(self._copies)

    def _page_objects(self) -> dict[int, PageView]:
        if not self._pages:  # built once while chunks are held (exllamav3 defragments only between steps)
            self._pages.update(self.generator.pages_by_index())
        return self._pages

    def _take_copy(self, chunk: Chunk) -> None:
        """When ``chunk`` begins where a held page copy ends, it reaches back over the copied positions instead.

        Its own tokens there are those Job.prefill recorded in the page; the copy is dropped.
        """
        k = chunk.start // self.page
        if not self._copies or k >= chunk.table.shape[0]:
            return
        dst = int(chunk.table[k])
        held = self._copies.get(dst)
        if held is None or chunk.start - k * self.page != held[1]:
            return
        page = self._page_objects().get(dst)
        if page is None:
            return
        del self._copies[dst]
        chunk.reach_back(page.tokens(held[1]))
        self.copies_computed += 1

    def flush(self, why: str) -> None:
        """Run every held chunk, then every held page copy (before ``why``: something that reads the cache)."""
        if not self.held and not self._copies:
            return
        held, copies, self.held, self._copies, self._writes = self.held, self._copies, [], {}, set()
        self.flushes[why] += 1
        try:
            self._run_all(held)
        finally:
            self._pages = {}
            for dst, (src, n) in copies.items():
                self._copy_page(self.generator.cache, src, dst, n)

    def _run_all(self, held: list[Chunk]) -> None:
        if not held:
            return
        if len(held) == 1:
            self.alone["alone in its step"] += 1
            self._prefill(input_ids=held[0].ids, params=held[0].params)
            return

        def fits(c: Chunk, width: int) -> bool:
            why = padding_refused(c, width, self._page_objects(), self.page)
            if why is not None:
                self.not_padded[why] += 1
            return why is None

        todo = groups(held, self.generator.max_chunk_size, fits)
        for n, g in enumerate(todo):
            try:
                self._run(g)
            except Exception:  # noqa: BLE001 - the chunks run one by one, as exllamav3 runs them
                logger.exception("decode='fast': a batched prefill failed; prompts are prefilled one by one")
                self.on = False
                self.alone["off: a batched prefill failed"] += 1
                for c in [c for g2 in todo[n:] for c in g2]:
                    self._prefill(input_ids=c.ids, params=c.params)
                return

    def _run(self, g: list[Chunk]) -> None:
        import torch

        if len(g) == 1:
            self.alone["alone in its forward"] += 1
            self._prefill(input_ids=g[0].ids, params=g[0].params)
            return
        width = g[0].length
        tables = max(c.table.shape[0] for c in g)
        ids = torch.empty((len(g), width), dtype=g[0].ids.dtype)
        table = torch.zeros((len(g), tables), dtype=g[0].table.dtype)
        for i, c in enumerate(g):
            ids[i, : c.length] = c.ids[0]
            ids[i, c.length :] = c.ids[0, -1]  # padding: written where this row writes again before reading
            table[i, : c.table.shape[0]] = c.table
            self.padded += width - c.length
        params = dict(g[0].params)
        params["block_table"] = table
        params["cache_seqlens"] = torch.tensor([c.start for c in g], dtype=g[0].params["cache_seqlens"].dtype)
        self._prefill(input_ids=ids, params=params)
        self.forwards += 1
        self.batched += len(g)

    def close(self) -> None:
        """Run what is held (the seam removes the wraps)."""
        self.flush("close")

    def report(self) -> dict[str, Any]:
        """Whether prompt chunks are batched, how many, and which ran as exllamav3 runs them (and why)."""
        if self.why_not is not None:
            return {"batched": False, "stands_aside": self.why_not}
        return {
            "batched": self.on,
            "chunks_held": self.chunks,
            "forwards_of_several": self.forwards,
            "chunks_in_them": self.batched,
            "padding_rows": self.padded,
            "page_copies_computed": self.copies_computed,
            "not_padded": dict(self.not_padded),
            "run_alone": dict(self.alone),
            "run_before": dict(self.flushes),
        }
