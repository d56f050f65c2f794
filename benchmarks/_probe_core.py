"""What every part of the invariance probe shares: its JSONL record, its time budget, CUDA timing, and the arithmetic
of exllamav3's launch choices and of each pin (pure functions: the dry run and the unit tests check them on a CPU).

The launch arithmetic mirrors exllamav3 1.6.5 (file:line there); :data:`REQUIREMENTS` declares the Python members the
probe reaches, checked against the installed source before a run (``exllama_integrations``' own checker, no import).
"""

from __future__ import annotations

import json
import statistics
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROWS = (2, 3, 4, 8, 9, 16, 17, 32, 64)
"""The row counts a row is measured inside (besides alone)."""

PAGE = 256
"""exllamav3's page (tokens); ``constants.PAGE_SIZE``."""

REPS = 21
"""Timed launches per measurement (>= 20; the median is reported)."""

# ---------------------------------------------------------------------- launch arithmetic (exllamav3 1.6.5)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def decode_row_layout(q_len: int, group: int) -> tuple[int, int]:
    """(BLOCK_ROWS, row blocks per kv head): ``triton_paged.decode_row_layout`` (triton_paged.py:1151)."""
    rows = q_len * group
    block_rows = max(16, min(32, 1 << max(0, (rows - 1).bit_length())))
    return block_rows, cdiv(rows, block_rows)


def default_splits(rows: int, kv_heads: int, group: int, sms: int, width: int, block_n: int, append: int = 1) -> int:
    """The split count ``paged_attn_triton_decode`` picks (triton_paged.py:1272-1290): ``2*SMs / programs``.

    ``programs = rows * kv_heads * h_blocks``; capped by the key tiles of the table's bound and 128.
    """
    _, h_blocks = decode_row_layout(1, group)
    programs = rows * kv_heads * h_blocks
    max_k_len = width * PAGE + append
    return max(1, min((2 * sms) // programs, cdiv(max_k_len, block_n), 128))


def split_len(width: int, splits: int, block_n: int, max_kv_len: int | None = None, append: int = 1) -> int:
    """The keys each split covers (triton_paged.py:1277-1291): from the table's width, not from the row."""
    max_k_len = width * PAGE + append
    if max_kv_len is not None:
        max_k_len = min(max_k_len, max_kv_len + append)
    return cdiv(cdiv(max_k_len, splits), block_n) * block_n


def fixed_split_plan(width: int, length: int, append: int = 1) -> tuple[int, int]:
    """``(num_splits, max_kv_len)`` that make every split cover ``length`` keys at any width (the pin).

    Splits start at multiples of ``length`` whatever the batch: ``num_splits`` covers the table
    (``width * PAGE / length``; a split past a row's end is empty and adds an exact zero in the combine pass) and
    ``max_kv_len`` makes the kernel's bound exactly ``num_splits * length``. Needs ``length`` to divide
    ``width * PAGE`` (exllamav3 pads a step's table to 16 pages: any divisor of 4096 does) and to be a multiple of
    the kv tile.
    """
    if (width * PAGE) % length:
        raise ValueError(f"split length {length} does not divide a table of {width} pages")
    splits = width * PAGE // length
    return splits, splits * length - append


EXL3_TILES = {1: (16, 16, 128), 2: (16, 32, 128), 3: (16, 32, 256), 4: (16, 16, 512), 5: (32, 32, 128),
              6: (48, 32, 128), 7: (64, 32, 128)}  # fmt: skip
"""CUDA kernel shapes (TILESIZE_M, _K, _N) of the EXL3 GEMM (exllamav3_ext/quant/exl3_kernel_map.cuh:112-124)."""


def exl3_shape_fits(shape: int, k: int, n: int) -> bool:
    """Whether a forced EXL3 kernel shape divides a (k, n) matrix (``exl3_gemm_check_divides``, kernel_map.cu)."""
    _, tk, tn = EXL3_TILES[shape]
    return k % tk == 0 and n % tn == 0


def exl3_pinned_shape(k: int, n: int, prefer: tuple[int, ...] = (2, 1)) -> int:
    """The forced shape a pin uses for a (k, n) matrix: the first of ``prefer`` that divides it (k, n only)."""
    for s in prefer:
        if exl3_shape_fits(s, k, n):
            return s
    raise ValueError(f"no EXL3 shape of {prefer} divides {k}x{n}")


def padded(rows: int, multiple: int) -> int:
    """Rows padded up to a multiple (a fixed bucket when ``multiple`` >= every row count)."""
    return max(multiple, cdiv(rows, multiple) * multiple)


def fixed_split_k(n: int, k: int, block_n: int = 64, block_k: int = 64, sms: int = 132) -> int:
    """The split-K of the probe's own fixed-tile GEMM: from (n, k) and the device only, never from the rows."""
    tiles = cdiv(n, block_n)
    return max(1, min(8, sms // tiles, k // (4 * block_k)))


# ---------------------------------------------------------------------- the record


class Recorder:
    """One JSON line per measurement, appended and flushed as soon as it is measured (a lost machine keeps it)."""

    def __init__(self, out: Path, name: str = "gpu_invariance_probe.jsonl", extra: dict[str, Any] | None = None):
        out.mkdir(parents=True, exist_ok=True)
        self.path = out / name
        self.extra = extra or {}
        self.rows: list[dict[str, Any]] = []

    def write(self, **row: Any) -> dict[str, Any]:
        row = {**row, **self.extra, "t": round(time.time(), 3)}
        self.rows.append(row)
        with self.path.open("a") as f:
            f.write(json.dumps(row, default=str) + "\n")
        return row

    def error(self, where: str, e: BaseException) -> None:
        tb = traceback.format_exc(limit=6)
        print(f"[probe] {where}: {type(e).__name__}: {str(e)[:300]}", flush=True)
        self.write(kind="error", where=where, error=f"{type(e).__name__}: {str(e)[:500]}", traceback=tb[-2000:])


class Budget:
    """An overall deadline and one per section; a section stops starting new work past either."""

    def __init__(self, total_s: float) -> None:
        self.end = time.monotonic() + total_s
        self.section_end = self.end
        self.section = ""
        self.reserve = 0.0  # seconds of a section kept for timing the pins its comparisons found

    def start(self, name: str, seconds: float, reserve: float = 0.3) -> None:
        self.section = name
        self.section_end = min(self.end, time.monotonic() + seconds)
        self.reserve = reserve * max(0.0, self.section_end - time.monotonic())

    def left(self) -> float:
        return max(0.0, min(self.end, self.section_end) - time.monotonic())

    def total_left(self) -> float:
        return max(0.0, self.end - time.monotonic())

    def out(self, need: float = 0.0) -> bool:
        return self.left() <= need


@contextmanager
def guarded(rec: Recorder, where: str) -> Iterator[None]:
    """Run a probe; an exception is recorded (with where) and the run goes on."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - one probe failing must not end the run
        rec.error(where, e)


def compare(torch: Any, a: Any, b: Any) -> dict[str, Any]:
    """Bitwise equality of two outputs and their largest absolute difference (and whether their argmax agrees)."""
    a, b = a.detach().reshape(-1), b.detach().reshape(-1)
    same = bool(torch.equal(a, b))
    diff = 0.0 if same else float((a.float() - b.float()).abs().max())
    return {"bitwise_equal": same, "max_abs_diff": diff}


def timed(torch: Any, fn: Callable[[], Any], reps: int = REPS, inner: int = 8) -> dict[str, Any]:
    """GPU time of ``fn`` (µs): ``inner`` calls captured in one CUDA graph, each of ``reps`` replays timed with
    CUDA events (the per-call median, min, max); eager launches between the events where capture fails."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    how, graph = "graph", None
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="relaxed"):
            for _ in range(inner):
                fn()
        graph.replay()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - fall back to eager launches
        how, graph = f"eager ({type(e).__name__})", None
        torch.cuda.synchronize()
    events = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        if graph is not None:
            graph.replay()
        else:
            for _ in range(inner):
                fn()
        b.record()
        events.append((a, b))
    torch.cuda.synchronize()
    us = [1000.0 * a.elapsed_time(b) / inner for a, b in events]
    del graph
    return {"median_us": statistics.median(us), "min_us": min(us), "max_us": max(us), "launches": reps, "timing": how}


# ---------------------------------------------------------------------- what the probe reaches in exllamav3


def requirements() -> list[Any]:
    """The exllamav3 1.6.5 Python members the probe calls or patches (the extension's functions: ``EXT_FUNCTIONS``)."""
    from exllama_integrations.backends.exllamav3.upstream.depends import Constant, Member

    tp, x = "exllamav3.modules.attention_fn.triton_paged", "exllamav3.modules"
    return [
        Constant(tp, "paged_attn_triton_decode"),
        Constant(tp, "decode_row_layout"),
        Constant(tp, "fn_triton_paged_attn_decode"),
        Constant("exllamav3.util.backend", "attn_decode_config"),
        Constant(f"{x}.attention_fn.dispatch", "attn_fns"),
        Constant("exllamav3.constants", "PAGE_SIZE", PAGE),
        Constant(f"{x}.quant.exl3", "AUTO_RECONSTRUCT_THRESHOLD", 144),
        Member(f"{x}.quant.exl3", "LinearEXL3", "__init__", ("config", "in_features", "out_features", "scale", "su",
               "sv", "suh", "svh", "trellis", "mcg", "mul1", "bias", "out_dtype")),
        *(Member(f"{x}.quant.exl3", "LinearEXL3", n) for n in ("forward", "trellis", "suh", "svh", "mcg", "mul1",
          "bias", "out_features", "in_features")),
        Member(f"{x}.quant.fp16", "LinearFP16", "forward", ("x", "params", "out_dtype")),
        Member(f"{x}.quant.fp16", "LinearFP16", "weight"),
        Member(f"{x}.multilinear", "MultiLinear", "__init__", ("device", "linears")),
        *(Member(f"{x}.multilinear", "MultiLinear", n) for n in ("ptrs_trellis", "ptrs_suh", "ptrs_svh", "K", "mcg",
          "mul1")),
        *(Member(f"{x}.attn", "Attention", n) for n in ("multi_qkv", "multi_kv", "multi_qg")),
        Member(f"{x}.mlp", "GatedMLP", "multi_gu"),
        Member("exllamav3.model.model", "Model", "forward", ("input_ids", "params")),
        Member("exllamav3.cache.cache", "Cache", "layers"),
        Member("exllamav3.cache.fp16", "CacheLayer_fp16", "k"),
        Member("exllamav3.cache.fp16", "CacheLayer_fp16", "v"),
    ]  # fmt: skip


EXT_FUNCTIONS = ("exl3_gemm", "exl3_mgemm", "hgemm", "rms_norm", "rms_norm_res_in", "silu_mul")
"""The extension's functions the probe calls (``m.def`` in exllamav3_ext/bindings.cpp)."""


def unmet(root: Path | None) -> list[str]:
    """What of :func:`requirements` (and :data:`EXT_FUNCTIONS`, where bindings.cpp ships) the source at ``root``
    (exllamav3's package folder) lacks; ``["source not found"]`` without one."""
    from exllama_integrations.backends.exllamav3.upstream.depends import facts, problems

    if root is None or not root.is_dir():
        return ["exllamav3 source not found"]
    reqs = requirements()
    out = problems(reqs, facts(root, reqs))
    bindings = root / "exllamav3_ext" / "bindings.cpp"
    if bindings.is_file():
        text = bindings.read_text(errors="replace")
        out += [f"exllamav3_ext.{f}: not bound" for f in EXT_FUNCTIONS if f'm.def("{f}"' not in text]
    return out
