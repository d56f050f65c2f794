"""Part of the seam: a decode step's launch choices pinned on exllamav3 (:mod:`..pinned`'s rules), for one forward.

:class:`LaunchPins` applies every pin of one model as one unit around an eager forward or a capture of a decode step
and removes them as one unit, whatever fails (a replay needs none: it runs the kernels the capture recorded):

* ``triton_paged.paged_attn_triton_decode`` (the module's global, which the dispatcher's decode functions call by
  name) gets ``num_splits`` and ``max_kv_len`` from :func:`..pinned.split_plan`;
* ``LinearEXL3.forward`` runs its rows padded to the bucket on a forced kernel shape (``exl3_gemm``, the
  extension's own function), ``LinearFP16.forward`` its rows padded to the bucket;
* the model's fused bundles (``Attention.multi_qkv``, ``multi_kv``, ``multi_qg``, ``GatedMLP.multi_gu``) are set
  aside, and exllamav3's own per-layer graphs too (:meth:`.views.ModelView.own_graphs_off`).

The class and module patches are visible to every thread while applied (as ``own_graphs_off``'s switch is): another
model stepping in the same process meanwhile gets pinned launches for that forward (a server runs each model in an
engine process of its own). What they rely on is :data:`..requirements.PINNED`, checked against the installed source;
:func:`pins_stand_aside` says where the strategy cannot hold, and ``deterministic=True`` then runs the rows apart.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from ..pinned import SPLIT_LEN, exl3_shapes, split_plan
from ..requirements import pinned_unmet
from .views import ModelView, _walk

logger = logging.getLogger(__name__)


def pins_stand_aside(view: ModelView) -> str | None:
    """Why the pins cannot make this model's decode step row-invariant, or None when they can."""
    if view.why_not is not None:
        return f"the decode step is not captured ({view.why_not})"
    if view.recurrent:
        return f"recurrent layers ({', '.join(sorted(set(view.recurrent)))}: their own graphed rows are not pinned)"
    if getattr(view, "rings", None) is not None:  # (sliding_attn calls its own import of the decode kernel)
        return "sliding-window rings (their attention's splits are not pinned)"
    import torch

    if getattr(torch.version, "hip", None):
        return "ROCm (its EXL3 kernel shapes and GEMVs are others)"
    unmet = pinned_unmet()
    if unmet:
        return "exllamav3 lacks what the pins rely on: " + "; ".join(unmet[:3])
    from ...upstream import Attention, Linear

    for m in _walk(view.model.modules):
        if isinstance(m, Attention) and (getattr(m, "sliding_window", -1) or -1) > 0:
            return "sliding-window attention (its splits follow the window, not the pins)"
        if isinstance(m, Linear):
            if m.quant_type not in ("fp16", "exl3"):
                return f"{m.quant_type} weights (only fp16 and EXL3 GEMMs are pinned)"
            if getattr(m, "lora_a_tensors", None):
                return "LoRA adapters (their GEMMs are not pinned)"
    return None


class LaunchPins:
    """The pinned launches of one model's decode step (see the module docstring)."""

    def __init__(self, view: ModelView, bucket: int, split_len: int = SPLIT_LEN) -> None:
        from ...upstream import Attention, GatedMLP

        self.view = view
        self.bucket = bucket
        self.split_len = split_len
        mods = list(_walk(view.model.modules))
        self.attentions = [m for m in mods if isinstance(m, Attention)]
        self.gated = [m for m in mods if isinstance(m, GatedMLP)]
        self.calls: Counter[str] = Counter()  # pinned and left-as-they-were calls, in eager forwards and captures
        self.shapes: dict[tuple[Any, ...], int] = {}  # EXL3 matrix kind -> the forced shape it runs on
        self.refused: dict[str, str] = {}  # a shape the kernel refused for a matrix kind, and why
        self.applied_count = 0
        self._depth = 0

    # ------------------------------------------------------------------ applied and removed as one unit

    @contextmanager
    def applied(self) -> Iterator[None]:
        """Every pin, for the forward or capture run inside; all removed on the way out (reentrant: applied once)."""
        if self._depth:
            yield
            return
        from ...upstream import LinearEXL3, LinearFP16, module

        undo: list[tuple[Any, str, bool, Any]] = []

        def _wrap(obj: Any, name: str, value: Any) -> None:
            had = name in vars(obj)
            undo.append((obj, name, had, vars(obj).get(name)))
            setattr(obj, name, value)

        tp = module("exllamav3.modules.attention_fn.triton_paged")
        self._depth += 1
        try:
            with self.view.own_graphs_off():
                for attn in self.attentions:
                    if attn.multi_qkv is not None:
                        _wrap(attn, "multi_qkv", None)
                    if attn.multi_kv is not None:
                        _wrap(attn, "multi_kv", None)
                    if attn.multi_qg is not None:
                        _wrap(attn, "multi_qg", None)
                for mlp in self.gated:
                    if any(g is not None for g in mlp.multi_gu):
                        _wrap(mlp, "multi_gu", [None] * len(mlp.multi_gu))
                _wrap(LinearEXL3, "forward", self._exl3(LinearEXL3.forward))
                _wrap(LinearFP16, "forward", self._fp16(LinearFP16.forward))
                _wrap(tp, "paged_attn_triton_decode", self._attention(tp.paged_attn_triton_decode))
                self.applied_count += 1
                yield
        finally:
            self._depth -= 1
            while undo:
                obj, name, had, old = undo.pop()
                if had:
                    setattr(obj, name, old)
                else:
                    delattr(obj, name)

    # ------------------------------------------------------------------ the pinned calls

    def _attention(self, own: Callable[..., Any]) -> Callable[..., Any]:
        def paged_attn_triton_decode(*args: Any, **kw: Any) -> Any:
            table, cache = kw.get("block_table"), kw.get("k_cache")
            chosen = kw.get("num_splits") is not None or kw.get("max_kv_len") is not None
            if args or table is None or cache is None or chosen:
                self.calls["attention left as it was"] += 1
                return own(*args, **kw)
            k = kw.get("k")
            appended = int(k.shape[1]) if k is not None else int(kw.get("pre_appended_len") or 0)
            kw["num_splits"], kw["max_kv_len"] = split_plan(
                int(table.shape[1]), int(cache.shape[1]), self.split_len, appended
            )
            self.calls["attention pinned"] += 1
            return own(**kw)

        return paged_attn_triton_decode

    def _fp16(self, own: Callable[..., Any]) -> Callable[..., Any]:
        def forward(lin: Any, x: Any, params: dict[str, Any], out_dtype: Any = None) -> Any:
            rows = x.numel() // x.shape[-1]
            if not 0 < rows < self.bucket:
                self.calls["fp16 GEMM at the bucket" if rows == self.bucket else "fp16 GEMM left as it was"] += 1
                return own(lin, x, params, out_dtype)
            self.calls["fp16 GEMM pinned"] += 1
            y = own(lin, _padded(x, rows, self.bucket), params, out_dtype)
            return y[:rows].view(*x.shape[:-1], y.shape[-1])

        return forward

    def _exl3(self, own: Callable[..., Any]) -> Callable[..., Any]:
        def forward(lin: Any, x: Any, params: dict[str, Any], out_dtype: Any = None) -> Any:
            rows = x.numel() // x.shape[-1]
            if "ovr" in params or params.get("reconstruct") or not 0 < rows <= self.bucket:
                self.calls["EXL3 GEMM left as it was"] += 1
                return own(lin, x, params, out_dtype)
            self.calls["EXL3 GEMM pinned"] += 1
            return self._exl3_gemm(lin, x, rows, out_dtype)

        return forward

    def _exl3_gemm(self, lin: Any, x: Any, rows: int, out_dtype: Any) -> Any:
        """``x @ lin`` at the bucket's rows on the matrix kind's forced shape (chosen once, the first that runs)."""
        import torch

        from ...upstream import module

        ext = module("exllamav3.modules.quant.exl3").ext
        k, n = int(x.shape[-1]), int(lin.out_features)
        xp = _padded(x, rows, self.bucket)
        y = torch.empty((self.bucket, n), dtype=out_dtype or lin.default_out_dtype, device=x.device)
        kind = (k, n, tuple(lin.trellis.shape[1:]), y.dtype, bool(lin.mcg), bool(lin.mul1))
        known = self.shapes.get(kind)
        for shape in (known,) if known is not None else exl3_shapes(k, n):
            try:  # it returns the shape it ran, 0 where it has no kernel of that shape (and writes nothing)
                ran = ext.exl3_gemm(
                    xp, lin.trellis, y, lin.suh, torch.empty_like(xp), lin.svh, shape, lin.mcg, lin.mul1, 0
                )
                why = None if ran == shape else f"exl3_gemm ran shape {ran}"
            except RuntimeError as e:  # the kernel's own checks (shared memory, tiles), before any launch
                why = str(e)[:200]
            if why is None:
                self.shapes[kind] = shape
                break
            if known is not None:
                raise RuntimeError(f"the pinned EXL3 GEMM of a {k}x{n} matrix on shape {shape} failed: {why}")
            tried = f"{k}x{n} {y.dtype} shape {shape}"
            self.refused[tried] = why
        else:
            raise RuntimeError(f"no forced EXL3 kernel shape runs a {k}x{n} matrix: {self.refused}")
        out = y[:rows].view(*x.shape[:-1], n)
        return out + lin.bias if lin.bias is not None else out

    def release(self) -> None:
        """Drop every reference to the model (it is about to unload); the counts stay for :meth:`report`."""
        self.attentions, self.gated = [], []

    def report(self) -> dict[str, Any]:
        """What the pins did: calls pinned and left as they were (eager forwards and captures), EXL3 shapes chosen."""
        return {
            "bucket_rows": self.bucket,
            "attention_split_keys": self.split_len,
            "applied": self.applied_count,
            "calls": dict(self.calls),
            "exl3_shapes": sorted({f"{k[0]}x{k[1]}: shape {s}" for k, s in self.shapes.items()}),
            **({"exl3_shapes_refused": dict(self.refused)} if self.refused else {}),
        }


def _padded(x: Any, rows: int, bucket: int) -> Any:
    """``x`` as ``[bucket, k]``: its rows, then zeros."""
    import torch.nn.functional as F  # noqa: N812

    return F.pad(x.reshape(rows, x.shape[-1]), (0, 0, 0, bucket - rows))


__all__ = ["LaunchPins", "pins_stand_aside"]
