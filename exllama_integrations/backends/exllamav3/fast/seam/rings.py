"""Sliding-window rings (exllamav3's ``SlidingAttention``) in the captured decode step.

Part of the seam (:mod:`.`). exllamav3 1.6.5 keeps a ``SlidingAttention`` layer's keys and values in a per-slot ring
(``SWALayerState``: ``kv_state_size`` tokens, whole pages: the window plus ``sliding_window_overp`` of history), not in
the paged cache; each row's ``SWAState`` says where on the host (``position``, ``window_beg``). A decode step
(``SlidingAttention.decode_flash_attn``, one position a row) calls ``_decode_state_prep`` in every such layer, which

1. on a row whose run reaches the ring's end (``position - window_beg + 1 > kv_state_size``) moves the ring one page
   down (a device copy of that row's slot) and sets ``wshift`` to the page; else ``wshift = 0``;
2. hands the attention kernel the per-slot page table (``slot * pages + j``) and the in-ring lengths
   (``position - window_beg - wshift``), uploaded from the host;

then ``paged_attn_triton_decode`` (its launch shape from the table's width and ``max_kv_len = kv_state_size``, never
from the lengths' values: no host read) appends the row's K/V at that length and attends over the window. After the
forward ``advance_recurrent_states`` moves ``position`` on and ``post_advance`` adds ``wshift`` to ``window_beg``.

Captured exactly so (:class:`Rings`): the page table and the lengths are static device tensors the graph reads (the
host copies them in before each replay, as it copies the block table), and the page shift, which the host decides
from values it holds, runs before the replay by exllamav3's own ``_decode_state_prep`` on the shifting rows alone
(in each layer: it touches only that layer's ring, which nothing before that layer in the step reads or writes, so
the ring holds the same values when the layer's kernel reads it). Every layer takes the same decision (one state per
row, rings of one size: :func:`rings_stand_aside`), as in exllamav3's forward. Inside a capture the layers read the
static tensors instead of calling ``_decode_state_prep`` (:meth:`Rings.read_static`), and exllamav3's own graphed
path for the ring (``bc_swa_step``, up to 8 rows) stands aside as its attention's does.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ..requirements import PAGE_SIZE as PAGE


def rings_stand_aside(layers: list[Any]) -> str | None:
    """Why these ``SlidingAttention`` layers cannot be captured, or None when they can."""
    sizes = {int(m.kv_state_size) for m in layers}
    if len(sizes) > 1:  # one SWAState (one window_beg) a row serves every layer: its shift must be every layer's
        return f"sliding-window rings of several sizes ({sorted(sizes)} tokens)"
    for m in layers:
        if getattr(m, "window_right", 0):
            return "a sliding-window layer that looks ahead (window_right: a block drafter)"
        if not getattr(m, "num_kv_heads", 0):
            return "a sliding-window layer without K/V heads on this device"
        if int(m.kv_state_size) % PAGE:
            return f"a sliding-window ring of {m.kv_state_size} tokens (not whole pages)"
    return None


class Rings:
    """The ``SlidingAttention`` layers of one model (each with its block's layer instance), for the captured step."""

    def __init__(self, layers: list[tuple[Any, int]]) -> None:
        self.layers = layers
        self.size = int(layers[0][0].kv_state_size)  # tokens of a ring (every layer's: rings_stand_aside)
        self.pages = self.size // PAGE
        self.window = max(int(m.sliding_window) for m, _ in layers)
        self.shifts = 0  # row shifts run before replays (a row's ring reached its end)

    def prepare(self, states: list[Any]) -> tuple[list[int], list[list[int]]]:
        """What ``_decode_state_prep`` does for a step of one position a row, less the upload: the host part.

        Rows whose ring is full are shifted now, by exllamav3's own ``_decode_state_prep`` on those rows alone, in each
        layer (it sets their ``wshift``); the others get ``wshift = 0``, as it gives them. Returns each row's length in
        its ring (where the step appends) and its page table row, for the static tensors the graph reads.
        """
        full = [rs for rs in states if rs.position - rs.window_beg + 1 > self.size]
        for rs in states:
            rs.wshift = 0
        if full:
            for module, instance in self.layers:
                k_states, v_states = full[0].cache.get_recurrent_layer((module.layer_idx, instance)).get_state_tensors()
                module._decode_state_prep(full, k_states, v_states, 1)
            self.shifts += len(full)
        lengths = [rs.position - rs.window_beg - rs.wshift for rs in states]
        tables = [[rs.slot * self.pages + j for j in range(self.pages)] for rs in states]
        return lengths, tables

    def stage(self, states: list[Any], tables: Any, lengths: Any) -> None:
        """:meth:`prepare` a step of ``states``, its page tables and lengths copied into ``tables`` and ``lengths``.

        Pageable sources copied without blocking, as exllamav3 uploads its own (CUDA stages them first).
        """
        import torch

        host_lengths, host_tables = self.prepare(states)
        lengths.copy_(torch.tensor(host_lengths, dtype=torch.int32), non_blocking=True)
        tables.copy_(torch.tensor(host_tables, dtype=torch.int32), non_blocking=True)

    @contextmanager
    def read_static(self, tables: Any, lengths: Any) -> Iterator[None]:
        """Inside: every ring layer's decode reads ``tables`` / ``lengths`` (static device tensors of the step's rows).

        And exllamav3's own graphed ring step stands aside (``sliding_attn._bc_attn_enable``, a module global of its
        own, as ``own_graphs_off`` sets attn's). Both restored on the way out.
        """
        from ...upstream import module

        swa: Any = module("exllamav3.modules.sliding_attn")

        def static_prep(rsg: Any, k_states: Any, v_states: Any, seqlen: int) -> tuple[Any, Any]:
            if seqlen != 1:  # (a captured step has one position a row: capturable.step_stands_aside)
                raise RuntimeError(f"a captured ring step of {seqlen} positions a row")
            return tables, lengths

        saved = swa._bc_attn_enable
        mods = [m for m, _ in self.layers]
        try:
            swa._bc_attn_enable = False
            for m in mods:
                m._decode_state_prep = static_prep  # an instance attribute shadows the method
            yield
        finally:
            swa._bc_attn_enable = saved
            for m in mods:
                vars(m).pop("_decode_state_prep", None)

    def report(self) -> dict[str, Any]:
        return {"layers": len(self.layers), "ring_tokens": self.size, "window": self.window, "row_shifts": self.shifts}


__all__ = ["Rings", "rings_stand_aside"]
