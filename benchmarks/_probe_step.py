"""The whole decode step: one row's logits alone vs inside N rows through exllamav3's ``Model.forward``, unpinned
and with the pins applied (monkeypatched here, in the probe only), and the step's cost (tok/s at 1/16/64 rows).

Two paths: exllamav3's eager forward (its own per-layer graphs at <= 8 rows on EXL3 weights, as its own loop runs)
and the fast path's captured step (``fast.graphs.DecodeGraphs``: the whole forward replayed as one CUDA graph, its
per-layer graphs off, as ``decode="fast"`` and ``deterministic=True`` run it). Models: the 1B-class Llama fixture of
``gpu_fast_decode.py`` (``_common.exl3_model``: hidden 2048, 16 layers, vocab 32000), fp16 and 4-bit EXL3.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from _probe_core import PAGE, ROWS, cdiv, compare, exl3_pinned_shape, fixed_split_plan, guarded, padded
from _probe_ops import Ctx

STEP_LEN = 700
"""The measured row's cached tokens in a step."""

TIMED_ROWS = (1, 16, 64)
SRC, EXL3 = Path("/tmp/models/llama1b-fp16"), Path("/tmp/models/llama1b-exl3")


# ---------------------------------------------------------------------- the pins, as patches on exllamav3


def _walk(modules: list[Any]) -> Iterator[Any]:
    for m in modules:
        yield m
        yield from _walk(list(getattr(m, "modules", []) or []))


@contextmanager
def patched(ctx: Ctx, model: Any, pins: dict[str, str | None]) -> Iterator[dict[str, int]]:
    """exllamav3 with ``pins`` applied, everything restored on exit; yields counts of pinned / passed-through calls.

    ``attention``: ``split_len=L`` or ``splits=1`` (``triton_paged.paged_attn_triton_decode``); ``exl3``: ``unfused``
    (no Q/K/V, K/V, gate/up bundles: every projection a ``LinearEXL3``) or ``mgemm_forced`` (bundles kept, their
    ``exl3_mgemm`` on a forced shape), each ``LinearEXL3`` padded to 16-row multiples on a forced shape; ``fp16``:
    ``pad16`` / ``pad64`` (rows padded before cuBLAS), ``own`` (the probe's fixed-tile Triton GEMM), ``no_reduced``.
    """
    torch = ctx.torch
    from exllamav3.ext import exllamav3_ext as ext
    from exllamav3.modules.attention_fn import triton_paged as tp
    from exllamav3.modules.quant.exl3 import AUTO_RECONSTRUCT_THRESHOLD, LinearEXL3
    from exllamav3.modules.quant.fp16 import LinearFP16

    counts = {"attention pinned": 0, "attention passed": 0, "exl3 pinned": 0, "mgemm pinned": 0, "fp16 pinned": 0}
    undo: list[Any] = []
    attn, exl3, fp16 = pins.get("attention"), pins.get("exl3"), pins.get("fp16")
    try:
        if attn:
            own_decode = tp.paged_attn_triton_decode

            def decode(*a: Any, **kw: Any) -> Any:
                bt = kw["block_table"] if "block_table" in kw else a[5]
                k = kw["k"] if "k" in kw else (a[1] if len(a) > 1 else None)
                append = int(k.shape[1]) if k is not None else int(kw.get("pre_appended_len", 0))
                width = int(bt.shape[1])
                if kw.get("num_splits") is None and attn == "splits=1":
                    kw["num_splits"] = 1
                elif kw.get("num_splits") is None and (width * PAGE) % int(attn.split("=")[1]) == 0:
                    kw["num_splits"], kw["max_kv_len"] = fixed_split_plan(width, int(attn.split("=")[1]), append)
                else:
                    counts["attention passed"] += 1
                    return own_decode(*a, **kw)
                counts["attention pinned"] += 1
                return own_decode(*a, **kw)

            tp.paged_attn_triton_decode = decode
            undo.append(lambda: setattr(tp, "paged_attn_triton_decode", own_decode))
        if exl3:
            own_forward = LinearEXL3.forward

            def forward(self: Any, x: Any, params: dict[str, Any], out_dtype: Any = None) -> Any:
                rows, k = x.numel() // x.shape[-1], x.shape[-1]
                if params.get("reconstruct") or "ovr" in params or rows > AUTO_RECONSTRUCT_THRESHOLD:
                    return own_forward(self, x, params, out_dtype)
                n, m = self.out_features, padded(rows, 16)
                xp = torch.zeros((m, k), dtype=x.dtype, device=x.device)
                xp[:rows].copy_(x.view(rows, k))
                y = torch.empty((m, n), dtype=out_dtype or self.default_out_dtype, device=x.device)
                shape = exl3_pinned_shape(k, n, ctx.notes.get("exl3_prefer", (2, 1)))
                ext.exl3_gemm(xp, self.trellis, y, self.suh, torch.empty_like(xp), self.svh, shape, self.mcg,
                              self.mul1, 0)  # fmt: skip
                counts["exl3 pinned"] += 1
                y = y[:rows].view(*x.shape[:-1], n)
                return y + self.bias if self.bias is not None else y

            LinearEXL3.forward = forward
            undo.append(lambda: setattr(LinearEXL3, "forward", own_forward))
            if exl3 == "unfused":
                for m in _walk(model.modules):
                    for name in ("multi_qkv", "multi_kv", "multi_qg"):
                        own = getattr(m, name, None)
                        if own is not None:
                            undo.append(lambda m=m, name=name, v=own: setattr(m, name, v))
                            setattr(m, name, None)
                    if isinstance(getattr(m, "multi_gu", None), list):
                        undo.append(lambda m=m, v=list(m.multi_gu): setattr(m, "multi_gu", v))
                        m.multi_gu = [None] * len(m.multi_gu)
            else:
                own_mgemm = ext.exl3_mgemm

                def mgemm(*a: Any, **kw: Any) -> Any:
                    a = list(a)
                    if len(a) > 9 and a[9] <= 0:
                        a[9] = exl3_pinned_shape(int(a[0].shape[-1]), int(a[2].shape[-1]),
                                                 ctx.notes.get("exl3_prefer", (2, 1)))  # fmt: skip
                        counts["mgemm pinned"] += 1
                    return own_mgemm(*a, **kw)

                ext.exl3_mgemm = mgemm
                undo.append(lambda: setattr(ext, "exl3_mgemm", own_mgemm))
        if fp16:
            own_fp16 = LinearFP16.forward

            def forward16(self: Any, x: Any, params: dict[str, Any], out_dtype: Any = None) -> Any:
                rows, k = x.numel() // x.shape[-1], x.shape[-1]
                counts["fp16 pinned"] += 1
                if fp16 == "own":
                    from _probe_triton import fixed_gemm

                    y = fixed_gemm(x.reshape(rows, k), self.weight, out_dtype or self.out_dtype or torch.half, ctx.sms)
                    y = y + self.bias if self.bias is not None else y
                    return y.view(*x.shape[:-1], y.shape[-1])
                if fp16 == "no_reduced":
                    flag = torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction
                    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
                    try:
                        return own_fp16(self, x, params, out_dtype)
                    finally:
                        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = flag
                m = padded(rows, 64 if fp16 == "pad64" else 16)
                xp = torch.zeros((m, k), dtype=x.dtype, device=x.device)
                xp[:rows].copy_(x.view(rows, k))
                y = own_fp16(self, xp, params, out_dtype)
                return y[:rows].view(*x.shape[:-1], y.shape[-1])

            LinearFP16.forward = forward16
            undo.append(lambda: setattr(LinearFP16, "forward", own_fp16))
        yield counts
    finally:
        for f in reversed(undo):
            f()


# ---------------------------------------------------------------------- a step's inputs


class Steps:
    """Decode steps of ``rows`` rows over a cache of random K/V: the measured row at ``rows // 2`` (700 cached
    tokens, pages 0..2, a fixed token), the others random lengths (100..1800) and tokens on pages of their own."""

    def __init__(self, ctx: Ctx, cache: Any, vocab: int) -> None:
        torch = ctx.torch
        g = torch.Generator().manual_seed(ctx.seed + 77)
        self.torch, self.cache = torch, cache
        self.lens = torch.randint(100, 1800, (64,), generator=g).tolist()
        self.tokens = torch.randint(10, vocab, (64,), generator=g).tolist()
        self.token = int(self.tokens[0])

    def make(self, rows: int, wide: bool = False) -> tuple[Any, dict[str, Any], int]:
        torch, t = self.torch, rows // 2
        tables, lens, ids, nxt = [], [], [], cdiv(STEP_LEN + 1, PAGE)
        for i in range(rows):
            length = STEP_LEN if i == t else (5000 if wide and i == (t + 1) % rows else self.lens[i])
            need = cdiv(length + 1, PAGE)
            tables.append(list(range(need)) if i == t else list(range(nxt, nxt + need)))
            nxt += 0 if i == t else need
            lens.append(length)
            ids.append(self.token if i == t else self.tokens[i])
        width = max(16, cdiv(max(len(p) for p in tables), 16) * 16)
        bt = torch.zeros((rows, width), dtype=torch.int32)
        for i, p in enumerate(tables):
            bt[i, : len(p)] = torch.tensor(p, dtype=torch.int32)
        params = {
            "attn_mode": "flash_attn",
            "block_table": bt,
            "cache": self.cache,
            "cache_seqlens": torch.tensor(lens, dtype=torch.int32),
            "recurrent_states": None,
            "indexed_embeddings": [],
            "positions": None,
            "recurrent_history": False,
            "pinned_staging": True,
        }
        return torch.tensor(ids, dtype=torch.long).view(rows, 1), params, width


# ---------------------------------------------------------------------- the measurements


def _logits_row(out: Any, t: int) -> Any:
    return out[t].reshape(-1).float().clone()


def eager_own(ctx: Ctx, model: Any, steps: Steps, label: str) -> None:
    """exllamav3's own eager forward (its per-layer graphs at <= 8 rows): the third call of each shape compared."""
    torch, rec = ctx.torch, ctx.rec

    def run(rows: int) -> Any:
        out = None
        for _ in range(3):  # exllamav3's own graphs capture at a shape's second call and replay from the third
            ids, params, _ = steps.make(rows)
            with torch.inference_mode():
                out = model.forward(input_ids=ids, params=params)
        return _logits_row(out, rows // 2)

    alone = run(1)
    for n in (2, 3, 4, 8, 9, 16):
        if ctx.budget.out(30):
            break
        got = run(n)
        same = bool(alone.argmax() == got.argmax())
        op = f"{label} decode step, exllamav3 eager forward"
        rec.write(
            kind="invariance",
            section="step",
            op=op,
            pin="none",
            rows=n,
            argmax_equal=same,
            **compare(torch, alone, got),
        )


def captured(ctx: Ctx, model: Any, steps: Steps, label: str, name: str, pins: dict[str, str | None]) -> None:
    """The fast path's captured step with ``pins``: invariance at every row count (and a widened table), then the
    step's time at 1/16/64 rows."""
    from exllama_integrations.backends.exllamav3.fast.graphs import DecodeGraphs

    torch, rec = ctx.torch, ctx.rec
    op = f"{label} decode step, captured (decode=fast)"
    with patched(ctx, model, pins) as counts:
        graphs = DecodeGraphs(model, max_rows=64, min_rows=1, ahead=False)
        if graphs.why_not is not None:
            rec.write(
                kind="skipped", section="step", op=op, pin=name, why=f"the fast path stands aside: {graphs.why_not}"
            )
            return
        wrapped = list(graphs.view.sliced_qkv())
        for mq in wrapped:
            mq.c_ptrs = graphs.pointer_table(mq)

        def eager(ids: Any, params: dict[str, Any]) -> Any:
            return model.forward(input_ids=ids, params=params)

        def run(rows: int, wide: bool = False) -> tuple[Any, str]:
            out, width = None, 16
            for _ in range(2):  # the first call of a shape runs eagerly and captures; the second replays
                ids, params, width = steps.make(rows, wide)
                with torch.inference_mode():
                    out = graphs.forward(eager, ids, params)
            path = "graph" if graphs.shapes.get((rows, width)) is not None else "eager (capture failed)"
            return _logits_row(out, rows // 2), path

        try:
            alone, _ = run(1)
            for n, wide in [*((n, False) for n in ROWS), (2, True), (16, True), (64, True)]:
                if ctx.budget.out(20):
                    rec.write(kind="skipped", section="step", op=op, pin=name, rows=n, why="section budget spent")
                    break
                with guarded(rec, f"step {label} {name} rows {n}"):
                    got, path = run(n, wide)
                    where = op + (" (table widened to 32 pages)" if wide else "")
                    same = bool(alone.argmax() == got.argmax())
                    rec.write(kind="invariance", section="step", op=where, pin=name, pins=pins, rows=n, path=path,
                              argmax_equal=same, **compare(torch, alone, got))  # fmt: skip
            for n in TIMED_ROWS:
                if ctx.budget.out(10):
                    break
                with guarded(rec, f"step cost {label} {name} rows {n}"):
                    rec.write(
                        kind="cost",
                        section="step",
                        op=op,
                        pin=name,
                        pins=pins,
                        rows=n,
                        **_step_time(ctx, graphs, eager, steps, n),
                    )
            rec.write(kind="note", section="step", op=op, pin=name, calls=dict(counts), graphs=graphs.report())
        finally:
            for mq in wrapped:
                vars(mq).pop("c_ptrs", None)
            graphs.close()
            torch.cuda.empty_cache()


def _step_time(ctx: Ctx, graphs: Any, eager: Any, steps: Steps, rows: int, reps: int = 21) -> dict[str, Any]:
    """One replayed step of ``rows`` rows: GPU time (CUDA events) and wall time to completion, median of ``reps``."""
    torch = ctx.torch
    gpu, wall = [], []
    with torch.inference_mode():
        for i in range(reps + 2):
            ids, params, _ = steps.make(rows)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            a.record()
            graphs.forward(eager, ids, params)
            b.record()
            torch.cuda.synchronize()
            if i >= 2:  # (two warm-up steps)
                wall.append(time.perf_counter() - t0)
                gpu.append(a.elapsed_time(b) / 1000)
    step = statistics.median(wall)
    return {
        "median_us": 1e6 * statistics.median(gpu),
        "min_us": 1e6 * min(gpu),
        "max_us": 1e6 * max(gpu),
        "wall_ms": 1000 * step,
        "tok_s": rows / step,
        "tok_s_gpu": rows / statistics.median(gpu),
        "launches": reps,
        "timing": "graph replay; tok_s from the wall time of a step with its inputs' copies, synchronized",
    }


# ---------------------------------------------------------------------- fixtures and the section


def fixtures(ctx: Ctx, exl3: bool) -> dict[str, Path]:
    """The fp16 1B fixture (built once per machine) and its 4-bit EXL3 conversion (~90 s), as ``_common.exl3_model``
    builds them (same shape, seed 8), so the step's figures match the bench section's."""
    from fixture_models import Shape, convert_exl3, make_llama

    out: dict[str, Path] = {}
    built = (SRC / "model.safetensors").exists() and (SRC / "config.json").exists()
    if not built or not ((SRC / ".probe_complete").exists() or (EXL3 / ".complete").exists()):
        t0 = time.perf_counter()
        shape = Shape(hidden=2048, layers=16, heads=16, kv_heads=8, inter=5632, vocab=32000, context=4096)
        make_llama(SRC, shape, seed=8)
        (SRC / ".probe_complete").write_text("1")
        ctx.rec.write(kind="note", section="step", fixture="fp16 1B built", seconds=round(time.perf_counter() - t0, 1))
    out["fp16 1B"] = SRC
    if exl3:
        if not (EXL3 / ".complete").exists():
            if ctx.budget.out(150):
                ctx.rec.write(kind="skipped", section="step", op="EXL3 1B", why="no time left to convert (~90 s)")
                return out
            try:
                seconds = convert_exl3(SRC, EXL3, bits=4, timeout=max(60.0, ctx.budget.left() - 60))
            except Exception as e:  # noqa: BLE001 - the fp16 step still runs
                ctx.rec.error("step: EXL3 conversion", e)
                return out
            (EXL3 / ".complete").write_text("1")
            ctx.rec.write(kind="note", section="step", fixture="EXL3 4-bit converted", seconds=round(seconds, 1))
        out = {"EXL3 4-bit 1B": EXL3, **out}  # measured first: where exllamav3's batch dependence shows
    return out


def step(ctx: Ctx, pin_sets: dict[str, dict[str, dict[str, str | None]]], exl3: bool = True) -> None:
    """Each model: exllamav3's eager forward, then the captured step under each of its pin sets."""
    from exllamav3 import Cache, Config, Model

    torch = ctx.torch
    for label, path in fixtures(ctx, exl3).items():
        if ctx.budget.out(40):
            ctx.rec.write(kind="skipped", section="step", op=label, why="section budget spent")
            break
        kind = "exl3" if "EXL3" in label else "fp16"
        model = cache = None
        with guarded(ctx.rec, f"step {label}"):
            model = Model.from_config(Config.from_directory(str(path)))
            cache = Cache(model, max_num_tokens=600 * PAGE)
            model.load(progressbar=False)
            g = torch.Generator(device=ctx.dev).manual_seed(ctx.seed + 5)
            for layer in cache.layers.values():
                for t in (getattr(layer, "k", None), getattr(layer, "v", None)):
                    if t is not None:
                        t.normal_(generator=g)
            steps = Steps(ctx, cache, int(json.loads((path / "config.json").read_text())["vocab_size"]))
            with guarded(ctx.rec, f"step {label} eager"):
                eager_own(ctx, model, steps, label)
            for name, pins in pin_sets[kind].items():
                with guarded(ctx.rec, f"step {label} {name}"):
                    captured(ctx, model, steps, label, name, pins)
        if model is not None:
            model.unload()
        del model, cache
        torch.cuda.empty_cache()
