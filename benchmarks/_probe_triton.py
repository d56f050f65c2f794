"""The probe's own fixed-tile fp16 GEMM (Triton): a candidate for an op cuBLAS cannot be pinned on, with its cost.

Every output element is summed in one order whatever the row count: the tiles (16 x ``BLOCK_N`` x ``BLOCK_K``) and
the split-K (:func:`_probe_core.fixed_split_k`, from n and k only) are fixed, no autotuning, and the split partials
are added in split order by a second kernel. Imported on the GPU only (it needs Triton).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from _probe_core import cdiv, fixed_split_k


@triton.jit
def _gemm_kernel(
    a_ptr, b_ptr, c_ptr, M, N, K, K_SPLIT,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cs, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, OUT_FP32: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    k_lo = split * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + offs_k
        a = tl.load(a_ptr + offs_m[:, None] * stride_am + kk[None, :] * stride_ak,
                    mask=(offs_m[:, None] < M) & (kk[None, :] < k_hi), other=0.0)  # fmt: skip
        b = tl.load(b_ptr + kk[:, None] * stride_bk + offs_n[None, :] * stride_bn,
                    mask=(kk[:, None] < k_hi) & (offs_n[None, :] < N), other=0.0)  # fmt: skip
        acc = tl.dot(a, b, acc)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    c = c_ptr + split * stride_cs + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    if OUT_FP32:
        tl.store(c, acc, mask=mask)
    else:
        tl.store(c, acc.to(tl.float16), mask=mask)


@triton.jit
def _sum_splits_kernel(p_ptr, c_ptr, MN, SPLITS: tl.constexpr, BLOCK: tl.constexpr, OUT_FP32: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLITS):  # in split order, always
        acc += tl.load(p_ptr + s * MN + offs, mask=mask, other=0.0)
    if OUT_FP32:
        tl.store(c_ptr + offs, acc, mask=mask)
    else:
        tl.store(c_ptr + offs, acc.to(tl.float16), mask=mask)


def fixed_gemm(x: Any, w: Any, out_dtype: Any, sms: int, block_n: int = 64, block_k: int = 64) -> Any:
    """``x [m, k] @ w [k, n]`` (fp16 in, fp32 accumulate) with tiles and split-K fixed by (n, k) alone."""
    m, k = x.shape
    n = w.shape[1]
    splits = fixed_split_k(n, k, block_n, block_k, sms)
    k_split = cdiv(cdiv(k, splits), block_k) * block_k  # whole k tiles per split
    splits = cdiv(k, k_split)
    out_fp32 = out_dtype == torch.float32
    y = torch.empty((m, n), dtype=out_dtype, device=x.device)
    grid = (triton.cdiv(m, 16), triton.cdiv(n, block_n), splits)
    if splits == 1:
        _gemm_kernel[grid](x, w, y, m, n, k, k_split, x.stride(0), x.stride(1), w.stride(0), w.stride(1), 0,
                           y.stride(0), y.stride(1), BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k,
                           OUT_FP32=out_fp32, num_warps=4, num_stages=3)  # fmt: skip
        return y
    part = torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
    _gemm_kernel[grid](x, w, part, m, n, k, k_split, x.stride(0), x.stride(1), w.stride(0), w.stride(1),
                       part.stride(0), part.stride(1), part.stride(2), BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k,
                       OUT_FP32=True, num_warps=4, num_stages=3)  # fmt: skip
    block = 1024
    _sum_splits_kernel[(triton.cdiv(m * n, block),)](part, y, m * n, SPLITS=splits, BLOCK=block, OUT_FP32=out_fp32)
    return y
