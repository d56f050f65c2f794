"""Mamba-2 layers (exllamav3's ``Mamba2``: Nemotron-H, Nemotron-H Omni) in the captured decode step.

Part of the seam (:mod:`.`). exllamav3 1.6.5 keeps a ``Mamba2`` layer's state as it keeps Gated DeltaNet's
(``layer_state_cls = GDNLayerState``): a conv ring per cache slot and a scan-state pool of two rows per slot, read
through the slot tensors ``prepare_for_recurrence`` puts in ``params`` (``recurrent_slots``: the conv ring's slot,
``recurrent_slots_scan``: the pool row the scan reads and writes, ``2 * slot + parity``), and advanced on the host
after the forward by ``advance_recurrent_states``. Its decode step of one position a row (``Mamba2.forward``) takes
one of three paths, chosen from host values only:

1. ``BC_Mamba2.run_bszN`` (the whole layer in C++, replayed through a CUDA graph of its own from the third call of a
   shape) where the layer has one (EXL3 ``in_proj`` and ``o_proj``: ``self.bc``), its input is fp16 (a block's norm
   gives fp16) and the step has up to ``bc_attn.MAX_BSZ`` (8) rows. Its kernels are not the torch path's (its gate
   stays fp32 into the norm, the torch path's goes through bf16) and its graph cannot nest in ours: such rows are
   left to exllamav3 (:func:`own_rows`), as Gated DeltaNet's are;
2. else, with ``seqlen >= num_v_heads``, ``ssd_chunked``, which reads the scan rows back to the host (``tolist()``):
   never capturable. At one position a row it is taken only by a layer of one head (:func:`mamba_stands_aside`
   stands such a model aside; no checkpoint has one);
3. else the torch path: ``in_proj``, ``ext.mamba2_dt_op``, the slotted causal conv update, ``ext.cuda_recurrent_mamba2``
   (pool and slots read on the device), the gated group norm and ``o_proj``: device work of fixed launch shapes whose
   state addresses come from the slot tensors. Captured as the Gated DeltaNet layers are: the slot tensors are the
   static ones the step copies in before each replay, the pools the cache's own (their addresses fixed for its
   life), each row's state advanced after the replay as ``Model.forward`` does; never run ahead.

Its one lazy host branch (``derived_filled``: fp32 copies of ``A_log``, ``dt_bias``, ``D`` made on the first forward)
is settled by the eager step every shape runs before its capture. On fp16 / bf16 weights (no ``bc``) path 3 is the
path at every row count, so such a model is captured from one row up.
"""

from __future__ import annotations

from typing import Any


def mamba_stands_aside(layer: Any) -> str | None:
    """Why this ``Mamba2`` layer keeps a model's decode step from being captured, or None when it can be."""
    if getattr(layer, "tp_reduce", False) or getattr(layer, "has_split_cache", False):
        return "a tensor-parallel Mamba-2 layer"
    if not getattr(layer, "num_k_heads", 0):
        return "a Mamba-2 layer without heads on this device"
    if int(layer.num_v_heads) <= 1:  # seqlen (1) >= num_v_heads: ssd_chunked, which reads its scan rows on the host
        return "a Mamba-2 layer of one head (its decode step reads its state rows on the host)"
    return None


def own_rows(layers: list[Any], max_bsz: int) -> int:
    """Up to how many rows exllamav3 runs these layers' decode step through graphs of its own (0: at none).

    ``max_bsz``: exllamav3's ``bc_attn.MAX_BSZ``. A layer with a ``BC_Mamba2`` (EXL3 projections) runs its fused,
    self-graphed path up to it; one without runs the torch path at every row count.
    """
    return max_bsz if any(getattr(m, "bc", None) is not None for m in layers) else 0


__all__ = ["mamba_stands_aside", "own_rows"]
