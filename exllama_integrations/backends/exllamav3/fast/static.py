"""The one set of static buffers every captured decode step of a model reads and writes (:mod:`.graphs`)."""

from __future__ import annotations

from typing import Any


class Static:
    """The one set of static buffers every graph reads and writes, sized to the largest batch and sliced."""

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self.x: Any = None  # [rows, 1, hidden]: the step's token embeddings
        self.cache_seqlens: Any = None  # [rows]
        self.slots: Any = None  # [rows]: each row's recurrent conv-state slot (recurrent models)
        self.slots_scan: Any = None  # [rows]: the state-pool row each row's scan reads and writes
        self.block_tables: dict[int, Any] = {}  # width -> [rows, width] (a slice of rows stays contiguous)
        self.ring_lengths: Any = None  # [rows]: each row's length in its sliding-window ring (ring models)
        self.ring_tables: Any = None  # [rows, pages of a ring]: each row's ring pages
        self.logits: Any = None  # [rows, 1, vocab]

    def ensure(self, emb: Any, logits_like: Any, width: int, dev: Any, ring_pages: int = 0) -> None:
        """Allocate (once) what a graph of ``width`` pages needs on ``dev``, the layers' device.

        ``ring_pages``: the pages of a model's sliding-window rings (0: none).

        (exllamav3 may keep the embedding table on the host: its output is copied up, never read there in a capture.)
        """
        import torch

        if self.x is None or self.x.dtype != emb.dtype or self.x.shape[1:] != emb.shape[1:]:
            self.x = torch.zeros((self.rows, *emb.shape[1:]), dtype=emb.dtype, device=dev)
            self.cache_seqlens = torch.zeros((self.rows,), dtype=torch.int32, device=dev)
            self.slots = torch.zeros((self.rows,), dtype=torch.int32, device=dev)
            self.slots_scan = torch.zeros((self.rows,), dtype=torch.int32, device=dev)
        if self.logits is None or self.logits.shape[1:] != logits_like.shape[1:]:
            self.logits = torch.empty((self.rows, *logits_like.shape[1:]), dtype=logits_like.dtype, device=dev)
        if ring_pages and (self.ring_tables is None or self.ring_tables.shape[1] != ring_pages):
            self.ring_lengths = torch.zeros((self.rows,), dtype=torch.int32, device=dev)
            self.ring_tables = torch.zeros((self.rows, ring_pages), dtype=torch.int32, device=dev)
        if width not in self.block_tables:
            self.block_tables[width] = torch.zeros((self.rows, width), dtype=torch.int32, device=dev)

    def clear(self) -> None:
        self.x = self.cache_seqlens = self.slots = self.slots_scan = self.logits = None
        self.ring_lengths = self.ring_tables = None
        self.block_tables.clear()
