"""Triton weight-only quantized matmul ``y = x @ dequant(W)^T`` (int8 and int4 codes): kernels and launcher.

Two kernels, chosen per shape by :mod:`~lightning_llmopt.kernels.quant_matmul_tune`:

- ``_qmm_kernel`` (tensor cores): one program owns a ``BLOCK_M x BLOCK_N`` output tile and a slice of ``K``;
  per ``BLOCK_K`` step it loads the code tile (int8 ``(BLOCK_N, BLOCK_K)`` bytes; int4 ``(BLOCK_N, BLOCK_K / 2)``
  bytes, low nibble = even input column, high nibble = odd, :mod:`lightning_llmopt.kernels.quant_packing`) and the
  activations, and adds ``x @ (q - z)^T * scale`` to an fp32 accumulator. int4 nibble planes are not interleaved
  back: the activations are loaded as their even and odd columns instead (``x`` is tiny) and the tile is two
  ``tl.dot`` of ``BLOCK_K / 2``. Batch 1 runs a 16-row dot with 15 masked rows.
- ``_qmv_kernel`` (batch 1, no tensor cores): one program owns ``BLOCK_N`` outputs and a slice of ``K``; codes are
  dequantized to fp32, multiplied by ``x`` and accumulated element-wise in a 2-D fp32 tile that is reduced once at
  the end, so there are no shared-memory operand shuffles and no reductions inside the loop.
- ``_qmv_words_kernel`` (batch 1, the tuner's usual pick there): the same element-wise scheme over the codes'
  int32 words, ``BLOCK_N x BLOCK_W`` words per step (8 int4 or 4 int8 codes each); code ``j`` of every word
  becomes the fp32 ``OFFSET + q`` with one shift and one mask-or (``_word_code``) or, in fp16/bf16 on a GPU, with
  one ``prmt`` of inline PTX (``_word_nibbles_asm``, ``_word_bytes_asm``), is multiplied by the ``j``-th column of
  ``x`` and summed, in a chain that starts from ``-(OFFSET + z) * sum(x)``. Each thread holds whole words (one
  per row of its rows) and loads the activations of its words as one ``(BLOCK_W, 8 or 4)`` row of contiguous
  bytes, split into columns in registers, so no activation passes through shared memory. Tiles may span
  quantization groups (scales then load per word), so ``BLOCK_K`` can be larger than the group and each program
  streams long rows. ``wide`` launches load int64 elements of two words (half the load and scale instructions,
  one chain of 16 int4 codes per element), optionally with the codes loaded evict-first and the row strides
  compiled in (the tuner's pick for int4 at batch 1 on an H100). Launched as a programmatic dependent, it loads
  its first tile's codes and scales (the layer's own, written by no kernel) before waiting for the kernel before
  it, and only the activations after.

Codes become floats with exact bit tricks rather than integer-to-float conversions (a quarter of the ALU rate on
Hopper): ``0x4B000000 | q`` is the fp32 ``2**23 + q``, and subtracting ``2**23 + z`` leaves ``q - z`` exactly; in
bf16 the upper 16 bits of that small integer are its exact bf16 (the ``CENTER`` path). fp16 uses ``0x6400 | q`` =
``1024 + q``; symmetric int4 in bf16 can also use two ``prmt`` and one ``fma.rn.bf16x2`` of inline PTX per four
weights (``ASM``). Alternatively (``CENTER = False``) the offset codes ``0x4300 | q`` (bf16 ``128 + q``, 4-bit codes) or
``1024 + q`` (fp16) enter the dot directly and ``(OFFSET + z) * sum(x)`` is subtracted per tile. The group scale
multiplies the fp32 partial sum once per group (``BLOCK_K`` divides the group size), per-channel scales once after
the loop. Split-K programs (``grid[1]``) of the tensor-core and word kernels write fp32 partials to their own slices
of a scratch buffer and the last program of each tile to finish sums them and writes the output (no zeroed buffer,
no conversion kernel, deterministic order); the GEMV kernel's add into an fp32 buffer with atomics.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Literal, overload

import torch
import triton
import triton.language as tl
from torch import Tensor

from lightning_llmopt.kernels.flash_attention_interp import ensure_interpreted_stdlib
from lightning_llmopt.kernels.pdl import gdc_launch_dependents, gdc_wait, launch_kwargs, pdl_enabled
from lightning_llmopt.kernels.quant_matmul_gemv import _qmv_kernel, _qmv_words_kernel
from lightning_llmopt.kernels.quant_matmul_tiles import _MODES, _OFFSETS, _load_tile, _split_fixup, _tile_part

ensure_interpreted_stdlib()  # before the kernels below are decorated


@triton.jit(do_not_specialize=["M"])
def _qmm_kernel(
    X, W, S, Z, Y, P, C,
    M, N, K, K_SPLIT,
    stride_xm, stride_wn, stride_sn, stride_ym,
    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, FIXUP: tl.constexpr, MODE: tl.constexpr,
    OFFSET: tl.constexpr, CENTER: tl.constexpr, ASM: tl.constexpr, IEEE: tl.constexpr, SWAP: tl.constexpr,
    PREFETCH: tl.constexpr, X_SPLIT: tl.constexpr, WIDEN: tl.constexpr, PDL: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # fmt: on
    if PDL:  # a programmatic dependent (kernels.pdl): nothing is read or written before the wait
        gdc_wait()
    pid_mn = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid_mn // num_n
    pid_n = pid_mn % num_n
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_rows = X + offs_m[:, None].to(tl.int64) * stride_xm
    w_rows = W + offs_n[:, None].to(tl.int64) * stride_wn
    s_rows = offs_n.to(tl.int64) * stride_sn
    k_start = pid_k * K_SPLIT
    k_end = tl.minimum(k_start + K_SPLIT, K)
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    z = tl.full((BLOCK_N,), 1 << (BITS - 1), tl.int32)  # symmetric zero point
    if GROUP == 0:
        if HAS_ZERO:
            z = tl.load(Z + s_rows, mask=n_mask, other=0).to(tl.int32)
    if PREFETCH:
        xa, xb, b = _load_tile(x_rows, w_rows, m_mask, n_mask, k_start, k_end, K, BITS, X_SPLIT, WIDEN, BLOCK_K)
    for k0 in range(k_start, k_end, BLOCK_K):
        if PREFETCH:  # the next tile's loads are in flight while this one is computed
            xa_next, xb_next, b_next = _load_tile(
                x_rows, w_rows, m_mask, n_mask, k0 + BLOCK_K, k_end, K, BITS, X_SPLIT, WIDEN, BLOCK_K
            )
        else:
            xa, xb, b = _load_tile(x_rows, w_rows, m_mask, n_mask, k0, k_end, K, BITS, X_SPLIT, WIDEN, BLOCK_K)
        if GROUP != 0:
            g = k0 // GROUP
            s = tl.load(S + s_rows + g, mask=n_mask, other=0.0).to(tl.float32)
            if HAS_ZERO:
                z = tl.load(Z + s_rows + g, mask=n_mask, other=0).to(tl.int32)
        part = _tile_part(xa, xb, b, z, BITS, MODE, OFFSET, CENTER, ASM, IEEE, SWAP, WIDEN, BLOCK_M, BLOCK_N)
        if GROUP == 0:
            acc += part
        else:
            acc += part * (s[:, None] if SWAP else s[None, :])
        if PREFETCH:
            xa, xb, b = xa_next, xb_next, b_next
    if PDL:
        # the next kernel may be scheduled once every program is past its main loop: signalled at the start, the
        # dependents' programs took SM resources from this kernel's later waves (batch 16 on an H100, 2026-11-26:
        # int8 4096 x 4096 from 11.5 to 24.6 us)
        gdc_launch_dependents()
    if GROUP == 0:
        s = tl.load(S + s_rows, mask=n_mask, other=0.0).to(tl.float32)
        acc = acc * (s[:, None] if SWAP else s[None, :])
    if SWAP:
        y_ptrs = Y + offs_m[None, :].to(tl.int64) * stride_ym + offs_n[:, None]
        p_ptrs = P + offs_m[None, :].to(tl.int64) * N + offs_n[:, None]
        mask = m_mask[None, :] & n_mask[:, None]
    else:
        y_ptrs = Y + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
        p_ptrs = P + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
        mask = m_mask[:, None] & n_mask[None, :]
    if FIXUP:
        _split_fixup(acc, Y, y_ptrs, p_ptrs, M.to(tl.int64) * N, mask, C + pid_mn)
    else:
        tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=mask)


# fmt: off


_COUNTERS: dict[tuple, Tensor] = {}


def _split_counters(device: torch.device, tiles: int) -> Tensor:
    """Zeroed int32 arrival counters for :func:`_split_fixup`, one buffer per device and stream (kernels on one
    stream run in order, and each leaves its counters at zero). A CUDA graph keeps the buffer of the stream it was
    captured on: graphs captured on one stream must not be replayed concurrently on different streams."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device, stream)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < tiles:
        buf = _COUNTERS[key] = torch.zeros(max(tiles, 1 << 12), dtype=torch.int32, device=device)
    return buf


def _counters(device: torch.device, tiles: int, compile_only: bool) -> Tensor:
    """:func:`_split_counters`, or a new unzeroed buffer of its dtype for a compile-only call."""
    if compile_only:
        return torch.empty(max(tiles, 1 << 12), dtype=torch.int32, device=device)
    return _split_counters(device, tiles)


@dataclass(frozen=True)
class KernelConfig:
    """A launch configuration.

    Arguments:
        kind: ``"mma"`` (tensor cores, any batch), ``"mma_t"`` (the same computing ``y^T = W x^T``: weights as
            the left operand, small batches), ``"gemv"`` or ``"words"`` (batch 1).
        block_m, block_n, block_k: tile sizes (``block_m`` unused by the batch-1 kernels); ``block_k`` divides the
            group, except for ``"words"``, whose tiles may span groups.
        split_k: programs sharing an output tile along ``K`` (when > 1: the last one sums the others' partials;
            fp32 atomics for ``"gemv"``).
        num_warps, num_stages: Triton launch options.
        center: ``"mma"`` only: subtract zero points per weight (exact) instead of ``(OFFSET + z) * sum(x)`` per tile.
        asm: ``"mma"``/``"mma_t"``: GPU only, symmetric 4-bit codes with bf16 activations: inline-PTX
            dequantization; ``"words"``: fp16/bf16 on a GPU, ``prmt`` unpacking.
        prefetch: ``"mma"``/``"mma_t"``/``"words"``: load the next K tile before computing the current one
            (register double-buffering, for latency-bound small batches; ``"words"``: codes, scales and
            activations).
        x_split: ``"mma"``/``"mma_t"`` with 4-bit codes: reorder ``x`` to its even then odd columns first (one small
            copy) so the kernel's activation loads are contiguous and pipelined.
        widen: ``"mma"``/``"mma_t"`` with 4-bit codes: interleave the two nibble planes back into column order in
            registers and take one full-width product per tile (``x`` loaded as is; ``x_split`` is then ignored).
        wide: ``"words"``: load the codes as int64 elements of two words (half the load instructions; rows of a
            whole number of int64).
        evict: ``"words"``: load the codes with the ``evict_first`` cache policy (they are read once).
        fixed_strides: ``"words"``: compile the row strides of the codes and scales in as constants (one kernel per
            ``K``), so a program's rows are immediate offsets from one address per step.
    """

    kind: str = "mma"
    block_m: int = 16
    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    center: bool = True
    asm: bool = False
    prefetch: bool = False
    x_split: bool = False
    widen: bool = False
    wide: bool = False
    evict: bool = False
    fixed_strides: bool = False


def _kernel_call(kernel: Any, grid: tuple, compile_only: bool) -> Any:
    """``kernel[grid]``, or with ``compile_only`` its compile-only form (``warmup``: compiled, not launched)."""
    return functools.partial(kernel.warmup, grid=grid) if compile_only else kernel[grid]


@overload
def launch(x: Tensor, w: Tensor, scales: Tensor, zeros: Tensor | None, bits: int, group: int,
           cfg: KernelConfig, compile_only: Literal[False] = False) -> Tensor: ...


@overload
def launch(x: Tensor, w: Tensor, scales: Tensor, zeros: Tensor | None, bits: int, group: int,
           cfg: KernelConfig, compile_only: Literal[True]) -> None: ...


def launch(x: Tensor, w: Tensor, scales: Tensor, zeros: Tensor | None, bits: int, group: int,
           cfg: KernelConfig, compile_only: bool = False) -> Tensor | None:
    """Run one configuration. ``x`` ``(M, K)``; ``w`` uint8 codes ``(N, K * bits / 8)``; ``scales``/``zeros``
    ``(N, K / G)`` (``group`` = ``G``, 0 for per-channel). Returns ``(M, N)`` in ``x.dtype``.

    ``compile_only``: compile the kernel this call would launch and return ``None`` (nothing launched, no shared
    scratch touched; :func:`~lightning_llmopt.kernels.precompile.compile_all` runs these on threads)."""
    m, k = x.shape
    n = w.shape[0]
    k_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    splits = triton.cdiv(k, k_split)
    atomic = splits > 1 and cfg.kind == "gemv"  # fp32 atomics into a zeroed buffer
    fixup = splits > 1 and not atomic  # partial slices, summed by the tile's last program (_split_fixup)
    if compile_only:  # buffers of the launch's dtypes and layouts, allocated only (no kernel, no shared counters)
        y = x.new_empty((m, n), dtype=torch.float32 if atomic else x.dtype)
    else:
        y = torch.zeros((m, n), device=x.device, dtype=torch.float32) if atomic else x.new_empty((m, n))
    partials = torch.empty((splits, m, n), device=x.device, dtype=torch.float32) if fixup else y
    z_arg = zeros if zeros is not None else scales
    pdl = pdl_enabled(x.device)  # the words and tensor-core kernels launch as programmatic dependents on Hopper
    if cfg.asm and cfg.kind != "words" and (bits != 4 or zeros is not None or x.dtype != torch.bfloat16
                                            or x.device.type != "cuda"):
        raise ValueError("the inline-PTX path takes symmetric 4-bit codes and bf16 activations on a GPU")
    if cfg.kind == "words":
        cpw = 32 // bits
        cpe = cpw * 2 if cfg.wide else cpw  # codes per loaded element (an int32 word, or an int64 of two)
        row_bytes = cpe * bits // 8
        whole = w.stride(1) == 1 and w.shape[1] % row_bytes == 0 and w.stride(0) % row_bytes == 0
        if m != 1 or k % cpe or cfg.block_k % cpe or not whole:
            raise ValueError(f"the words kernel takes one row and whole {8 * row_bytes}-bit elements, got M={m}, K={k}")
        if cfg.asm and (x.dtype == torch.float32 or x.device.type != "cuda"):
            raise ValueError("the words kernel's inline-PTX path takes fp16/bf16 activations on a GPU")
        if group and (group % cpe or (group % cfg.block_k and cfg.block_k % group)):
            raise ValueError(f"the words kernel's tiles must start groups: group {group}, BLOCK_K {cfg.block_k}")
        words = w.view(torch.int64 if cfg.wide else torch.int32)
        # unmasked loads where every tile is whole: 4 bits only (int8 ran 2-5% slower without the masks on an
        # H100, int4 up to 12% faster, same-process comparison 2026-11-26)
        even = bits == 4 and n % cfg.block_n == 0 and k % cfg.block_k == 0
        # one K slice whose length is not a multiple of the tile (4096x11008: 5 tiles of 2048 codes and 768 more):
        # whole tiles and one masked tile of the rest (``REM_W`` elements), if the tiles start groups
        rem = k % cfg.block_k if splits == 1 and k > cfg.block_k and (group == 0 or cfg.block_k % group == 0) else 0
        rem_w = triton.next_power_of_2(rem // cpe) if rem and bits == 4 and n % cfg.block_n == 0 else 0
        even = even or rem_w > 0
        # fmt: off
        tiles = triton.cdiv(n, cfg.block_n)
        counters = _counters(x.device, tiles, compile_only) if fixup else y
        _kernel_call(_qmv_words_kernel, (tiles, splits), compile_only)(
            x, words, scales, z_arg, y, partials, counters, n, k, k_split, words.stride(0), scales.stride(0),
            BITS=bits, GROUP=group, HAS_ZERO=zeros is not None, FIXUP=fixup,
            TILE_SCALE=group > 0 and group % cfg.block_k == 0, EXACT=x.dtype == torch.float32, ASM=cfg.asm,
            PREFETCH=cfg.prefetch, EVEN=even, PDL=pdl, WIDE=cfg.wide, EVICT=cfg.evict,
            ROW_W=words.stride(0) if cfg.fixed_strides else 0, ROW_S=scales.stride(0) if cfg.fixed_strides else 0,
            BLOCK_N=cfg.block_n, BLOCK_W=cfg.block_k // cpe, REM_W=rem_w,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_kwargs(pdl),
        )
        # fmt: on
    elif cfg.kind == "gemv":
        if m != 1:
            raise ValueError(f"the gemv kernel takes one row, got M={m}")
        # fmt: off
        _kernel_call(_qmv_kernel, (triton.cdiv(n, cfg.block_n), splits), compile_only)(
            x, w, scales, z_arg, y, n, k, k_split, w.stride(0), scales.stride(0),
            BITS=bits, GROUP=group, HAS_ZERO=zeros is not None, ATOMIC=atomic,
            BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    elif cfg.kind in ("mma", "mma_t"):
        mode = _MODES[x.dtype]
        if bits == 4 and cfg.block_k < 32:  # half tiles of 8 columns: below the tensor cores' K (wrong on a GPU)
            raise ValueError(f"4-bit tensor-core tiles need BLOCK_K >= 32, got {cfg.block_k}")
        widen = bits == 4 and cfg.widen
        x_split = bits == 4 and cfg.x_split and not widen
        if x_split:  # even columns then odd ones: contiguous activation tiles for the two nibble planes
            x = x.new_empty((m, k)) if compile_only else x.unflatten(1, (k // 2, 2)).transpose(1, 2).reshape(m, k)
        tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
        counters = _counters(x.device, tiles, compile_only) if fixup else y
        _kernel_call(_qmm_kernel, (tiles, splits), compile_only)(
            x, w, scales, z_arg, y, partials, counters, m, n, k, k_split, x.stride(0), w.stride(0), scales.stride(0),
            y.stride(0),
            BITS=bits, GROUP=group, HAS_ZERO=zeros is not None, FIXUP=fixup, MODE=mode, OFFSET=_OFFSETS[mode],
            CENTER=cfg.center, ASM=cfg.asm, IEEE=mode == 0, SWAP=cfg.kind == "mma_t", PREFETCH=cfg.prefetch,
            X_SPLIT=x_split, WIDEN=widen, PDL=pdl, BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            **launch_kwargs(pdl),
        )
        # fmt: on
    else:
        raise ValueError(f"unknown kernel kind {cfg.kind!r}: one of 'mma', 'mma_t', 'gemv', 'words'")
    if compile_only:
        return None
    return y.to(x.dtype) if atomic else y


__all__ = ["KernelConfig", "launch"]
