"""Diagnostic, no record: RMSNorm forward launch choices against ``torch.compile`` on one GPU.

The fused-rmsnorm record has our forward 1-1.5% behind the compiled reference for an fp32 residual stream normalized
into bf16 (65536 x 2048), and level with it for bf16 -> bf16 (32768 x 4096). This sweeps, for both shapes:

- ``grid``: the library kernel over rows per program x warps (the autotuner's space, and more);
- ``variant``: the same algorithm with ``D`` a compile-time constant (no column mask), with and without the row mask,
  the ``1/rms`` store and ``rsqrt`` (an evict-first load of x was tried too, 2026-11-22: no faster);
- ``persist``: a persistent kernel looping over row blocks (weight loaded once per program, software-pipelined);
- ``looped``: the compiler's own algorithm for this op (read from its generated code on the H100): rows in chunks,
  a first pass summing squares with the row kept in L2 (evict-last), a second re-reading it (evict-first).

H100, 2026-11-22, fp32 -> bf16: the compiled reference 265 us; best ``looped`` 266.1 us (0.996x: 2 rows, whole-row
chunks, 16 warps), best ``variant`` 0.990-0.994x, the library kernel 0.988-0.991x. bf16 -> bf16: all at 1.49x the
compiled reference as this script compiles it (the record's peer, compiled from the benchmark's closure, is faster).

    python benchmarks/sweep_rmsnorm_fwd.py
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

from lightning_llmopt.kernels.fused_ref import rms_norm_ref
from lightning_llmopt.kernels.rmsnorm_triton import _rms_fwd_kernel


@triton.jit
def _variant(X, W, Y, RSTD, n_rows, eps, D: tl.constexpr, ROWS: tl.constexpr, ROW_MASK: tl.constexpr,
             STORE_RSTD: tl.constexpr, RSQRT: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, D)
    offs = rows[:, None] * D + cols[None, :]
    if ROW_MASK:
        x = tl.load(X + offs, mask=(rows < n_rows)[:, None], other=0.0).to(tl.float32)
    else:
        x = tl.load(X + offs).to(tl.float32)
    ms = tl.sum(x * x, axis=1) / D + eps
    rstd = tl.rsqrt(ms) if RSQRT else 1.0 / tl.sqrt(ms)
    w = tl.load(W + cols).to(tl.float32)
    y = ((x * rstd[:, None]).to(X.dtype.element_ty).to(tl.float32) * w[None, :]).to(Y.dtype.element_ty)
    if ROW_MASK:
        tl.store(Y + offs, y, mask=(rows < n_rows)[:, None])
    else:
        tl.store(Y + offs, y)
    if STORE_RSTD:
        tl.store(RSTD + rows, rstd, mask=rows < n_rows)


@triton.jit
def _persist(X, W, Y, RSTD, n_rows, eps, D: tl.constexpr, ROWS: tl.constexpr, STAGES: tl.constexpr):
    cols = tl.arange(0, D)
    w = tl.load(W + cols).to(tl.float32)
    for blk in tl.range(tl.program_id(0), tl.cdiv(n_rows, ROWS), tl.num_programs(0), num_stages=STAGES):
        rows = blk * ROWS + tl.arange(0, ROWS)
        mask = (rows < n_rows)[:, None]
        offs = rows[:, None] * D + cols[None, :]
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
        xn = (x * rstd[:, None]).to(X.dtype.element_ty).to(tl.float32)
        tl.store(Y + offs, (xn * w[None, :]).to(Y.dtype.element_ty), mask=mask)
        tl.store(RSTD + rows, rstd, mask=rows < n_rows)


@triton.jit
def _looped(X, W, Y, RSTD, n_rows, eps, D: tl.constexpr, XB: tl.constexpr, RB: tl.constexpr):
    rows = tl.program_id(0) * XB + tl.arange(0, XB)[:, None]
    rmask = rows < n_rows
    acc = tl.zeros([XB, RB], dtype=tl.float32)
    for c0 in tl.range(0, D, RB):
        cols = c0 + tl.arange(0, RB)[None, :]
        x = tl.load(X + rows * D + cols, mask=rmask, other=0.0, eviction_policy="evict_last").to(tl.float32)
        acc += x * x
    rstd = 1.0 / tl.sqrt(tl.sum(acc, 1)[:, None] / D + eps)
    for c0 in tl.range(0, D, RB):
        cols = c0 + tl.arange(0, RB)[None, :]
        x = tl.load(X + rows * D + cols, mask=rmask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        w = tl.load(W + cols, eviction_policy="evict_last").to(tl.float32)
        y = ((x * rstd).to(X.dtype.element_ty).to(tl.float32) * w).to(Y.dtype.element_ty)
        tl.store(Y + rows * D + cols, y, mask=rmask)
    tl.store(RSTD + rows, rstd, mask=rmask)


def _ms(fn: Callable[[], object]) -> float:
    return do_bench(fn, warmup=50, rep=300, return_mode="median")


def _launch(kernel, grid: tuple[int, ...], args: tuple, kw: dict) -> float:  # type: ignore[no-untyped-def]
    return _ms(lambda: kernel[grid](*args, **kw))


def sweep(n: int, d: int, dtype: torch.dtype, sms: int, top: int = 12) -> None:
    x = torch.randn(n, d, device="cuda", dtype=dtype)
    w = torch.randn(d, device="cuda", dtype=dtype) * 0.1 + 1
    y = torch.empty(n, d, device="cuda", dtype=torch.bfloat16)
    rstd = torch.empty(n, device="cuda", dtype=torch.float32)
    compiled = torch.compile(lambda a, b: rms_norm_ref(a, b, 1e-5, out_dtype=torch.bfloat16))
    with torch.no_grad():
        t_compile = _ms(lambda: compiled(x, w))
    print(f"{n}x{d} {dtype}: torch.compile {t_compile * 1e3:.1f} us")
    rows_warps = [(r, wp) for r in (1, 2, 4, 8) for wp in (2, 4, 8, 16) if r * d <= 16384]
    timed: list[tuple[float, str]] = []
    for r, wp in rows_warps:
        args = (x, w, y, rstd, x, x, x.stride(0), y.stride(0), x.stride(0), x.stride(0), n, d, 1e-5)
        kw = dict(BLOCK_D=d, ROWS=r, HAS_RES=False, IDX64=False, STORE_RSTD=True, TWO_PASS=False, CHUNK=16,
                  num_warps=wp)
        timed.append((_launch(_rms_fwd_kernel, (triton.cdiv(n, r),), args, kw), f"grid rows={r} warps={wp}"))
        for row_mask in (0, 1):
            for store in (0, 1):
                for rsq in (0, 1):
                    kw = dict(D=d, ROWS=r, ROW_MASK=row_mask, STORE_RSTD=store, RSQRT=rsq, num_warps=wp)
                    t = _launch(_variant, (triton.cdiv(n, r),), (x, w, y, rstd, n, 1e-5), kw)
                    timed.append((t, f"variant rows={r} warps={wp} row_mask={row_mask} store_rstd={store} "
                                     f"rsqrt={rsq}"))
        for stages in (1, 3):
            for mult in (2, 8):
                g = min(sms * mult, triton.cdiv(n, r))
                kw = dict(D=d, ROWS=r, STAGES=stages, num_warps=wp)
                t = _launch(_persist, (g,), (x, w, y, rstd, n, 1e-5), kw)
                timed.append((t, f"persist rows={r} warps={wp} stages={stages} programs={g}"))
    for xb in (1, 2, 4, 8):
        for rb in (256, 512, 1024, 2048):
            for wp in (2, 4, 8, 16):
                if xb * rb > 8192 or rb > d:
                    continue
                kw = dict(D=d, XB=xb, RB=rb, num_warps=wp)
                t = _launch(_looped, (triton.cdiv(n, xb),), (x, w, y, rstd, n, 1e-5), kw)
                timed.append((t, f"looped rows={xb} chunk={rb} warps={wp}"))
    for t, name in sorted(timed)[:top]:
        print(f"  {t * 1e3:7.1f} us  {t_compile / t:.3f}x compile  {name}")


def main() -> None:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for n, d, dtype in ((65536, 2048, torch.float32), (32768, 4096, torch.bfloat16)):
        sweep(n, d, dtype, sms)


if __name__ == "__main__":
    main()
