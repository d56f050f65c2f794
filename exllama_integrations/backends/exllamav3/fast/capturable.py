"""Which forwards a captured decode step replays (:func:`step_stands_aside`), and one captured shape (:class:`Shape`).

The rule is kept apart from :mod:`.graphs` (which captures and replays) so that it can be read, and tested on the
CPU, alone: a wrong "yes" would replay a graph built for another kind of step.
"""

from __future__ import annotations

from typing import Any

from .seam import EXPORT_PARAMS, STEP_PARAMS

LEFT_TO_EXLLAMAV3 = "(left to exllamav3's own per-layer graphs)"


def step_stands_aside(input_ids: Any, params: dict[str, Any], min_rows: int = 1, recurrent: bool = False) -> str | None:
    """Why a forward of ``input_ids`` with ``params`` is not a capturable decode step, or None when it is.

    ``recurrent``: the model's recurrent layers are captured (their per-row state slots are static inputs), so a step
    that carries recurrent states is one; a speculative pass over them (``recurrent_history``) never is.
    """
    if input_ids is None or input_ids.dim() != 2 or input_ids.shape[1] != 1:
        return "more than one position per row"
    if params.get("attn_mode") != "flash_attn" or "block_table" not in params:
        return "not a paged decode step"
    extra = set(params) - STEP_PARAMS - EXPORT_PARAMS
    if extra:
        return f"parameters {sorted(extra)}"
    if params.get("indexed_embeddings") or params.get("recurrent_history"):
        return "image embeddings or a speculative pass"
    if params.get("recurrent_states") and not recurrent:
        return "recurrent state"
    if params.get("position_ids") is not None or not _positions_are_lengths(params):
        return "explicit positions"
    if int(input_ids.shape[0]) < min_rows:
        return f"up to {min_rows - 1} rows {LEFT_TO_EXLLAMAV3}"
    return None


def _positions_are_lengths(params: dict[str, Any]) -> bool:
    """The step's positions are its cache lengths: none given, or (an MRoPE model's text rows) the same values.

    A model declaring MRoPE (Qwen3, Qwen3-MoE) gets per-row positions from exllamav3's generator at every step: the
    cache length plus the job's ``alt_rope_offset``, 0 for a text-only job. The captured step reads its positions from
    the static cache lengths (``prepare_for_attn`` sets them so when none are given), so a step whose positions are
    those lengths is the captured one; any other offset (an image job's) runs eagerly. Both are host tensors of a
    handful of rows (exllamav3's staging arena): compared without a device sync.
    """
    positions, lengths = params.get("positions"), params.get("cache_seqlens")
    if positions is None or positions is lengths:
        return True
    if lengths is None or positions.device.type != "cpu" or lengths.device.type != "cpu":
        return False
    return tuple(positions.shape) == tuple(lengths.shape) and bool((positions == lengths).all())


def exported(params: dict[str, Any]) -> tuple[str, ...]:
    """The norms whose outputs a step hands back in ``params["export_states"]`` (a drafting target's step), sorted."""
    return tuple(sorted(params.get("export_state_norm_keys") or ()))


class Shape:
    """One captured decode forward over the static buffers' first ``rows`` rows."""

    __slots__ = ("graph", "rows", "width", "keep", "replays", "exports", "exported")

    def __init__(self, rows: int, width: int, exports: tuple[str, ...] = ()) -> None:
        self.graph: Any = None
        self.rows, self.width = rows, width
        self.keep: list[Any] = []  # what the graph reads at every replay (host tables, its params)
        self.replays = 0
        self.exports = exports  # the norms whose outputs the graph writes (:func:`exported`)
        self.exported: list[Any] = []  # those outputs: tensors the graph rewrites at every replay

    def hand_back(self, params: dict[str, Any]) -> None:
        """Put the outputs the replay exported into ``params["export_states"]`` as exllamav3's norms append them.

        Copies: the next replay (run ahead, before exllamav3 reads this step's) rewrites the graph's own tensors.
        """
        if self.exported:
            states = params.get("export_states")
            if states is None:
                states = params["export_states"] = []
            states.extend(t.clone() for t in self.exported)


__all__ = ["LEFT_TO_EXLLAMAV3", "Shape", "exported", "step_stands_aside"]
