"""MoE layers (exllamav3's ``BlockSparseMLP``) in the captured decode step: the row counts served without a host sync.

Read from the layer once (:func:`moe_layer`), decided per step (:meth:`MoeLayer.why_eager`).

Part of the seam (:mod:`.`): the only code that reads a ``BlockSparseMLP``'s internals. What exllamav3 1.6.5's
``BlockSparseMLP.forward`` (modules/block_sparse_mlp.py) does at a decode step of ``rows`` rows, EXL3 experts on one
device:

* routing: ``routing_fn`` (ext routing kernels into per-layer bsz-1 buffers or the bucketed workspace of
  ``_routing_buffers``): on the device, no host read, the same addresses at every call of a row count.
* ``rows <= MAX_BSZN`` (8) with the bound class: ``BC_BlockSparseMLP.run_bszN`` (forward ~l.1423): two fused
  launches (``exl3_moe_coop_run``, plain ``cudaLaunchKernel``s into static buffers, their counters reset by the
  kernels themselves), no graph of its own, no host read. A shared expert folded into the bound class runs as a
  third fused launch (``bc.sh_coop``) or else through the shared ``BC_GatedMLP``'s own graph, which cannot nest in
  ours: such a step stays eager.
* more rows: the sort path (~l.1140-1345): argsort, ``torch.bincount`` (l.1197), the fused ``exl3_moe`` kernel and
  the ordered gather, all on the device, EXCEPT two host reads: torch's CUDA ``bincount`` reads the input's min and
  max back to size its output (so it can never be captured as exllamav3 calls it), and when
  ``rows * top_k > fused_rows`` the expert counts are read back with ``.tolist()`` (l.1201) to plan the tiers. The
  first is lifted inside our capture by :func:`sync_free_bincount` (the same counts, by a scatter-add: l.1197's
  input lies in ``[0, E]`` and its ``minlength`` is ``E + 1``); the second cannot be: such a step runs eagerly.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MoeLayer:
    """What decides, per row count, whether one MoE layer's decode forward can be captured."""

    key: str
    top_k: int  # experts per token
    bszn_rows: int  # MAX_BSZN: up to this many rows the fused decode kernels run (bound class present)
    fused_rows: int  # the sort path's fused kernel row capacity (0: no fused buffers, counts always read back)
    always_sorted: bool  # infer_params.no_reconstruct: every row count takes the sort path
    shared_graph: bool  # its shared expert runs through the shared BC_GatedMLP's own graph at <= bszn_rows rows

    def why_eager(self, rows: int) -> str | None:
        """Why this layer's forward at ``rows`` rows cannot be captured, or None when it can (see the module doc)."""
        bszn = rows <= self.bszn_rows
        if not self.always_sorted and bszn:
            if self.shared_graph:
                return f"its shared expert runs through exllamav3's own graph at up to {self.bszn_rows} rows"
            return None
        if self.fused_rows <= 0:
            return "its expert counts are read back on the host (block_sparse_mlp.py:1201, no fused expert buffers)"
        picks = rows * self.top_k
        if picks > self.fused_rows:
            return (
                f"{rows} rows x top-{self.top_k} = {picks} expert picks > the fused kernel's {self.fused_rows} rows: "
                "its expert counts are read back on the host (block_sparse_mlp.py:1201)"
            )
        return None


def moe_layer(mlp: Any, max_bszn: int) -> MoeLayer | str:
    """The :class:`MoeLayer` of one loaded ``BlockSparseMLP``, or why no step of it can be captured."""
    key = str(getattr(mlp, "key", "?"))
    if getattr(mlp, "cpu_offload", False) or getattr(mlp, "cpu_split_first", None) is not None:
        return "MoE experts on the CPU"
    if getattr(mlp, "routing_device", None) is not None or getattr(mlp, "tp_reduce", False):
        return "MoE routing or experts across devices"
    if mlp.routing_gate is None:
        return "an MoE layer without a router on its device"
    if mlp.router_type == "sqrtsp_hash":
        return "hash-routed MoE (the step's token ids are read from the host)"
    if mlp.bc is None or not mlp.is_quantized:
        return "MoE experts not EXL3-quantized (no fused decode kernels; expert counts read back on the host)"
    no_reconstruct = bool(getattr(getattr(mlp.config, "infer_params", None), "no_reconstruct", False))
    return MoeLayer(
        key=key,
        top_k=int(mlp.num_experts_per_tok),
        bszn_rows=int(max_bszn),
        fused_rows=int(mlp.fused_rows) if mlp.fused_mode_buffers is not None else 0,
        always_sorted=no_reconstruct,
        shared_graph=bool(mlp.bc_sh_exp) and not bool(getattr(mlp.bc, "sh_coop", False)),
    )


def why_eager(layers: list[MoeLayer], rows: int) -> str | None:
    """Why a step of ``rows`` rows over these MoE layers runs eagerly (naming the layers), or None."""
    why: dict[str, list[str]] = {}
    for layer in layers:
        w = layer.why_eager(rows)
        if w is not None:
            why.setdefault(w, []).append(layer.key)
    if not why:
        return None
    w, keys = next(iter(why.items()))
    shown = ", ".join(keys[:2]) + (f" and {len(keys) - 2} more" if len(keys) > 2 else "")
    return f"MoE layers ran eagerly ({shown}): {w}"


def captured_rows(layers: list[MoeLayer], top: int) -> list[int]:
    """The row counts up to ``top`` at which every layer's forward can be captured."""
    return [r for r in range(1, top + 1) if all(layer.why_eager(r) is None for layer in layers)]


def moe_report(layers: list[MoeLayer], top: int) -> dict[str, Any]:
    """For :meth:`..graphs.DecodeGraphs.report`: the MoE layers, the rows captured, why the others run eagerly."""
    rows = captured_rows(layers, top)
    eager = [r for r in range(1, top + 1) if r not in set(rows)]
    return {
        "layers": len(layers),
        "captured_rows": _spans(rows),
        "eager_rows": _spans(eager),
        "eager_why": why_eager(layers, eager[0]) if eager else None,
    }


def _spans(rows: list[int]) -> str:
    """``[1, 2, 3, 5]`` -> ``"1-3, 5"``."""
    out: list[str] = []
    for r in rows:
        if out and out[-1].split("-")[-1] == str(r - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{r}"
        else:
            out.append(str(r))
    return ", ".join(out)


class _SyncFreeBincount:
    """``torch`` as exllamav3's block_sparse_mlp module sees it inside our capture: ``bincount`` without a host read.

    torch's CUDA ``bincount`` reads its input's min and max back to the host (a sync a capture refuses). The only call
    (block_sparse_mlp.py:1197) counts expert ids in ``[0, E]`` into ``minlength = E + 1`` bins: a scatter-add of ones
    into that many zeros gives the same int64 counts. Every other name is torch's own.
    """

    def __init__(self, torch: Any) -> None:
        self._torch = torch

    def __getattr__(self, name: str) -> Any:
        return getattr(self._torch, name)

    def bincount(self, x: Any, weights: Any = None, minlength: int = 0) -> Any:
        t = self._torch
        if weights is not None or x.dim() != 1 or minlength <= 0:
            return t.bincount(x, weights=weights, minlength=minlength)
        return t.zeros(minlength, dtype=t.long, device=x.device).scatter_add_(0, x, t.ones_like(x, dtype=t.long))


@contextmanager
def sync_free_bincount() -> Iterator[None]:
    """exllamav3's MoE forward counts experts without a host read meanwhile (:class:`_SyncFreeBincount`)."""
    from ...upstream import module

    bsm: Any = module("exllamav3.modules.block_sparse_mlp")
    saved = bsm.torch
    bsm.torch = _SyncFreeBincount(saved)
    try:
        yield
    finally:
        bsm.torch = saved
