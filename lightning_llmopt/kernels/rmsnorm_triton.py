"""Triton RMSNorm (Zhang & Sennrich, arXiv 1910.07467) forward and backward kernels and their launchers.

Forward, ``ROWS`` rows per program, each row read once (or, autotuned as an alternative without a residual, in two
passes over column chunks, the second re-reading the rows from L2, as the compiler's own kernel does):

1. ``r = 1 / sqrt(mean(x^2) + eps)`` in fp32;
2. ``y = round_to_x_dtype(x * r) * w``, stored in the output dtype (which may be narrower than x's: under autocast the
   fp32 residual stream is normalized straight into the bf16 input of the next matmul); ``r`` is saved, 4 bytes a row.

With a residual (``HAS_RES``) the forward first stores ``h = x + r`` (one read of each, one write) and normalizes
``h``; the backward then adds the residual stream's gradient into ``dx`` (``HAS_DRES``): the add costs no pass of
its own either way. The backward can also write ``dx`` a second time in another dtype (``HAS_DX2``): the bf16
gradient of a bf16 branch output beside the fp32 one of an fp32 residual stream, without a separate cast pass.

Backward, a persistent grid of programs that each own a contiguous range of rows:

1. with ``xn = x r`` and ``g = dy * w``: ``dx = r (g - xn * mean(g * xn))``;
2. ``dw`` partial sums ``sum(dy * round(xn))`` over the program's rows stay in registers and are written once per
   program; the host sums the ``(programs, D)`` partials (no atomics, deterministic).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from lightning_llmopt.kernels import precompile
from lightning_llmopt.kernels import shared_memory as smem
from lightning_llmopt.kernels.flash_attention_interp import ensure_interpreted_stdlib
from lightning_llmopt.kernels.fused_common import next_pow2, use_interpreter

ensure_interpreted_stdlib()  # before the kernels below are decorated


@triton.jit
def _rms_fwd_kernel(
    X,
    W,
    Y,
    RSTD,
    R,
    H,
    stride_x,
    stride_y,
    stride_r,
    stride_h,
    n_rows,
    D,
    eps,
    BLOCK_D: tl.constexpr,
    ROWS: tl.constexpr,
    HAS_RES: tl.constexpr,
    IDX64: tl.constexpr,
    STORE_RSTD: tl.constexpr,
    TWO_PASS: tl.constexpr,
    CHUNK: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    rmask = rows < n_rows
    rows64 = rows.to(tl.int64) if IDX64 else rows  # 32-bit offsets where they fit: fewer address instructions
    if TWO_PASS and not HAS_RES:
        # Chunks of CHUNK columns: the first pass sums squares and leaves the rows in L2 (evict-last), the second
        # re-reads them from there (evict-first) to normalize; nothing of a row stays live in registers across the
        # reduction, so more rows are in flight.
        acc = tl.zeros([ROWS, CHUNK], dtype=tl.float32)
        for c0 in tl.range(0, BLOCK_D, CHUNK):
            c = c0 + tl.arange(0, CHUNK)
            m = rmask[:, None] & (c < D)[None, :]
            xc = tl.load(X + rows64[:, None] * stride_x + c[None, :], mask=m, other=0.0, eviction_policy="evict_last")
            xc = xc.to(tl.float32)
            acc += xc * xc
        rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=1) / D + eps)
        for c0 in tl.range(0, BLOCK_D, CHUNK):
            c = c0 + tl.arange(0, CHUNK)
            m = rmask[:, None] & (c < D)[None, :]
            xc = tl.load(X + rows64[:, None] * stride_x + c[None, :], mask=m, other=0.0, eviction_policy="evict_first")
            wc = tl.load(W + c, mask=c < D, other=0.0, eviction_policy="evict_last").to(tl.float32)
            xn = (xc.to(tl.float32) * rstd[:, None]).to(X.dtype.element_ty).to(tl.float32)
            tl.store(Y + rows64[:, None] * stride_y + c[None, :], (xn * wc[None, :]).to(Y.dtype.element_ty), mask=m)
    else:
        cols = tl.arange(0, BLOCK_D)
        cmask = cols < D
        mask = rmask[:, None] & cmask[None, :]
        x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_RES:  # h = x + r, stored in h's dtype, and normalized as stored (the unfused add, then the norm)
            r = tl.load(R + rows64[:, None] * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            h = (x + r).to(H.dtype.element_ty)
            tl.store(H + rows64[:, None] * stride_h + cols[None, :], h, mask=mask)
            x = h.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
        w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
        xn = (x * rstd[:, None]).to(H.dtype.element_ty if HAS_RES else X.dtype.element_ty).to(tl.float32)
        y = (xn * w[None, :]).to(Y.dtype.element_ty)
        tl.store(Y + rows64[:, None] * stride_y + cols[None, :], y, mask=mask)
    if STORE_RSTD:  # only autograd needs it
        tl.store(RSTD + rows, rstd, mask=rmask)


@triton.jit
def _rms_bwd_kernel(
    DY,
    X,
    W,
    RSTD,
    DX,
    DW_PART,
    DRES,
    DX2,
    stride_dy,
    stride_x,
    stride_dx,
    stride_dres,
    stride_dx2,
    n_rows,
    D,
    rows_per_prog,
    BLOCK_D: tl.constexpr,
    ROWS: tl.constexpr,
    HAS_DRES: tl.constexpr,
    HAS_DX2: tl.constexpr,
    IDX64: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_D,), dtype=tl.float32)
    row_start = pid * rows_per_prog
    row_end = tl.minimum(row_start + rows_per_prog, n_rows)
    for r0 in range(row_start, row_end, ROWS):
        rows = r0 + tl.arange(0, ROWS)
        rmask = rows < row_end
        mask = rmask[:, None] & cmask[None, :]
        rows64 = rows.to(tl.int64) if IDX64 else rows
        x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=rmask, other=0.0)
        xn = x * rstd[:, None]
        g = dy * w[None, :]
        c = tl.sum(g * xn, axis=1) / D
        dx = rstd[:, None] * (g - xn * c[:, None])
        if HAS_DRES:  # the gradient reaching the norm's input along the residual stream
            dx += tl.load(DRES + rows64[:, None] * stride_dres + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + rows64[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        if HAS_DX2:  # the same gradient in a second dtype (for an input of another dtype), no extra read
            tl.store(DX2 + rows64[:, None] * stride_dx2 + cols[None, :], dx.to(DX2.dtype.element_ty), mask=mask)
        dw += tl.sum(dy * xn.to(X.dtype.element_ty).to(tl.float32), axis=0)
    tl.store(DW_PART + pid.to(tl.int64) * D + cols, dw, mask=cmask)


def _configs(block_d: int, two_pass: bool = False) -> list[triton.Config]:
    """Rows per program (1-8) x warps (about 4-16 elements a thread for one row), capped at 16k elements a program:
    the fastest pair differs by input dtype (an fp32 residual stream reads twice the bytes of a bf16 one). With
    ``two_pass`` (the forward), also the two-pass form over chunks of up to 1024 columns or whole rows, with the
    settings a sweep on an H100 found fastest for it (benchmarks/sweep_rmsnorm_fwd.py)."""
    warps = max(1, min(16, block_d // 256))
    pairs = [(r, w) for r in (1, 2, 4, 8) for w in (max(1, warps // 2), warps, min(16, 2 * warps))]
    base = [(r, w) for r, w in dict.fromkeys(pairs) if r * block_d <= 16384] or [(1, warps)]
    if not two_pass:
        return [triton.Config({"ROWS": r}, num_warps=w) for r, w in base]
    out = [triton.Config({"ROWS": r, "TWO_PASS": False, "CHUNK": 16}, num_warps=w) for r, w in base]
    chunk = min(1024, block_d)
    chunked = dict.fromkeys([(2, block_d, 16), (2, chunk, 16), (4, block_d, 16), (1, chunk, 8)])
    out += [
        triton.Config({"ROWS": r, "TWO_PASS": True, "CHUNK": c}, num_warps=min(w, max(1, r * c // 256)))
        for r, c, w in chunked
        if r * c <= 16384
    ]
    return out


def smem_bytes(which: str, rows: int, block_d: int, two_pass: bool = False, chunk: int = 16) -> int:
    """Upper estimate (bytes) of an RMSNorm program's shared memory: the row sums reduce across warps and the fp32
    tile may change layout between the reduction and the store, so at most one fp32 tile of the rows
    ``ROWS * width * 4`` (``width``: ``CHUNK`` for the two-pass forward, else ``BLOCK_D``), plus, in the backward, the
    ``dw`` partial sums over the rows ``BLOCK_D * 4``. The loads feed no ``tl.dot``, so none is pipelined through
    shared memory."""
    width = chunk if which == "fwd" and two_pass else block_d
    return rows * width * 4 + (block_d * 4 if which == "bwd" else 0)


@smem.register("_rms_fwd_kernel")
def _estimate_fwd(p: dict) -> int:
    return smem_bytes("fwd", p["ROWS"], p["BLOCK_D"], bool(p["TWO_PASS"]) and not p["HAS_RES"], p["CHUNK"])


@smem.register("_rms_bwd_kernel")
def _estimate_bwd(p: dict) -> int:
    return smem_bytes("bwd", p["ROWS"], p["BLOCK_D"])


def _prune(which: str):  # type: ignore[no-untyped-def]
    def prune(configs, named_args, **kwargs):  # type: ignore[no-untyped-def]
        block_d = kwargs["BLOCK_D"]
        two = which == "fwd" and not kwargs.get("HAS_RES", False)
        device = smem.first_device(named_args)
        return smem.fit(f"rmsnorm {which}", configs,
                        lambda c: smem_bytes(which, c.kwargs["ROWS"], block_d, two and c.kwargs.get("TWO_PASS", False),
                                             c.kwargs.get("CHUNK", 16)),
                        smem.device_limit(device) if device is not None else None,
                        smem.describe([("D", named_args.get("D"))]))

    return prune


_tuned: dict[tuple[str, int], object] = {}


def _tuned_kernel(which: str, block_d: int):  # type: ignore[no-untyped-def]
    key = (which, block_d)
    if key not in _tuned:
        fwd = which == "fwd"
        kernel = _rms_fwd_kernel if fwd else _rms_bwd_kernel
        keys = ["D", "HAS_RES", "STORE_RSTD"] if fwd else ["D"]
        _tuned[key] = precompile.autotune(configs=_configs(block_d, two_pass=fwd), key=keys,
                                      prune_configs_by={"early_config_prune": _prune(which)})(kernel)
    return _tuned[key]


def rms_norm_fwd_launch(
    x: Tensor,
    weight: Tensor,
    eps: float,
    out_dtype: torch.dtype,
    residual: Tensor | None = None,
    store_rstd: bool = True,
) -> tuple[Tensor, Tensor]:
    """``x`` ``(N, D)`` with a contiguous last dim -> ``y`` ``(N, D)`` in ``out_dtype`` and ``rstd`` ``(N,)`` fp32.

    With ``residual`` ``(N, D)``: the norm of ``h = x + residual`` (in the promoted dtype), and ``h`` is returned
    too: ``(y, rstd, h)``. ``store_rstd=False`` (no backward to come): ``rstd`` is left unwritten."""
    n, d = x.shape
    y = torch.empty((n, d), device=x.device, dtype=out_dtype)
    rstd = torch.empty((n,), device=x.device, dtype=torch.float32)
    h = (
        None
        if residual is None
        else torch.empty((n, d), device=x.device, dtype=torch.promote_types(x.dtype, residual.dtype))
    )
    if n == 0:
        return (y, rstd) if h is None else (y, rstd, h)  # type: ignore[return-value]
    block_d = max(16, next_pow2(d))
    r = x if residual is None else residual
    hh = x if h is None else h
    args = (x, weight, y, rstd, r, hh, x.stride(0), y.stride(0), r.stride(0), hh.stride(0), n, d, eps)
    consts = dict(BLOCK_D=block_d, HAS_RES=h is not None, IDX64=_needs_int64(n, x, y, r, hh), STORE_RSTD=store_rstd)
    if use_interpreter(x):
        _rms_fwd_kernel[(triton.cdiv(n, 2),)](*args, ROWS=2, TWO_PASS=False, CHUNK=16, **consts)
    else:
        _tuned_kernel("fwd", block_d)[lambda meta: (triton.cdiv(n, meta["ROWS"]),)](*args, **consts)
    return (y, rstd) if h is None else (y, rstd, h)  # type: ignore[return-value]


def _needs_int64(n: int, *ts: Tensor) -> bool:
    """Whether an element offset ``row * stride + col`` can pass 2**31 - 1 in any of ``ts`` (``(n, D)`` views)."""
    return any(n * t.stride(0) + t.shape[-1] >= 2**31 - 1 for t in ts)


def _num_programs(x: Tensor, n: int) -> int:
    if use_interpreter(x):
        return min(n, 3)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    return max(1, min(n, 4 * sms))


def rms_norm_bwd_launch(
    dy: Tensor,
    x: Tensor,
    weight: Tensor,
    rstd: Tensor,
    dres: Tensor | None = None,
    dx2_dtype: torch.dtype | None = None,
) -> tuple[Tensor, ...]:
    """Gradients ``dx`` (like ``x``) and ``dw`` (like ``weight``) from ``dy`` ``(N, D)``; ``dres`` ``(N, D)``, the
    gradient ``x`` gets from elsewhere (the residual stream), is added into ``dx``. With ``dx2_dtype``, also ``dx``
    in that dtype, written by the same pass: ``(dx, dw, dx2)``."""
    n, d = x.shape
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    dx2 = None if dx2_dtype is None else torch.empty((n, d), device=x.device, dtype=dx2_dtype)
    if n == 0:
        return (dx, torch.zeros_like(weight)) if dx2 is None else (dx, torch.zeros_like(weight), dx2)
    block_d = max(16, next_pow2(d))
    progs = _num_programs(x, n)
    rows_per_prog = triton.cdiv(n, progs)
    progs = triton.cdiv(n, rows_per_prog)
    parts = torch.empty((progs, d), device=x.device, dtype=torch.float32)
    dr = dy if dres is None else dres
    d2 = dx if dx2 is None else dx2
    args = (
        dy,
        x,
        weight,
        rstd,
        dx,
        parts,
        dr,
        d2,
        dy.stride(0),
        x.stride(0),
        dx.stride(0),
        dr.stride(0),
        d2.stride(0),
        n,
        d,
    )
    consts = dict(
        BLOCK_D=block_d, HAS_DRES=dres is not None, HAS_DX2=dx2 is not None, IDX64=_needs_int64(n, dy, x, dx, dr, d2)
    )
    if use_interpreter(x):
        _rms_bwd_kernel[(progs,)](*args, rows_per_prog, ROWS=2, **consts)
    else:
        _tuned_kernel("bwd", block_d)[(progs,)](*args, rows_per_prog, **consts)
    dw = parts.sum(0).to(weight.dtype)
    return (dx, dw) if dx2 is None else (dx, dw, dx2)


__all__ = ["rms_norm_bwd_launch", "rms_norm_fwd_launch"]
