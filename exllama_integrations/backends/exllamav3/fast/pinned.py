"""``deterministic=True``'s second strategy: the whole batch in one captured step, every launch choice pinned.

exllamav3 (1.6.5) chooses how a decode step's kernels split their work by the step's rows and block-table width, so a
row is summed in another order inside a batch than alone (docs/determinism.md). The first strategy
(:func:`.deterministic.rows_apart`) runs each row as a step of its own: exact, and one forward per row. This one runs
the step whole, as the default fast path does (one captured graph, run ahead of the step's bookkeeping), with each
choice that follows the batch fixed so that a row's sums are the same whatever else is in the step. The rules, and
why each holds (read in exllamav3 1.6.5's source; proven by ``tests/gpu/test_gpu_pinned.py`` on the GPU):

* paged attention (``triton_paged.paged_attn_triton_decode``): its split count is ``2*SMs/(rows*kv_heads)`` and each
  split's keys ``cdiv(max_k_len / splits)`` from the table's width. Pinned (:func:`split_plan`): ``num_splits =
  width*page/SPLIT_LEN`` and ``max_kv_len = num_splits*SPLIT_LEN - appended`` (both its own parameters), so every
  split starts at a multiple of :data:`SPLIT_LEN` keys whatever the batch and the width. A split past a row's end
  stores ``m = -inf, l = 0, acc = 0``, which the combine pass (16 splits a tile, from split 0) adds as an exact zero;
  the split count never reaches 1 (the single-split path stores directly): a table has at least 16 pages.
* EXL3 GEMMs (``LinearEXL3.forward``): at most 2 rows take an int8-activation GEMV, at most 8 the QTIP GEMV (one
  kernel for 1 row, another for more), else a kernel autotuned by timing per row bucket (cached on disk: another
  process may pick another), and a 16-row chunk of at most 8 rows reduces another way. Pinned: every GEMM of the
  step runs at :func:`bucket` rows (zeros below the real ones) on a forced kernel shape (:func:`exl3_shapes`, the
  64-row tile first): the same launch for every step, its work split from ``(k, n)`` and the SM count only, its
  k-slices reduced in a fixed order (exl3_gemm_inner.cuh). No GEMV is reached (they decline a forced shape and
  more than 8 rows), ``EXL3_INT8_GEMV`` need not be set. exllamav3's fused bundles (Q/K/V, K/V, Q/gate and
  gate/up ``exl3_mgemm``, at most 32 rows) are off in a pinned step: each projection is one pinned GEMM.
* fp16 GEMMs (``LinearFP16.forward``: ``torch.matmul``, or exllamav3's cuBLAS ``hgemm`` for an fp32 output): cuBLAS
  picks its algorithm by ``(m, n, k)``. Pinned: the same :func:`bucket` rows, so every step is the same problem.
* exllamav3's own per-layer graphs (its graphed attention and MLP up to 8 rows) stand aside in a pinned forward, as
  they do in every captured step; norms, RoPE, the cache write and the sampler are computed row by row already.

A pinned step's tokens are the same alone, in 16 or in 64; they are not exllamav3's own loop's for the request alone
(that loop takes the GEMV at one row). Prefill is unchanged: in blocks of pages (:mod:`.chunk_plan`). The pins
apply to the eager forwards and captures of decode steps only (a replay runs the kernels they recorded); the
patches themselves are the seam's (:mod:`.seam.pins`), which also says where the strategy stands aside.
"""

from __future__ import annotations

SPLIT_LEN = 256
"""Keys per attention split in a pinned step: one page (any multiple of the kernel's key tile holds; one page keeps
the splits of a long context few and those of a short one parallel)."""

ROW_MULTIPLE = 16
"""A pinned GEMM's rows are a multiple of this (the EXL3 kernels' and cuBLAS's row tile)."""

EXL3_TILES: dict[int, tuple[int, int, int]] = {
    1: (16, 16, 128),
    2: (16, 32, 128),
    3: (16, 32, 256),
    4: (16, 16, 512),
    5: (32, 32, 128),
    6: (48, 32, 128),
    7: (64, 32, 128),
}
"""The CUDA EXL3 GEMM's kernel shapes (TILESIZE_M, _K, _N) by index (exllamav3_ext/quant/exl3_kernel_map.cuh)."""

EXL3_SHAPES = (7, 2, 1)
"""Forced shapes in order of preference: the 64-row tile (a bucket of 64 rows decodes the weights once), then the
16-row ones (one decode per 16 rows). A shape the kernel refuses for a matrix (its shared memory) is passed over
once, on the first pinned call of that matrix's kind; the choice is kept (never per step)."""


def split_plan(width: int, page: int, split_len: int = SPLIT_LEN, appended: int = 1) -> tuple[int, int]:
    """``(num_splits, max_kv_len)`` for a paged decode over a block table of ``width`` pages of ``page`` tokens.

    With these the kernel's bound is ``num_splits * split_len`` keys (``max_kv_len + appended``, under the table's
    ``width * page + appended``) and each split covers ``split_len`` keys rounded up to its key tile: splits start
    at the same keys whatever the batch and the width.

    Raises:
        ValueError: ``split_len`` does not divide the table, or the plan would be a single split.
    """
    if width < 1 or page < 1 or split_len < 1 or (width * page) % split_len:
        raise ValueError(f"a split of {split_len} keys does not divide a table of {width} pages of {page}")
    splits = width * page // split_len
    if splits < 2:
        raise ValueError(f"a table of {width} pages of {page} keys is one split of {split_len}: nothing is pinned")
    return splits, splits * split_len - appended


def bucket(max_rows: int) -> int:
    """The rows every GEMM of a pinned step runs at: the generator's largest batch, rounded up to 16 rows."""
    if max_rows < 1:
        raise ValueError(f"a batch of {max_rows} rows")
    return -(-max_rows // ROW_MULTIPLE) * ROW_MULTIPLE


def exl3_shapes(k: int, n: int, prefer: tuple[int, ...] = EXL3_SHAPES) -> tuple[int, ...]:
    """The forced EXL3 shapes of ``prefer`` whose tile divides a ``k x n`` matrix (the kernel checks it too)."""
    return tuple(s for s in prefer if k % EXL3_TILES[s][1] == 0 and n % EXL3_TILES[s][2] == 0)


__all__ = ["EXL3_SHAPES", "EXL3_TILES", "ROW_MULTIPLE", "SPLIT_LEN", "bucket", "exl3_shapes", "split_plan"]
