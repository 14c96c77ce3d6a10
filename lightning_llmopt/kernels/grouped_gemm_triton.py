"""Triton kernels of the grouped GEMM (:mod:`lightning_llmopt.kernels.grouped_gemm`). Imports Triton.

Rows of ``x`` are grouped by expert (group ``e`` = rows ``offsets[e] : offsets[e] + counts[e]``).

- :func:`grouped_mm_triton`: ``y[g] = x[g] @ w[e]^T`` for every group. One program per (row tile, column tile); the
  row tiles of all groups are listed in a tile table built on the device (no host synchronisation), so the grid has
  a fixed upper bound ``cdiv(M, BM) + E`` and surplus programs exit at once.
- :func:`grouped_wgrad_triton`: ``dw[e] = dy[g]^T @ x[g]``, one program per (expert, column tile, K tile) looping
  over the group's rows (a loop bound read from device memory).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from lightning_llmopt.kernels.flash_attention_interp import ensure_interpreted_stdlib

ensure_interpreted_stdlib()  # before the kernels below are decorated


@triton.jit
def _grouped_mm_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    tile_expert_ptr,
    tile_row_ptr,
    offsets_ptr,
    counts_ptr,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_we,
    stride_wn,
    stride_wk,
    stride_ym,
    stride_yn,
    IEEE: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(tile_expert_ptr + pid_t)
    if e < 0:
        return
    row0 = tl.load(tile_row_ptr + pid_t)
    start = tl.load(offsets_ptr + e)
    count = tl.load(counts_ptr + e)
    rows = row0 + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    row_ok = rows < count
    col_ok = cols < N
    x_rows = x_ptr + (start + rows).to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + e.to(tl.int64) * stride_we + cols[None, :] * stride_wn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK)
        k_ok = ks < K
        a = tl.load(x_rows + ks[None, :] * stride_xk, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_cols + ks[:, None] * stride_wk, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    y = y_ptr + (start + rows).to(tl.int64)[:, None] * stride_ym + cols[None, :] * stride_yn
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _grouped_wgrad_kernel(
    dy_ptr,
    x_ptr,
    dw_ptr,
    offsets_ptr,
    counts_ptr,
    N,
    K,
    stride_dym,
    stride_dyn,
    stride_xm,
    stride_xk,
    stride_we,
    stride_wn,
    stride_wk,
    IEEE: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    e = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    start = tl.load(offsets_ptr + e)
    count = tl.load(counts_ptr + e)
    cols = pid_n * BN + tl.arange(0, BN)
    ks = pid_k * BK + tl.arange(0, BK)
    col_ok = cols < N
    k_ok = ks < K
    acc = tl.zeros((BN, BK), dtype=tl.float32)
    for m0 in range(0, count, BM):
        rows = m0 + tl.arange(0, BM)
        row_ok = rows < count
        r = (start + rows).to(tl.int64)
        dy = tl.load(
            dy_ptr + r[:, None] * stride_dym + cols[None, :] * stride_dyn,
            mask=row_ok[:, None] & col_ok[None, :],
            other=0.0,
        )
        x = tl.load(
            x_ptr + r[:, None] * stride_xm + ks[None, :] * stride_xk, mask=row_ok[:, None] & k_ok[None, :], other=0.0
        )
        if IEEE:
            acc = tl.dot(tl.trans(dy), x, acc, input_precision="ieee")
        else:
            acc = tl.dot(tl.trans(dy), x, acc)
    dw = dw_ptr + e.to(tl.int64) * stride_we + cols[:, None] * stride_wn + ks[None, :] * stride_wk
    tl.store(dw, acc.to(dw_ptr.dtype.element_ty), mask=col_ok[:, None] & k_ok[None, :])


def _blocks(x: Tensor, wgrad: bool = False) -> tuple[int, int, int, int, int]:
    """``(BM, BN, BK, warps, stages)``: small tiles under the interpreter, Hopper-sized tiles on the GPU."""
    if x.device.type != "cuda":
        return 16, 16, 16, 1, 1
    if x.dtype == torch.float32:
        return 64, 64, 32, 4, 3
    return (64, 128, 64, 8, 3) if wgrad else (128, 128, 64, 8, 3)


def tile_table(counts: Tensor, block_m: int, total_rows: int) -> tuple[Tensor, Tensor, Tensor, int]:
    """``(tile_expert, tile_row, offsets, num_tiles)`` for row tiles of ``block_m``; built without host sync."""
    num_experts = counts.numel()
    counts = counts.to(torch.int64)
    tiles = (counts + block_m - 1) // block_m
    cum = torch.cumsum(tiles, 0)
    num_tiles = triton.cdiv(total_rows, block_m) + num_experts  # upper bound of sum(tiles)
    t = torch.arange(num_tiles, device=counts.device)
    e = torch.searchsorted(cum, t, right=True)
    valid = e < num_experts
    e_c = e.clamp(max=num_experts - 1)
    row = (t - (cum - tiles)[e_c]) * block_m
    tile_expert = torch.where(valid, e_c, torch.full_like(e_c, -1)).to(torch.int32)
    offsets = (torch.cumsum(counts, 0) - counts).to(torch.int64)
    return tile_expert, row.to(torch.int32), offsets, num_tiles


def grouped_mm_triton(x: Tensor, w: Tensor, counts: Tensor) -> Tensor:
    """``(M, K) x (E, N, K) -> (M, N)``, rows grouped by ``counts`` ``(E,)``."""
    m, k = x.shape
    num_experts, n, _ = w.shape
    y = torch.empty((m, n), device=x.device, dtype=x.dtype)
    if m == 0:
        return y
    bm, bn, bk, warps, stages = _blocks(x)
    tile_expert, tile_row, offsets, num_tiles = tile_table(counts, bm, m)
    grid = (num_tiles, triton.cdiv(n, bn))
    _grouped_mm_kernel[grid](
        x,
        w,
        y,
        tile_expert,
        tile_row,
        offsets,
        counts.to(torch.int64),
        n,
        k,
        x.stride(0),
        x.stride(1),
        w.stride(0),
        w.stride(1),
        w.stride(2),
        y.stride(0),
        y.stride(1),
        IEEE=x.dtype == torch.float32,
        BM=bm,
        BN=bn,
        BK=bk,
        num_warps=warps,
        num_stages=stages,
    )
    return y


def grouped_wgrad_triton(dy: Tensor, x: Tensor, counts: Tensor, out_dtype: torch.dtype) -> Tensor:
    """``dw[e] = dy[g]^T @ x[g]``: ``(M, N), (M, K) -> (E, N, K)`` in ``out_dtype``."""
    m, n = dy.shape
    k = x.shape[1]
    num_experts = counts.numel()
    dw = torch.empty((num_experts, n, k), device=x.device, dtype=out_dtype)
    bm, bn, bk, warps, stages = _blocks(x, wgrad=True)
    offsets = torch.cumsum(counts.to(torch.int64), 0) - counts.to(torch.int64)
    grid = (num_experts, triton.cdiv(n, bn), triton.cdiv(k, bk))
    _grouped_wgrad_kernel[grid](
        dy,
        x,
        dw,
        offsets,
        counts.to(torch.int64),
        n,
        k,
        dy.stride(0),
        dy.stride(1),
        x.stride(0),
        x.stride(1),
        dw.stride(0),
        dw.stride(1),
        dw.stride(2),
        IEEE=x.dtype == torch.float32,
        BM=bm,
        BN=bn,
        BK=bk,
        num_warps=warps,
        num_stages=stages,
    )
    return dw
