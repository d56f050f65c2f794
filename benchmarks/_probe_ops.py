"""The op-level probes: one row's output alone vs inside 2..64 rows, per exllamav3 kernel, unpinned and pinned.

Each op is built at realistic decode shapes from random inputs (EXL3 weights as random trellis bits with the default
``mul1`` codebook: any bit pattern decodes to a weight). The row measured sits at index ``rows // 2``; the other rows
are random. Every pin is a function ``rows -> zero-argument call`` so that the same call is both compared and timed.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from _probe_core import (
    PAGE,
    ROWS,
    Budget,
    Recorder,
    cdiv,
    compare,
    default_splits,
    exl3_shape_fits,
    fixed_split_plan,
    guarded,
    padded,
    split_len,
    timed,
)

ATTN_SHAPES = (("1B: 16 q / 8 kv heads", 16, 8, 128), ("7B fixture: 32 / 32", 32, 32, 128))
ATTN_SPLIT_LENS = (128, 256, 512)
TARGET_LEN = 1000
"""The measured row's cached tokens (its new token is the 1001st)."""

EXL3_OPS = (  # name, k, n, fp32 output (o_proj, MLP: exllamav3's out_dtype float); in the order they are probed
    ("q_proj 2048x2048", 2048, 2048, False),
    ("kv_proj 2048x1024", 2048, 1024, False),
    ("down 8192x2048 fp32", 8192, 2048, True),
    ("gate 2048x8192 fp32", 2048, 8192, True),
    ("down 5632x2048 fp32 (fixture)", 5632, 2048, True),
    ("gate 2048x5632 fp32 (fixture, above 32 rows)", 2048, 5632, True),
    ("o_proj 2048x2048 fp32", 2048, 2048, True),
)
EXL3_HEADS = (("lm_head 2048x128256", 2048, 128256), ("lm_head 2048x32000 (fixture)", 2048, 32000))
MGEMM_OPS = (("gate+up mgemm 2048x5632 (fixture, up to 32 rows)", 2048, 5632), ("gate+up mgemm 2048x8192", 2048, 8192))
FP16_OPS = (  # name, k, n, fp32 output (ext.hgemm) else torch.matmul
    ("q_proj 2048x2048", 2048, 2048, False),
    ("kv_proj 2048x1024", 2048, 1024, False),
    ("o_proj 2048x2048 hgemm fp32", 2048, 2048, True),
    ("gate 2048x8192 hgemm fp32", 2048, 8192, True),
    ("down 8192x2048 hgemm fp32", 8192, 2048, True),
    ("lm_head 2048x128256", 2048, 128256, False),
    ("q_proj 4096x4096 (7B fixture)", 4096, 4096, False),
    ("down 11008x4096 hgemm fp32 (7B fixture)", 11008, 4096, True),
    ("lm_head 4096x32000 (7B fixture)", 4096, 32000, False),
)

Pins = dict[str, Callable[[int], Callable[[], Any]]]

PINNED_EXL3 = "pad64+shape=7 (the pinned strategy's)"
"""The EXL3 pin of ``fast/pinned.py`` (a bucket of 64 rows on the 64-row tile), measured beside the others."""


@dataclass
class Ctx:
    """What a probe needs: torch, the record, the budget, the device and the run's options."""

    torch: Any
    rec: Recorder
    budget: Budget
    dev: Any = None
    sms: int = 132
    time_rows: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    only_pins: set[str] | None = None
    bits: tuple[int, ...] = (4,)
    head_bits: int = 6
    seed: int = 0
    notes: dict[str, Any] = field(default_factory=dict)
    deferred: list[tuple[str, str, dict[str, Any], Pins]] = field(default_factory=list)

    def gen(self, salt: int) -> Any:
        return self.torch.Generator(device=self.dev).manual_seed(self.seed * 1000 + salt)


def batch(ctx: Ctx, row: Any, rows: int, salt: int) -> Any:
    """``rows`` random rows shaped like ``row`` (``[1, ...]``), ``row`` itself at index ``rows // 2``."""
    torch = ctx.torch
    if rows == 1:
        return row.clone()
    x = torch.randn((rows, *row.shape[1:]), generator=ctx.gen(salt + rows), device=ctx.dev).to(row.dtype)
    x[rows // 2] = row[0]
    return x


def run_op(
    ctx: Ctx,
    section: str,
    op: str,
    meta: dict[str, Any],
    pins: Pins,
    target: Callable[[Any, int], Any],
    time: bool = True,
) -> None:
    """Each pin: the row alone, then inside every row count of :data:`ROWS` (bitwise). Its cost is measured later
    (:func:`time_pins`, after every op of the section has been compared: the comparisons come first in a budget).
    A pin that fails is recorded and the next runs."""
    torch, rec = ctx.torch, ctx.rec
    alone: dict[str, Any] = {}
    kept: Pins = {}
    for pin, make in pins.items():
        if ctx.only_pins is not None and pin != "none" and pin not in ctx.only_pins:
            continue
        if ctx.budget.out(ctx.budget.reserve):
            rec.write(kind="skipped", section=section, op=op, pin=pin, why="section budget spent")
            break
        with guarded(rec, f"{section} / {op} / {pin}"):
            for n in (1, *ROWS):
                got = target(make(n)(), n // 2).clone()
                line: dict[str, Any] = {"kind": "invariance", "section": section, "op": op, "pin": pin, "rows": n}
                if n == 1:
                    alone[pin] = got
                    if pin != "none" and "none" in alone:
                        line["same_as_unpinned_alone"] = compare(torch, alone["none"], got)["bitwise_equal"]
                else:
                    line.update(compare(torch, alone[pin], got))
                rec.write(**line, **meta)
            kept[pin] = make
    if time and kept:
        ctx.deferred.append((section, op, meta, kept))
    torch.cuda.empty_cache()


def time_pins(ctx: Ctx) -> None:
    """The cost of every pin compared so far (at ``time_rows``, vs unpinned at the same rows), while budget lasts."""
    torch, rec = ctx.torch, ctx.rec
    while ctx.deferred:
        section, op, meta, pins = ctx.deferred.pop(0)
        base_us: dict[int, float] = {}
        for pin, make in pins.items():
            with guarded(rec, f"{section} / {op} / {pin} cost"):
                for n in ctx.time_rows:
                    if ctx.budget.out(2.0):
                        rec.write(
                            kind="skipped", section=section, op=op, pin=pin, rows=n, why="no time left to time it"
                        )
                        ctx.deferred.clear()
                        return
                    t = timed(torch, make(n))
                    line = {"kind": "cost", "section": section, "op": op, "pin": pin, "rows": n, **t}
                    if pin == "none":
                        base_us[n] = t["median_us"]
                    elif n in base_us:
                        line["cost_vs_unpinned"] = round(t["median_us"] / base_us[n], 4)
                    rec.write(**line, **meta)
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------- 1. paged attention decode


def attention(ctx: Ctx) -> None:
    """exllamav3's Triton paged decode (what ``attn_dispatch`` picks for a decode step on an fp16 cache)."""
    import triton
    from exllamav3.util.backend import attn_decode_config

    for label, qh, kvh, hd in ATTN_SHAPES:
        _attention_shape(ctx, label, qh, kvh, hd, attn_decode_config(ctx.dev, triton.next_power_of_2(hd))[0])
        ctx.torch.cuda.empty_cache()


def _attention_shape(ctx: Ctx, label: str, qh: int, kvh: int, hd: int, block_n: int) -> None:
    from exllamav3.modules.attention_fn import triton_paged as tp

    torch = ctx.torch
    s_alone = default_splits(1, kvh, qh // kvh, ctx.sms, 16, block_n)
    g = ctx.gen(1)
    kc = torch.randn((1024, PAGE, kvh, hd), generator=g, device=ctx.dev).half()
    vc = torch.randn((1024, PAGE, kvh, hd), generator=g, device=ctx.dev).half()
    lens = torch.randint(16, 3800, (64,), generator=torch.Generator().manual_seed(ctx.seed + 2)).tolist()
    q1 = torch.randn((1, 1, qh, hd), generator=g, device=ctx.dev).half()
    k1 = torch.randn((1, 1, kvh, hd), generator=g, device=ctx.dev).half()
    v1 = torch.randn((1, 1, kvh, hd), generator=g, device=ctx.dev).half()

    def step(rows: int, wide: bool) -> tuple[Any, ...]:
        t, row_lens, next_page, tables = rows // 2, [], cdiv(TARGET_LEN + 1, PAGE), []
        for i in range(rows):
            length = TARGET_LEN if i == t else (6000 if wide and i == (t + 1) % rows else lens[i])
            need = cdiv(length + 1, PAGE)
            if i == t:  # the measured row owns pages 0.. whatever else runs
                tables.append(list(range(need)))
            else:
                tables.append(list(range(next_page, next_page + need)))
                next_page += need
            row_lens.append(length)
        width = max(16, cdiv(max(len(p) for p in tables), 16) * 16)
        bt = torch.zeros((rows, width), dtype=torch.int32)
        for i, p in enumerate(tables):
            bt[i, : len(p)] = torch.tensor(p, dtype=torch.int32)
        sl = torch.tensor(row_lens, dtype=torch.int32, device=ctx.dev)
        return batch(ctx, q1, rows, 10), batch(ctx, k1, rows, 20), batch(ctx, v1, rows, 30), bt.to(ctx.dev), sl, width

    def pin(splits_for: Callable[[int], tuple[int | None, int | None]], wide: bool) -> Callable[[int], Any]:
        def make(rows: int) -> Callable[[], Any]:
            q, k, v, bt, sl, width = step(rows, wide)
            splits, max_kv = splits_for(width)
            return lambda: tp.paged_attn_triton_decode(
                q, k, v, kc, vc, bt, sl, causal=True, num_splits=splits, max_kv_len=max_kv
            )

        return make

    plans: dict[str, Callable[[int], tuple[int | None, int | None]]] = {
        "none": lambda w: (None, None),
        f"splits={s_alone} (one row's)": lambda w: (s_alone, None),
        "splits=1": lambda w: (1, None),
        **{f"split_len={n}": (lambda w, n=n: fixed_split_plan(w, n)) for n in ATTN_SPLIT_LENS},
    }
    meta = {"dtype": "fp16", "kv_heads": kvh, "q_heads": qh, "head_dim": hd, "block_n": block_n,
            "default_splits_alone": s_alone, "default_split_len_alone": split_len(16, s_alone, block_n)}  # fmt: skip
    for wide in (False, True):
        op = f"attn_decode {label}" + (" (a 6000-token row widens the table to 32 pages)" if wide else "")
        run_op(ctx, "attention", op, meta, {k: pin(p, wide) for k, p in plans.items()}, lambda o, t: o[t], not wide)


# ---------------------------------------------------------------------- 2. the EXL3 GEMM


def exl3_linear(ctx: Ctx, k: int, n: int, bits: int, salt: int) -> Any:
    """An exllamav3 ``LinearEXL3`` of random trellis bits (``mul1`` codebook, exllamav3's converter default)."""
    from exllamav3.modules.quant.exl3 import LinearEXL3

    torch = ctx.torch
    g = ctx.gen(100 + salt)
    trellis = torch.randint(0, 65536, (k // 16, n // 16, 16 * bits), generator=g, device=ctx.dev, dtype=torch.int32)
    suh = (torch.randint(0, 2, (k,), generator=g, device=ctx.dev) * 2 - 1).half()
    svh = ((torch.randint(0, 2, (n,), generator=g, device=ctx.dev) * 2 - 1) / math.sqrt(k)).half()
    try:
        from exllamav3.modules.quant.exl3_lib.quantize import codebook_mul1_mult

        mul1 = torch.tensor(codebook_mul1_mult, dtype=torch.uint32).view(torch.int)
    except Exception:  # noqa: BLE001 - the kernels only test that the marker is there
        mul1 = torch.zeros((), dtype=torch.int32)
    return LinearEXL3(config=None, in_features=k, out_features=n, scale=None, su=None, sv=None, suh=suh, svh=svh,
                      trellis=trellis.to(torch.int16), mcg=None, mul1=mul1, bias=None, out_dtype=torch.half,
                      key=f"probe.{k}x{n}.{bits}")  # fmt: skip


def exl3_pins(ctx: Ctx, lin: Any, k: int, n: int, fp32: bool, salt: int) -> Pins:
    from exllamav3.ext import exllamav3_ext as ext

    torch = ctx.torch
    dt = torch.float32 if fp32 else torch.half
    x1 = torch.randn((1, 1, k), generator=ctx.gen(salt), device=ctx.dev).half()

    def own(pad: int = 0, gemv_off: bool = False) -> Callable[[int], Any]:
        def make(rows: int) -> Callable[[], Any]:
            x = batch(ctx, x1, padded(rows, pad) if pad else rows, salt)
            if pad:  # the measured row at rows // 2 of the real rows, zeros past them
                x[rows:] = 0
                x[rows // 2] = x1[0]

            def call() -> Any:
                if not gemv_off:
                    return lin.forward(x, {}, out_dtype=dt)
                old = os.environ.get("EXL3_GEMV")
                os.environ["EXL3_GEMV"] = "0"  # read at every call (exl3_gemv.cu:31)
                try:
                    return lin.forward(x, {}, out_dtype=dt)
                finally:
                    if old is None:
                        del os.environ["EXL3_GEMV"]
                    else:
                        os.environ["EXL3_GEMV"] = old

            return call

        return make

    def forced(shape: int, pad: int = 0) -> Callable[[int], Any]:
        def make(rows: int) -> Callable[[], Any]:
            m = padded(rows, pad) if pad else rows
            x = batch(ctx, x1, m, salt).view(m, k)
            if pad:
                x[rows:] = 0
                x[rows // 2] = x1[0, 0]

            def call() -> Any:
                y = torch.empty((m, n), dtype=dt, device=ctx.dev)
                ext.exl3_gemm(x, lin.trellis, y, lin.suh, torch.empty_like(x), lin.svh, shape, lin.mcg, lin.mul1, 0)
                return y

            return call

        return make

    fits = [s for s in (1, 2, 3, 4) if exl3_shape_fits(s, k, n)]
    pins: Pins = {"none": own()}
    pins.update({f"pad16+shape={s}": forced(s, 16) for s in fits[:2]})
    pins.update({f"shape={s}": forced(s) for s in fits})
    if exl3_shape_fits(7, k, n):  # deterministic=True's pinned strategy: every step at 64 rows, the 64-row tile
        pins[PINNED_EXL3] = forced(7, 64)
    pins["pad64 (one bucket)"] = own(64)
    pins["pad16 (autotuned per 16-row bucket)"] = own(16)
    pins["gemv off (EXL3_GEMV=0)"] = own(gemv_off=True)
    return pins


def exl3(ctx: Ctx) -> None:
    """exllamav3's EXL3 GEMM of one quantized Linear (``LinearEXL3.forward``: int8 GEMV, QTIP GEMV or the tuned
    tensor-core kernel by row count) and the fused gate+up ``exl3_mgemm``, most used shapes first."""
    jobs: list[Callable[[], None]] = []
    for bits in ctx.bits:
        linears = [(name, k, n, fp32, bits) for name, k, n, fp32 in EXL3_OPS]
        jobs += [lambda a=a: _exl3_linear_op(ctx, *a) for a in linears[:4]]
        jobs.append(lambda bits=bits: _mgemm_op(ctx, *MGEMM_OPS[0], bits))
        jobs += [lambda a=a: _exl3_linear_op(ctx, *a) for a in linears[4:]]
    jobs.insert(4, lambda: _exl3_linear_op(ctx, *EXL3_HEADS[0], False, ctx.head_bits))
    jobs.insert(7, lambda: _exl3_linear_op(ctx, *EXL3_HEADS[1], False, ctx.head_bits))
    jobs += [lambda bits=bits: _mgemm_op(ctx, *MGEMM_OPS[1], bits) for bits in ctx.bits]
    for i, job in enumerate(jobs):
        if ctx.budget.out(ctx.budget.reserve):
            ctx.rec.write(kind="skipped", section="exl3_gemm", why=f"section budget spent before ops {i}..")
            break
        with guarded(ctx.rec, f"exl3_gemm op {i}"):  # (building its weights, say)
            job()


def _exl3_linear_op(ctx: Ctx, name: str, k: int, n: int, fp32: bool, bits: int) -> None:
    salt = (k * 7 + n * 3 + bits) % 9973
    lin = exl3_linear(ctx, k, n, bits, salt)
    meta = {"dtype": f"exl3 {bits}-bit mul1", "k": k, "n": n, "out": "fp32" if fp32 else "fp16"}
    pins = exl3_pins(ctx, lin, k, n, fp32, salt + 1)
    run_op(ctx, "exl3_gemm", f"{name} {bits}-bit", meta, pins, lambda o, t: o.view(-1, o.shape[-1])[t])


def _mgemm_op(ctx: Ctx, name: str, k: int, n: int, bits: int) -> None:
    from exllamav3.ext import exllamav3_ext as ext
    from exllamav3.modules.multilinear import MultiLinear

    torch = ctx.torch
    lins = [exl3_linear(ctx, k, n, bits, 50 + j + n % 97) for j in (0, 1)]
    shims = [
        SimpleNamespace(quant_type="exl3", inner=lin, softcap=0.0, post_scale=1.0, in_features=k, out_features=n)
        for lin in lins
    ]
    ml = MultiLinear(ctx.dev, shims)
    x1 = torch.randn((1, 1, k), generator=ctx.gen(60 + n % 97), device=ctx.dev).half()

    def mgemm(shape: int, pad: int = 0) -> Callable[[int], Any]:
        def make(rows: int) -> Callable[[], Any]:
            m = padded(rows, pad) if pad else rows
            x = batch(ctx, x1, m, 61).view(1, m, k)
            if pad:
                x[0, rows:] = 0
                x[0, rows // 2] = x1[0, 0]

            def call() -> Any:
                guh = torch.empty((2, m, k), dtype=torch.half, device=ctx.dev)
                gu = torch.empty((2, m, n), dtype=torch.float32, device=ctx.dev)
                ext.exl3_mgemm(x, ml.ptrs_trellis, gu, ml.ptrs_suh, guh, ml.ptrs_svh, None, None, ml.K, shape,
                               ml.mcg, ml.mul1, -1, -1, 0, 1, None, None)  # fmt: skip
                return gu

            return call

        return make

    fits = [s for s in (1, 2, 3, 4) if exl3_shape_fits(s, k, n)]
    pins: Pins = {"none": mgemm(-1)}
    pins.update({f"pad16+shape={s}": mgemm(s, 16) for s in fits[:2]})
    pins.update({f"shape={s}": mgemm(s) for s in fits})
    pins["pad64 (one bucket)"] = mgemm(-1, 64)
    meta = {"dtype": f"exl3 {bits}-bit mul1", "k": k, "n": n, "out": "fp32"}
    run_op(ctx, "exl3_gemm", f"{name} {bits}-bit", meta, pins, lambda o, t: o[:, t])


# ---------------------------------------------------------------------- 3-4. the fp16 GEMM, the head, the norms


def fp16(ctx: Ctx) -> None:
    """The fp16 GEMMs of exllamav3's ``LinearFP16`` (torch.matmul for an fp16 output, its cuBLAS ``hgemm`` for an
    fp32 one), the LM head included."""
    for i, (name, k, n, fp32) in enumerate(FP16_OPS):
        with guarded(ctx.rec, f"fp16_gemm {name}"):
            _fp16_op(ctx, i, name, k, n, fp32)


def _fp16_op(ctx: Ctx, i: int, name: str, k: int, n: int, fp32: bool) -> None:
    from exllamav3.ext import exllamav3_ext as ext

    torch = ctx.torch
    w = (torch.randn((k, n), generator=ctx.gen(200 + i), device=ctx.dev) / math.sqrt(k)).half()
    x1 = torch.randn((1, k), generator=ctx.gen(300 + i), device=ctx.dev).half()
    dt = torch.float32 if fp32 else torch.half

    def gemm(pad: int = 0, reduced: bool | None = None, own: bool = False, w: Any = w, x1: Any = x1,
             dt: Any = dt, fp32: bool = fp32) -> Callable[[int], Any]:  # fmt: skip
        def make(rows: int) -> Callable[[], Any]:
            m = padded(rows, pad) if pad else rows
            x = batch(ctx, x1, m, 301)
            if pad:
                x[rows:] = 0
                x[rows // 2] = x1[0]

            if own:
                from _probe_triton import fixed_gemm

                return lambda: fixed_gemm(x, w, dt, ctx.sms)

            def call() -> Any:
                y = torch.empty((m, w.shape[1]), dtype=dt, device=ctx.dev)
                if fp32:
                    ext.hgemm(x, w, y)
                    return y
                flag = torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction
                if reduced is not None:
                    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = reduced
                try:
                    return torch.matmul(x, w, out=y)
                finally:
                    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = flag

            return call

        return make

    pins: Pins = {"none": gemm()}
    if not fp32:
        pins["no reduced-precision reduction"] = gemm(reduced=False)
    pins.update({"pad16": gemm(16), "pad64 (one bucket)": gemm(64), "own fixed-tile Triton GEMM": gemm(own=True)})
    meta = {"dtype": "fp16", "k": k, "n": n, "out": "fp32 (ext.hgemm)" if fp32 else "fp16 (torch.matmul)",
            "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG")}  # fmt: skip
    run_op(ctx, "fp16_gemm", name, meta, pins, lambda o, t: o[t])
    del w


def norms(ctx: Ctx) -> None:
    """exllamav3's row-wise kernels of a decode step: RMSNorm (plain and with the residual add fused in), SiLU*up."""
    from exllamav3.ext import exllamav3_ext as ext

    torch = ctx.torch
    for i, h in enumerate((2048, 4096)):
        w = (1 + 0.1 * torch.randn((h,), generator=ctx.gen(400 + i), device=ctx.dev)).half()
        x1 = torch.randn((1, h), generator=ctx.gen(410 + i), device=ctx.dev)
        r1 = torch.randn((1, h), generator=ctx.gen(420 + i), device=ctx.dev)

        def rms(rows: int, w: Any = w, x1: Any = x1, h: int = h) -> Callable[[], Any]:
            x = batch(ctx, x1, rows, 411)

            def call() -> Any:
                y = torch.empty((rows, h), dtype=torch.half, device=ctx.dev)
                ext.rms_norm(x, w, y, 1e-5, 0.0, 1.0, False, False)
                return y

            return call

        def rms_res(rows: int, w: Any = w, x1: Any = x1, r1: Any = r1, h: int = h) -> Callable[[], Any]:
            x, r = batch(ctx, x1, rows, 412), batch(ctx, r1, rows, 413)

            def call() -> Any:  # the residual is updated in place: a copy each call
                y, r2 = torch.empty((rows, h), dtype=torch.half, device=ctx.dev), r.clone()
                ext.rms_norm_res_in(x, w, y, r2, 1e-5, 0.0, 1.0)
                return torch.cat([y.float(), r2], dim=1)

            return call

        run_op(ctx, "norms", f"rms_norm {h} (fp32 in, fp16 out)", {"dtype": "fp32->fp16"}, {"none": rms},
               lambda o, t: o[t])  # fmt: skip
        run_op(ctx, "norms", f"rms_norm_res_in {h} (residual add fused)", {"dtype": "fp32->fp16"},
               {"none": rms_res}, lambda o, t: o[t])  # fmt: skip
    g1 = torch.randn((1, 8192), generator=ctx.gen(430), device=ctx.dev)
    u1 = torch.randn((1, 8192), generator=ctx.gen(431), device=ctx.dev)

    def silu(rows: int) -> Callable[[], Any]:
        gx, ux = batch(ctx, g1, rows, 432), batch(ctx, u1, rows, 433)

        def call() -> Any:
            a = torch.empty((rows, 8192), dtype=torch.half, device=ctx.dev)
            ext.silu_mul(gx, ux, a, 0.0)
            return a

        return call

    run_op(ctx, "norms", "silu_mul 8192 (fp32 in, fp16 out)", {"dtype": "fp32->fp16"}, {"none": silu},
           lambda o, t: o[t])  # fmt: skip
