"""Do exllamav3's kernels compute a row the same way whatever else is in the step, once their launch choices are pinned?

Issue 57's probe. For each op of a decode step, at realistic decode shapes (a ~1B model: hidden 2048, 16 q / 8 kv heads
of 128, intermediate 8192, vocab 128256; and the fixtures of ``gpu_fast_decode.py``: the 1B Llama with intermediate
5632 and vocab 32000, 4-bit EXL3 with a 6-bit head, and the Llama-2-7B shape in fp16), one row's output alone is
compared bitwise (``torch.equal``) with the same row inside 2, 3, 4, 8, 9, 16, 17, 32 and 64 rows (the others random),
unpinned and under each pin; each pin's cost is the median of 21 timed launches (CUDA events around replays of a CUDA
graph of 8 calls) against unpinned at the same row count. Then a whole decode step, fp16 and EXL3: one row's logits
alone vs in N rows, through exllamav3's eager forward and through the fast path's captured step, unpinned and with
the pins that held (monkeypatched in the probe only), and the step's tok/s at 1, 16 and 64 rows (the price issue 57
asks for).

Where exllamav3 1.6.5 makes each launch choice (paths under its package folder), and the pins measured here:

1. Paged attention decode: ``Attention.decode_flash_attn`` (modules/attn.py:1195) -> ``attn_dispatch`` -> the first of
   ``attn_fns`` (modules/attention_fn/dispatch.py) that takes it: ``fn_triton_paged_attn_decode`` ->
   ``paged_attn_triton_decode`` (modules/attention_fn/triton_paged.py:1179). Its split count
   ``max(1, min(2*SMs // (rows*kv_heads*h_blocks), cdiv(max_k_len, block_n), 128))`` (:1284-1290) falls as rows grow,
   and the keys per split, ``cdiv(cdiv(max_k_len, splits), block_n) * block_n`` (:1291), follow the block table's
   width (``max_k_len = width*256 + 1``, :1276), not the row. (At <= 8 rows with EXL3 weights exllamav3's own loop
   takes ``bc_attn`` instead, attn.py:1135, whose splits follow the same rule, bc_attn.py:455; the fast path's
   captured step turns it off.) Pins: ``splits=S`` (one row's split count at every row count), ``splits=1``,
   ``split_len=L`` (``num_splits = width*256/L`` and ``max_kv_len = num_splits*L - 1``, both parameters of
   ``paged_attn_triton_decode``: every split starts at a multiple of L whatever the batch and the width; a split past
   a row's end adds an exact zero in the combine pass, which walks splits 16 at a time, :1114).
2. EXL3 GEMM: ``LinearEXL3.forward`` (modules/quant/exl3.py:140): up to 144 rows ``BC_LinearEXL3.run_alloc`` ->
   ``exl3_gemm`` (exllamav3_ext/quant/exl3_gemm.cu), which picks by row count: with the default ``mul1`` codebook the
   int8-activation GEMV at m <= 2 (exl3_gemm.cu:224; exl3_gemv_int8.cu:289, on by default :32, its mode read once a
   process: ``EXL3_INT8_GEMV=0`` only in a fresh process), ahead of any forced shape; the QTIP GEMV at m <= 8 for 2-4
   bits (exl3_gemm.cu:284, a kernel for m == 1 and another for m > 1, exl3_gemv.cu:128; ``EXL3_GEMV=0`` read per call);
   else the cooperative tensor-core kernel whose shape and SM count are autotuned by timing per row bucket (1, 2, 4,
   8, 16, then 16-row steps to 64: exl3_gemm.cu:79, :313; coop_autotune.cu, cached on disk under
   ``EXLLAMAV3_TUNE_CACHE``), unless ``force_shape_idx`` is given; inside the kernel a 16-row chunk of <= 8 rows
   reduces through another code path (exl3_gemm_inner.cuh:488). Up to 32 rows exllamav3 runs Q/K/V and gate/up as
   bundles through ``exl3_mgemm`` (attn.py:643-695, mlp.py:873; autotuned per bucket, exl3_gemm.cu:751), and up to 8
   rows its own graphed MLP (mlp.py:868). Pins: ``shape=s`` (``exl3_gemm(..., force_shape_idx=s)``),
   ``pad16+shape=s`` (rows padded to a multiple of 16, which also keeps m >= 3 off the int8 GEMV), ``pad16`` and
   ``pad64`` (padded, still autotuned), ``gemv off``; and, in a second process, ``EXL3_INT8_GEMV=0``.
3. fp16 GEMM: ``LinearFP16.forward`` (modules/quant/fp16.py:94-96): ``torch.matmul`` for an fp16 output (Q/K/V, the
   head), exllamav3's ``hgemm`` (cublasGemmEx, ``CUBLAS_GEMM_DEFAULT_TENSOR_OP`` on exllamav3's own workspace,
   exllamav3_ext/hgemm.cu:92-101) for fp32 (o_proj, MLP): cuBLAS's heuristic picks by (m, n, k). Pins: rows padded to
   16-row multiples or to one 64-row bucket, ``allow_fp16_reduced_precision_reduction=False``, the probe's own
   fixed-tile Triton GEMM (``_probe_triton.py``), and, in a second process, ``CUBLAS_WORKSPACE_CONFIG=:0:0`` (torch's
   handle only: exllamav3's ``hgemm`` sets its own workspace).
4. RMSNorm (plain and residual-fused) and SiLU*up: one block per row (exllamav3_ext/norm.cu:382), measured unpinned.
   The LM head is the last GEMM of 2 (EXL3, 6-bit) and 3 (fp16).
5. The whole step (``_probe_step.py``), with the pins that held above (the cheapest, by measured cost).

Output: ``DIR/gpu_invariance_probe.jsonl``, one line per measurement, written as it is measured (``kind``: invariance
with ``bitwise_equal`` / ``max_abs_diff``, cost with ``median_us`` / ``min_us`` / ``max_us`` / ``cost_vs_unpinned``,
skipped, error, note), and ``DIR/gpu_invariance_probe_summary.json`` with the table printed at the end.

    python benchmarks/gpu_invariance_probe.py --out DIR [--sections attention,exl3_gemm,fp16_gemm,norms,step]
        [--budget-s 480] [--section-s step=240] [--pins none,shape=2] [--time-rows 1,16,64] [--bits 4]
    python benchmarks/gpu_invariance_probe.py --dry-run --out DIR    # CPU: imports, arguments, shapes, arithmetic
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _probe_core import (  # noqa: E402
    ROWS,
    Budget,
    Recorder,
    default_splits,
    exl3_pinned_shape,
    exl3_shape_fits,
    fixed_split_plan,
    guarded,
    split_len,
    unmet,
)
from _probe_ops import ATTN_SHAPES, ATTN_SPLIT_LENS, EXL3_HEADS, EXL3_OPS, FP16_OPS, MGEMM_OPS, Ctx  # noqa: E402

SECTIONS = ("attention", "exl3_gemm", "fp16_gemm", "norms", "step")
SECTION_S = {"attention": 40, "exl3_gemm": 80, "fp16_gemm": 40, "norms": 8, "step": 240}
CHILDREN = {"exl3_gemm": ("EXL3_INT8_GEMV=0", "none,shape=1,shape=2", 30),
            "fp16_gemm": ("CUBLAS_WORKSPACE_CONFIG=:0:0", "none,pad16", 25)}  # fmt: skip
"""A second process per section, for a setting read once a process: (env, pins, seconds)."""


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    os.environ.update({"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"})
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("/tmp/out"))
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--budget-s", type=float, default=480.0, help="the whole run's wall-clock budget")
    ap.add_argument("--section-s", default="", help="per-section budgets, e.g. step=240,attention=40")
    ap.add_argument("--pins", default="", help="only these pins (besides none), comma-separated")
    ap.add_argument("--time-rows", default="1,2,4,8,16,32,64")
    ap.add_argument("--bits", default="4", help="EXL3 bit widths of the layer GEMMs")
    ap.add_argument("--head-bits", type=int, default=6)
    ap.add_argument("--exl3-prefer", default="2,1", help="forced EXL3 shapes the step's pins try, in order")
    ap.add_argument("--no-exl3-step", action="store_true", help="the step section on fp16 only (no ~90 s conversion)")
    ap.add_argument("--no-children", action="store_true", help="no second process for EXL3_INT8_GEMV / cuBLAS")
    ap.add_argument("--child-env", default="", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dry-run", action="store_true", help="on a CPU: imports, arguments, shapes and pin arithmetic")
    args = ap.parse_args(argv)
    args.sections = [s for s in args.sections.split(",") if s]
    if bad := [s for s in args.sections if s not in SECTIONS]:
        ap.error(f"unknown sections {bad}; choose from {', '.join(SECTIONS)}")
    budgets = dict(SECTION_S)
    for item in filter(None, args.section_s.split(",")):
        name, _, seconds = item.partition("=")
        if name not in SECTIONS or not seconds.replace(".", "", 1).isdigit():
            ap.error(f"--section-s takes SECTION=SECONDS of {', '.join(SECTIONS)}, not {item!r}")
        budgets[name] = float(seconds)
    args.section_s = budgets
    args.time_rows = tuple(int(r) for r in args.time_rows.split(",") if r)
    args.bits = tuple(int(b) for b in args.bits.split(",") if b)
    args.exl3_prefer = tuple(int(s) for s in args.exl3_prefer.split(","))
    if bad_bits := [b for b in (*args.bits, args.head_bits) if not 1 <= b <= 8]:
        ap.error(f"EXL3 bit widths are 1..8, not {bad_bits}")
    return args


# ---------------------------------------------------------------------- the dry run (no CUDA)


def dry_run(args: argparse.Namespace, rec: Recorder) -> int:
    """Every measurement the run would make, written as ``plan`` lines, and the pin arithmetic checked."""
    import _probe_step  # noqa: F401 - it imports without CUDA (and without exllamav3)

    problems: list[str] = []
    for label, qh, kvh, _ in ATTN_SHAPES:
        s1 = default_splits(1, kvh, qh // kvh, 132, 16, 64)
        for width in (16, 32):
            for length in ATTN_SPLIT_LENS:
                splits, max_kv = fixed_split_plan(width, length)
                got = split_len(width, splits, 64, max_kv)
                problems += [f"{label} width {width}: split_len={length} gives {got}"] if got != length else []
                rec.write(kind="plan", section="attention", op=label, pin=f"split_len={length}", width=width,
                          num_splits=splits, max_kv_len=max_kv, split_len=got, rows=[1, *ROWS])  # fmt: skip
            rec.write(kind="plan", section="attention", op=label, pin=f"splits={s1} (one row's)", width=width,
                      split_len=split_len(width, s1, 64), rows=[1, *ROWS])  # fmt: skip
    for name, k, n, _ in [*EXL3_OPS, *((h, k, n, False) for h, k, n in EXL3_HEADS)]:
        fits = [s for s in (1, 2, 3, 4) if exl3_shape_fits(s, k, n)]
        try:
            exl3_pinned_shape(k, n, args.exl3_prefer)
        except ValueError as e:
            problems.append(str(e))
        rec.write(kind="plan", section="exl3_gemm", op=name, k=k, n=n, forced_shapes=fits, rows=[1, *ROWS])
    for name, k, n in MGEMM_OPS:
        rec.write(kind="plan", section="exl3_gemm", op=name, k=k, n=n, rows=[1, *ROWS])
    for name, k, n, fp32 in FP16_OPS:
        rec.write(kind="plan", section="fp16_gemm", op=name, k=k, n=n, out="fp32" if fp32 else "fp16", rows=[1, *ROWS])
    rec.write(kind="plan", section="norms", op="rms_norm, rms_norm_res_in, silu_mul", rows=[1, *ROWS])
    rec.write(kind="plan", section="step", op="fp16 1B and EXL3 4-bit 1B", rows=[1, *ROWS], timed_rows=[1, 16, 64])
    root = _exllamav3_root()
    missing = unmet(root)
    rec.write(kind="requirements", source=str(root), unmet=missing)
    if root is not None and missing:
        problems += missing
    for p in problems:
        print(f"[dry run] {p}", flush=True)
    print(f"[dry run] {len(rec.rows)} lines in {rec.path}; exllamav3 source {root}", flush=True)
    return 1 if problems else 0


def _exllamav3_root() -> Path | None:
    """exllamav3's package folder: ``$EXLLAMAV3_SOURCE/exllamav3`` if set, else the installed one (not imported)."""
    if os.environ.get("EXLLAMAV3_SOURCE"):
        return Path(os.environ["EXLLAMAV3_SOURCE"]) / "exllamav3"
    from exllama_integrations.backends.exllamav3.upstream.depends import source_root

    return source_root("exllamav3")


# ---------------------------------------------------------------------- the run


def held(rows: list[dict[str, Any]], section: str, candidates: list[tuple[str, Any]], default: Any) -> tuple[Any, str]:
    """The cheapest candidate pin that kept the row bitwise equal in every op and row count of ``section``."""
    ops = {r["op"] for r in rows if r.get("section") == section and r.get("kind") == "invariance" and "env" not in r}
    best: tuple[float, Any, str] | None = None
    for pin, value in candidates:
        inv = [r for r in rows if r.get("kind") == "invariance" and r.get("section") == section and r.get("pin") == pin
               and r.get("rows", 1) > 1 and "env" not in r]  # fmt: skip
        if not inv or {r["op"] for r in inv} != ops or not all(r.get("bitwise_equal") for r in inv):
            continue
        costs = [r["cost_vs_unpinned"] for r in rows if r.get("kind") == "cost" and r.get("section") == section
                 and r.get("pin") == pin and "cost_vs_unpinned" in r and "env" not in r]  # fmt: skip
        cost = statistics.mean(costs) if costs else (1.0 if pin == "none" else 9.0)
        if best is None or cost < best[0]:
            best = (cost, value, pin)
    if best is None:
        return default, f"none held (or not measured): {default}"
    return best[1], f"{best[2]} held everywhere, mean cost {best[0]:.3f} of unpinned"


def step_pins(ctx: Ctx) -> dict[str, dict[str, dict[str, Any]]]:
    rows = ctx.rec.rows
    attn, why_a = held(rows, "attention", [("none", None), *((f"split_len={n}", f"split_len={n}") for n in
                       ATTN_SPLIT_LENS), ("splits=1", "splits=1")], "split_len=128")  # fmt: skip
    fp16, why_f = held(rows, "fp16_gemm", [("none", None), ("no reduced-precision reduction", "no_reduced"),
                       ("pad16", "pad16"), ("pad64 (one bucket)", "pad64"), ("own fixed-tile Triton GEMM", "own")],
                       "pad64")  # fmt: skip
    prefer, why_e = held(
        rows, "exl3_gemm", [("pad16+shape=2", (2, 1)), ("pad16+shape=1", (1, 2))], ctx.notes["exl3_prefer"]
    )
    ctx.notes["exl3_prefer"] = prefer
    chosen = {"attention": [attn, why_a], "fp16": [fp16, why_f], "exl3 forced shapes": [prefer, why_e]}
    ctx.rec.write(kind="note", section="step", chosen=chosen)
    a = {"attention": attn}
    return {  # the full pin sets first (the price), the attention pin alone last (its share of it)
        "fp16": {"none": {}, f"attention {attn}, fp16 {fp16}": {**a, "fp16": fp16}, f"attention {attn} only": a},
        "exl3": {
            "none": {},
            f"attention {attn}, EXL3 unfused, pad16+forced shape": {**a, "exl3": "unfused", "fp16": fp16},
            f"attention {attn}, EXL3 bundles on a forced mgemm shape": {**a, "exl3": "mgemm_forced", "fp16": fp16},
            f"attention {attn} only": a,
        },
    }


def run_section(name: str, ctx: Ctx, args: argparse.Namespace) -> None:
    import _probe_ops as ops

    if name == "step":
        import _probe_step

        _probe_step.step(ctx, step_pins(ctx), exl3=not args.no_exl3_step)
        return
    try:
        {"attention": ops.attention, "exl3_gemm": ops.exl3, "fp16_gemm": ops.fp16, "norms": ops.norms}[name](ctx)
    finally:
        ops.time_pins(ctx)  # what the comparisons reached, timed with the section's time left


def child(args: argparse.Namespace, section: str, budget: Budget, rec: Recorder) -> None:
    """The section again in a fresh process with one environment setting (read once a process)."""
    env_kv, pins, seconds = CHILDREN[section]
    seconds = min(seconds, budget.total_left() - 220 if "step" in args.sections else budget.total_left() - 5)
    if seconds < 15:
        rec.write(kind="skipped", section=section, env=env_kv, why="no time left for the second process")
        return
    key, _, value = env_kv.partition("=")
    cmd = [sys.executable, __file__, "--out", str(args.out), "--sections", section, "--child-env", env_kv,
           "--budget-s", str(int(seconds)), "--section-s", f"{section}={int(seconds)}", "--pins", pins,
           "--time-rows", "1,16,64", "--bits", ",".join(map(str, args.bits)), "--seed", str(args.seed)]  # fmt: skip
    try:
        proc = subprocess.run(cmd, env={**os.environ, key: value}, timeout=seconds + 40, check=False)
        rec.write(kind="note", section=section, env=env_kv, child_rc=proc.returncode)
    except subprocess.TimeoutExpired:
        rec.write(kind="error", where=f"{section} with {env_kv}", error="the second process timed out")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    rec = Recorder(args.out, extra={"env": args.child_env} if args.child_env else None)
    if args.dry_run:
        return dry_run(args, rec)
    import torch

    if not torch.cuda.is_available():
        rec.write(kind="error", where="start", error="no CUDA device (use --dry-run on a CPU)")
        return 2
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    props = torch.cuda.get_device_properties(dev)
    budget = Budget(args.budget_s)
    ctx = Ctx(torch, rec, budget, dev, props.multi_processor_count, args.time_rows,
              set(args.pins.split(",")) if args.pins else None, args.bits, args.head_bits, args.seed)  # fmt: skip
    ctx.notes["exl3_prefer"] = args.exl3_prefer
    from importlib.metadata import version

    try:
        import exllamav3  # noqa: F401
    except Exception as e:  # noqa: BLE001 - said in the record
        rec.error("import exllamav3", e)
        return 3
    if not args.child_env:
        rec.write(kind="env", gpu=props.name, sms=props.multi_processor_count, torch=torch.__version__,
                  exllamav3=version("exllamav3"), requirements_unmet=unmet(_exllamav3_root()),
                  sections=args.sections, budget_s=args.budget_s)  # fmt: skip
    for name in args.sections:
        if budget.total_left() < 5:
            rec.write(kind="skipped", section=name, why="run budget spent")
            continue
        budget.start(name, args.section_s[name])
        t0 = time.perf_counter()
        with guarded(rec, name):
            run_section(name, ctx, args)
        torch.cuda.empty_cache()
        rec.write(kind="section", section=name, seconds=round(time.perf_counter() - t0, 1))
        if name in CHILDREN and not args.child_env and not args.no_children:
            child(args, name, budget, rec)
    if not args.child_env:
        summary(args.out, rec.path)
    return 0


# ---------------------------------------------------------------------- the summary


def summary(out: Path, path: Path) -> dict[str, Any]:
    """The table: per (section, op, pin[, env]) rows equal of rows measured, worst difference, cost at 1/16/64;
    per step pin set, tok/s at 1/16/64 and its ratio to unpinned."""
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    groups: dict[tuple[str, ...], dict[str, Any]] = defaultdict(
        lambda: {"equal": 0, "of": 0, "worst": 0.0, "us": {}, "ratio": {}, "tok_s": {}}
    )
    for r in lines:
        if r.get("kind") not in ("invariance", "cost"):
            continue
        g = groups[(r["section"], r["op"], r["pin"], r.get("env", ""))]
        if r["kind"] == "invariance" and r.get("rows", 1) > 1:
            g["of"] += 1
            g["equal"] += bool(r.get("bitwise_equal"))
            g["worst"] = max(g["worst"], r.get("max_abs_diff", 0.0))
        elif r["kind"] == "cost":
            g["us"][r["rows"]] = r.get("median_us")
            g["ratio"][r["rows"]] = r.get("cost_vs_unpinned")
            g["tok_s"][r["rows"]] = r.get("tok_s")

    def three(d: dict[int, Any], fmt: str) -> str:
        return "/".join("-" if d.get(n) is None else format(d[n], fmt) for n in (1, 16, 64))

    table = []
    print("\nsection   op | pin [env]: equal/compared, worst |diff|, µs @1/16/64, cost vs unpinned (step: tok/s)")
    for (section, op, pin, env), g in groups.items():
        row = {"section": section, "op": op, "pin": pin, "env": env, "equal": g["equal"], "of": g["of"],
               "worst_abs_diff": g["worst"], **{k: g[k] for k in ("us", "ratio", "tok_s")}}  # fmt: skip
        table.append(row)
        last = three(g["tok_s"], ".0f") if section == "step" else three(g["ratio"], ".3f")
        print(f"{section:9} {op[:58]:58} | {pin[:44]:44} {env[:12]:12} {g['equal']:>2}/{g['of']:<2} "
              f"{g['worst']:<9.3g} {three(g['us'], '.1f'):>22} {last}")  # fmt: skip
    for r in (r for r in table if r["section"] == "step" and r["tok_s"] and r["pin"] != "none"):
        base = next((b for b in table if b["section"] == "step" and b["op"] == r["op"] and b["pin"] == "none"), None)
        if base is None:
            continue
        ratios = {
            n: r["tok_s"][n] / base["tok_s"][n] for n in (1, 16, 64) if r["tok_s"].get(n) and base["tok_s"].get(n)
        }
        r["tok_s_vs_unpinned"] = ratios
        print(f"step price: {r['op'][:44]} | {r['pin'][:70]}: tok/s vs unpinned @1/16/64 {three(ratios, '.3f')}")
    held_by_pin = _held_by_pin(table)
    for (section, pin, env), h in held_by_pin.items():
        cost = "-" if h["mean_cost"] is None else f"{h['mean_cost']:.3f}"
        print(f"held: {section:9} {pin[:48]:48} {env[:28]:28} every row equal in {h['held']}/{h['ops']} ops; "
              f"cost vs unpinned (mean) {cost}")  # fmt: skip
    notes = [r for r in lines if r.get("kind") in ("note", "error", "skipped", "env")]
    held_rows = [{"section": k[0], "pin": k[1], "env": k[2], **v} for k, v in held_by_pin.items()]
    result = {"table": table, "held": held_rows, "notes": notes}
    (out / "gpu_invariance_probe_summary.json").write_text(json.dumps(result, indent=1, default=str))
    return result


def _held_by_pin(table: list[dict[str, Any]]) -> dict[tuple[str, str, str], dict[str, Any]]:
    """Per (section, pin, env): in how many ops every row was equal, of the ops compared, and its mean cost."""
    out: dict[tuple[str, str, str], dict[str, Any]] = {}
    for r in table:
        if not r["of"]:
            continue
        h = out.setdefault((r["section"], r["pin"], r["env"]), {"held": 0, "ops": 0, "costs": []})
        h["ops"] += 1
        h["held"] += r["equal"] == r["of"]
        h["costs"] += [c for c in r["ratio"].values() if c is not None]
    for h in out.values():
        costs = h.pop("costs")
        h["mean_cost"] = statistics.mean(costs) if costs else None
    return out


if __name__ == "__main__":
    raise SystemExit(main())
