"""``decode="fast"``, part three: the next decode step's forward replayed ahead of the step's bookkeeping.

Once a step's tokens are on the host (exllamav3 reads them back in one synchronize, then hands them to
``Model.prefetch_tokens``), the next step's captured forward is replayed at once
(:meth:`.graphs.DecodeGraphs.launch_ahead`): the same rows, each one position further in the pages it already
holds, each fed the token it just drew. The GPU computes it while the host does the step's bookkeeping (exllamav3's
``receive_sample`` of every job, the next step's staging) instead of after it. When the next step's forward comes,
its inputs are compared on the host with what ran ahead (:func:`ahead_differs`: ids, block table, cache lengths);
all equal, its logits are those already computed (the same graph on the same inputs); anything else (a job that
ended or began, a rewind) is a miss, and the step is replayed as usual over it. The K/V that ran ahead lie at the
positions the step writes again, or past a row's end in a page the row owns, where nothing reads them before they
are written again; a page freed meanwhile is written by its next owner after them (the same stream).

Here: the rules (when a step may run ahead, whether what ran ahead is the step), the record of what ran, and the
pinned staging of its inputs. The fast path decides from its jobs when the rows are foreseen
(:meth:`.FastDecode._pages`).
"""

from __future__ import annotations

from typing import Any


def ahead_stands_aside(
    key: tuple[int, int], positions: list[int], tokens: list[int], pages: list[int], page: int
) -> str | None:
    """Why the step after one of shape ``key`` (rows, block-table width) cannot run ahead, or None when it can.

    ``positions``: where each row writes at that step; ``pages``: how many pages each row has allocated (a
    position past them would be written through a block-table column that names no page of the row's).
    """
    rows, width = key
    if not len(tokens) == len(pages) == len(positions) == rows:
        return "tokens and rows differ"
    if any(n >= min(p, width) * page for n, p in zip(positions, pages, strict=True)):
        return "a row at the end of its pages"
    return None


class Ahead:
    """A forward replayed ahead of its step: the inputs it ran on, kept to compare with the step's own."""

    __slots__ = ("key", "shape", "ids", "block_table", "cache_seqlens")

    def __init__(self, key: tuple[int, int], shape: Any, ids: Any, block_table: Any, cache_seqlens: Any) -> None:
        self.key, self.shape, self.ids = key, shape, ids
        self.block_table, self.cache_seqlens = block_table, cache_seqlens


def ahead_differs(ahead: Ahead, input_ids: Any, params: dict[str, Any]) -> str | None:
    """How a step's forward differs from the one that ran ahead of it, or None when its inputs are the same."""
    bt, sl = params["block_table"], params["cache_seqlens"]
    if any(t.device.type != "cpu" for t in (input_ids, bt, sl)):
        return "its tables are not on the host"
    if tuple(bt.shape) != ahead.key:
        return "other rows or pages (a job ended, began or moved)"
    if not _equal(sl, ahead.cache_seqlens) or not _equal(bt, ahead.block_table):
        return "other positions or pages (a rewind, a requeue, a defragmentation)"
    if not _equal(input_ids, ahead.ids):
        return "other input tokens"
    return None


def _equal(a: Any, b: Any) -> bool:
    import torch

    return a.shape == b.shape and bool(torch.equal(a.to(b.dtype), b))


class PinnedStaging:
    """Pinned host buffers the inputs of a forward run ahead are copied up from, without blocking.

    A buffer is rewritten only at the next launch, which comes after the next step's synchronize, so the copy
    from it is done by then. (exllamav3's own staging buffers are not used: its next step writes them while this
    copy may still be queued.)
    """

    def __init__(self) -> None:
        self._buffers: dict[str, Any] = {}

    def stage(self, name: str, t: Any) -> Any:
        """``t`` copied into the pinned buffer ``name`` (grown as needed); a device tensor is returned as it is."""
        if t.device.type != "cpu":
            return t
        import torch

        buf = self._buffers.get(name)
        if buf is None or buf.numel() < t.numel() or buf.dtype != t.dtype:
            buf = self._buffers[name] = torch.empty((max(t.numel(), 1),), dtype=t.dtype, pin_memory=True)
        view = buf[: t.numel()].view(t.shape)
        view.copy_(t)
        return view

    def clear(self) -> None:
        """Free the buffers."""
        self._buffers.clear()
