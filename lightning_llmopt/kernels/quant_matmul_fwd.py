"""Triton weight-only quantized matmul ``y = x @ dequant(W)^T`` (int8 and int4 codes): kernels and launcher.

Two kernels, chosen per shape by :mod:`~lightning_llmopt.kernels.quant_matmul_tune`:

- ``_qmm_kernel`` (tensor cores): one program owns a ``BLOCK_M x BLOCK_N`` output tile and a slice of ``K``;
  per ``BLOCK_K`` step it loads the code tile (int8 ``(BLOCK_N, BLOCK_K)`` bytes; int4 ``(BLOCK_N, BLOCK_K / 2)``
  bytes, low nibble = even input column, high nibble = odd, :mod:`lightning_llmopt.quantization.packing`) and the
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
  ``x`` and summed; ``(OFFSET + z) * sum(x)`` is subtracted once per tile. Tiles may span quantization groups
  (scales then load per word), so ``BLOCK_K`` can be larger than the group and each program streams long rows.

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

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from lightning_llmopt.kernels.flash_attention_interp import ensure_interpreted_stdlib

ensure_interpreted_stdlib()  # before the kernels below are decorated

_MODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_OFFSETS = {0: 0, 1: 1024, 2: 128}  # what _offset_codes adds to a code in each mode


@triton.jit
def _offset_codes(q, MODE: tl.constexpr):
    """``OFFSET + q`` exactly in the dot dtype by OR-ing the code into a float's mantissa (no conversion):
    fp16 ``0x6400 | q`` is ``1024 + q`` (q < 1024); bf16 ``0x4300 | q`` is ``128 + q`` (q < 128); fp32 ``q``."""
    if MODE == 0:
        return q.to(tl.float32)
    elif MODE == 1:
        return (q.to(tl.uint16) | 0x6400).to(tl.uint16).to(tl.float16, bitcast=True)
    else:
        return (q.to(tl.uint16) | 0x4300).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _centered_f32(q, z):
    """``q - z`` in fp32, exactly: ``0x4B000000 | q`` is ``2**23 + q``; ``z`` int32, broadcastable."""
    f = (q.to(tl.uint32) | 0x4B000000).to(tl.uint32).to(tl.float32, bitcast=True)
    return f - (z + 8388608).to(tl.float32)


@triton.jit
def _centered(q, z, MODE: tl.constexpr):
    """``q - z`` exactly in the dot dtype (bf16: the upper half of the exact fp32 small integer)."""
    if MODE == 0:
        return (q.to(tl.int32) - z).to(tl.float32)
    elif MODE == 1:
        return _offset_codes(q, 1) - (z + 1024).to(tl.float16)
    else:
        f = _centered_f32(q, z)
        return (f.to(tl.uint32, bitcast=True) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _nibbles_bf16_asm(b, HIGH: tl.constexpr):
    """Symmetric 4-bit codes to centered bf16 with inline PTX (GPU only): per 32-bit register of 4 code bytes,
    ``prmt`` builds ``(0x43 << 8) | q`` pairs (bf16 ``128 + q``) and one ``fma.rn.bf16x2`` subtracts 136, i.e.
    ``q - 8``: about 1.25 instructions per weight (Marlin's trick). ``HIGH`` takes the high nibbles."""
    if HIGH:
        return tl.inline_asm_elementwise(
            "{ .reg .b32 t, hi, one, off; mov.b32 hi, 0x43434343; mov.b32 one, 0x3F803F80; mov.b32 off, 0xC308C308; "
            "shr.b32 t, $2, 4; and.b32 t, t, 0x0F0F0F0F; prmt.b32 $0, t, hi, 0x4140; prmt.b32 $1, t, hi, 0x4342; "
            "fma.rn.bf16x2 $0, $0, one, off; fma.rn.bf16x2 $1, $1, one, off; }",
            "=r,=r,r", [b], dtype=tl.bfloat16, is_pure=True, pack=4,
        )  # fmt: skip
    return tl.inline_asm_elementwise(
        "{ .reg .b32 t, hi, one, off; mov.b32 hi, 0x43434343; mov.b32 one, 0x3F803F80; mov.b32 off, 0xC308C308; "
        "and.b32 t, $2, 0x0F0F0F0F; prmt.b32 $0, t, hi, 0x4140; prmt.b32 $1, t, hi, 0x4342; "
        "fma.rn.bf16x2 $0, $0, one, off; fma.rn.bf16x2 $1, $1, one, off; }",
        "=r,=r,r", [b], dtype=tl.bfloat16, is_pure=True, pack=4,
    )  # fmt: skip


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr, SWAP: tl.constexpr):
    """``acc + a @ b^T`` (``a`` activations, ``b`` weights); ``SWAP``: ``acc + b @ a^T`` (the transposed output,
    weights as the left operand, which Hopper's wgmma can read from registers)."""
    if SWAP:
        lhs, rhs = b, tl.trans(a)
    else:
        lhs, rhs = a, tl.trans(b)
    if IEEE:
        return tl.dot(lhs, rhs, acc, input_precision="ieee")
    return tl.dot(lhs, rhs, acc)


@triton.jit
def _outer(x_vec, n_vec, SWAP: tl.constexpr):
    """The ``(BLOCK_M, BLOCK_N)`` outer product of a per-row and a per-output vector (transposed if ``SWAP``)."""
    if SWAP:
        return n_vec[:, None] * x_vec[None, :]
    return x_vec[:, None] * n_vec[None, :]


@triton.jit
def _load_tile(
    x_rows, w_rows, m_mask, n_mask, k0, k_end, K, BITS: tl.constexpr, X_SPLIT: tl.constexpr, BLOCK_K: tl.constexpr
):
    """One K tile's operands, masked to ``[k0, k_end)``: 4 bits: the even and odd input columns of ``x`` and the
    code bytes ``(BLOCK_N, BLOCK_K / 2)``; 8 bits: ``x`` twice and the codes ``(BLOCK_N, BLOCK_K)``. ``X_SPLIT``
    (4 bits): ``x`` rows hold their even columns then their odd ones, so both loads are contiguous (and the
    compiler's pipeliner can turn them into asynchronous copies)."""
    if BITS == 4:
        if X_SPLIT:
            offs_h = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            x_mask = m_mask[:, None] & (offs_h[None, :] < k_end // 2)
            xa = tl.load(x_rows + offs_h[None, :], mask=x_mask, other=0.0)
            xb = tl.load(x_rows + K // 2 + offs_h[None, :], mask=x_mask, other=0.0)
        else:
            offs_e = k0 + 2 * tl.arange(0, BLOCK_K // 2)  # even input columns of the tile
            x_mask = m_mask[:, None] & (offs_e[None, :] < k_end)
            xa = tl.load(x_rows + offs_e[None, :], mask=x_mask, other=0.0)
            xb = tl.load(x_rows + offs_e[None, :] + 1, mask=x_mask, other=0.0)
        offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        b = tl.load(w_rows + offs_b[None, :], mask=n_mask[:, None] & (offs_b[None, :] < k_end // 2), other=0)
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        xa = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & (offs_k[None, :] < k_end), other=0.0)
        xb = xa
        b = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & (offs_k[None, :] < k_end), other=0)
    return xa, xb, b


@triton.jit
def _tile_part(
    xa,
    xb,
    b,
    z,
    BITS: tl.constexpr,
    MODE: tl.constexpr,
    OFFSET: tl.constexpr,
    CENTER: tl.constexpr,
    ASM: tl.constexpr,
    IEEE: tl.constexpr,
    SWAP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """``x[:, tile] @ (q - z)[:, tile]^T`` in fp32 for one K tile of :func:`_load_tile` (its transpose if
    ``SWAP``); ``z`` int32 ``(BLOCK_N,)``."""
    if SWAP:
        part = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if BITS == 4:
        if ASM:
            part = _dot(xa, _nibbles_bf16_asm(b, False), part, IEEE, SWAP)
            part = _dot(xb, _nibbles_bf16_asm(b, True), part, IEEE, SWAP)
        elif CENTER:
            part = _dot(xa, _centered(b & 0xF, z[:, None], MODE), part, IEEE, SWAP)
            part = _dot(xb, _centered(b >> 4, z[:, None], MODE), part, IEEE, SWAP)
        else:
            part = _dot(xa, _offset_codes(b & 0xF, MODE), part, IEEE, SWAP)
            part = _dot(xb, _offset_codes(b >> 4, MODE), part, IEEE, SWAP)
            x_sum = tl.sum(xa.to(tl.float32), axis=1) + tl.sum(xb.to(tl.float32), axis=1)
            part -= _outer(x_sum, (z + OFFSET).to(tl.float32), SWAP)
    else:
        if CENTER or MODE == 2:  # 8-bit codes do not fit bf16's 7-bit mantissa: always centered in bf16
            part = _dot(xa, _centered(b, z[:, None], MODE), part, IEEE, SWAP)
        else:
            part = _dot(xa, _offset_codes(b, MODE), part, IEEE, SWAP)
            part -= _outer(tl.sum(xa.to(tl.float32), axis=1), (z + OFFSET).to(tl.float32), SWAP)
    return part


@triton.jit
def _split_fixup(acc, Y, y_ptrs, p_ptrs, slice_stride, mask, counter):
    """Split-K without a zeroed fp32 output: each of the ``num_programs(1)`` programs sharing an output tile stores
    its fp32 partial in its own slice of a scratch buffer and counts itself in; the last to arrive sums the slices
    in split order (deterministic), writes the output in ``Y``'s dtype and resets the counter for the next call."""
    pid_k = tl.program_id(1)
    n_splits = tl.num_programs(1)
    tl.store(p_ptrs + pid_k * slice_stride, acc, mask=mask, cache_modifier=".wt")
    tl.debug_barrier()  # every thread's partial is written before the tile is counted
    arrived = tl.atomic_add(counter, 1, sem="acq_rel")
    if arrived == n_splits - 1:
        total = tl.zeros_like(acc)
        for split in range(0, n_splits):
            total += tl.load(p_ptrs + split * slice_stride, mask=mask, other=0.0, cache_modifier=".cg")
        tl.store(y_ptrs, total.to(Y.dtype.element_ty), mask=mask)
        tl.atomic_xchg(counter, 0)


# fmt: off
@triton.jit(do_not_specialize=["M"])
def _qmm_kernel(
    X, W, S, Z, Y, P, C,
    M, N, K, K_SPLIT,
    stride_xm, stride_wn, stride_sn, stride_ym,
    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, FIXUP: tl.constexpr, MODE: tl.constexpr,
    OFFSET: tl.constexpr, CENTER: tl.constexpr, ASM: tl.constexpr, IEEE: tl.constexpr, SWAP: tl.constexpr,
    PREFETCH: tl.constexpr, X_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # fmt: on
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
        xa, xb, b = _load_tile(x_rows, w_rows, m_mask, n_mask, k_start, k_end, K, BITS, X_SPLIT, BLOCK_K)
    for k0 in range(k_start, k_end, BLOCK_K):
        if PREFETCH:  # the next tile's loads are in flight while this one is computed
            xa_next, xb_next, b_next = _load_tile(
                x_rows, w_rows, m_mask, n_mask, k0 + BLOCK_K, k_end, K, BITS, X_SPLIT, BLOCK_K
            )
        else:
            xa, xb, b = _load_tile(x_rows, w_rows, m_mask, n_mask, k0, k_end, K, BITS, X_SPLIT, BLOCK_K)
        if GROUP != 0:
            g = k0 // GROUP
            s = tl.load(S + s_rows + g, mask=n_mask, other=0.0).to(tl.float32)
            if HAS_ZERO:
                z = tl.load(Z + s_rows + g, mask=n_mask, other=0).to(tl.int32)
        part = _tile_part(xa, xb, b, z, BITS, MODE, OFFSET, CENTER, ASM, IEEE, SWAP, BLOCK_M, BLOCK_N)
        if GROUP == 0:
            acc += part
        else:
            acc += part * (s[:, None] if SWAP else s[None, :])
        if PREFETCH:
            xa, xb, b = xa_next, xb_next, b_next
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
@triton.jit
def _qmv_kernel(
    X, W, S, Z, Y,
    N, K, K_SPLIT,
    stride_wn, stride_sn,
    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, ATOMIC: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # fmt: on
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    w_rows = W + offs_n[:, None].to(tl.int64) * stride_wn
    s_rows = offs_n.to(tl.int64) * stride_sn
    k_start = pid_k * K_SPLIT
    k_end = tl.minimum(k_start + K_SPLIT, K)
    z = tl.full((BLOCK_N,), 1 << (BITS - 1), tl.int32)
    if GROUP == 0:
        if HAS_ZERO:
            z = tl.load(Z + s_rows, mask=n_mask, other=0).to(tl.int32)
    if BITS == 4:
        acc2 = tl.zeros((BLOCK_N, BLOCK_K // 2), dtype=tl.float32)
    else:
        acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        if GROUP != 0:
            g = k0 // GROUP
            if HAS_ZERO:
                z = tl.load(Z + s_rows + g, mask=n_mask, other=0).to(tl.int32)
        if BITS == 4:
            offs_e = k0 + 2 * tl.arange(0, BLOCK_K // 2)
            x_even = tl.load(X + offs_e, mask=offs_e < K, other=0.0).to(tl.float32)
            x_odd = tl.load(X + offs_e + 1, mask=offs_e < K, other=0.0).to(tl.float32)
            offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            b = tl.load(w_rows + offs_b[None, :], mask=n_mask[:, None] & (offs_b[None, :] < K // 2), other=0)
            t = _centered_f32(b & 0xF, z[:, None]) * x_even[None, :]
            t += _centered_f32(b >> 4, z[:, None]) * x_odd[None, :]
        else:
            offs_k = k0 + tl.arange(0, BLOCK_K)
            xk = tl.load(X + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
            q = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & (offs_k[None, :] < K), other=0)
            t = _centered_f32(q, z[:, None]) * xk[None, :]
        if GROUP == 0:
            acc2 += t
        else:
            acc2 += t * tl.load(S + s_rows + g, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    acc = tl.sum(acc2, axis=1)
    if GROUP == 0:
        acc = acc * tl.load(S + s_rows, mask=n_mask, other=0.0).to(tl.float32)
    if ATOMIC:
        tl.atomic_add(Y + offs_n, acc, mask=n_mask)
    else:
        tl.store(Y + offs_n, acc.to(Y.dtype.element_ty), mask=n_mask)


@triton.jit
def _word_code(w, J: tl.constexpr, BITS: tl.constexpr):
    """Code ``J`` of each 32-bit word ``w`` as the fp32 ``OFFSET + q`` exactly, by moving it into a float's
    mantissa: one shift and one mask-and-or per code. 4 bits: ``0x43000000 | q << 16`` is ``128 + q``; 8 bits:
    ``0x43800000 | q << 15`` is ``256 + q`` (the smallest power of two whose mantissa step is one at that range, so
    little is lost when ``(OFFSET + z) * sum(x)`` is subtracted)."""
    if BITS == 4:
        SHIFT: tl.constexpr = 16 - 4 * J
        MASK: tl.constexpr = 0xF0000
        MAGIC: tl.constexpr = 0x43000000
    else:
        SHIFT: tl.constexpr = 15 - 8 * J
        MASK: tl.constexpr = 0x7F8000
        MAGIC: tl.constexpr = 0x43800000
    if SHIFT > 0:
        t = w << SHIFT
    elif SHIFT < 0:
        t = w >> (-SHIFT)  # arithmetic shift: the sign bits land above the mask
    else:
        t = w
    return ((t & MASK) | MAGIC).to(tl.float32, bitcast=True)


@triton.jit
def _word_nibbles_asm(w):
    """The eight 4-bit codes of each int32 word as fp32 ``128 + q`` with inline PTX (GPU only): two mask-ands and
    a shift split even and odd nibbles into bytes, then one ``prmt`` per code writes the byte under the exponent
    byte ``0x43`` (fp32 ``0x43000000 | q << 16``): 11 integer instructions per 8 codes instead of 15."""
    return tl.inline_asm_elementwise(
        "{ .reg .b32 lo, hi, m; mov.b32 m, 0x43000000; and.b32 lo, $8, 0x0F0F0F0F; shr.u32 hi, $8, 4; "
        "and.b32 hi, hi, 0x0F0F0F0F; prmt.b32 $0, lo, m, 0x7044; prmt.b32 $1, hi, m, 0x7044; "
        "prmt.b32 $2, lo, m, 0x7144; prmt.b32 $3, hi, m, 0x7144; prmt.b32 $4, lo, m, 0x7244; "
        "prmt.b32 $5, hi, m, 0x7244; prmt.b32 $6, lo, m, 0x7344; prmt.b32 $7, hi, m, 0x7344; }",
        "=r,=r,=r,=r,=r,=r,=r,=r,r", [w], dtype=(tl.float32,) * 8, is_pure=True, pack=1,
    )  # fmt: skip


@triton.jit
def _word_bytes_asm(w):
    """The four 8-bit codes of each int32 word as fp32 ``32768 + q`` with one ``prmt`` each (GPU only): the code
    byte goes under the exponent byte ``0x47`` (fp32 ``0x47000000 | q << 8``)."""
    return tl.inline_asm_elementwise(
        "{ .reg .b32 m; mov.b32 m, 0x47000000; prmt.b32 $0, $4, m, 0x7404; prmt.b32 $1, $4, m, 0x7414; "
        "prmt.b32 $2, $4, m, 0x7424; prmt.b32 $3, $4, m, 0x7434; }",
        "=r,=r,=r,=r,r", [w], dtype=(tl.float32,) * 4, is_pure=True, pack=1,
    )  # fmt: skip


# fmt: off
@triton.jit
def _qmv_words_kernel(
    X, W, S, Z, Y, P, C,
    N, K, K_SPLIT,
    stride_wn, stride_sn,
    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, FIXUP: tl.constexpr,
    TILE_SCALE: tl.constexpr, EXACT: tl.constexpr, ASM: tl.constexpr, PREFETCH: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    # fmt: on
    CPW: tl.constexpr = 32 // BITS  # codes per int32 word
    OFFSET: tl.constexpr = 128 if BITS == 4 else 32768 if ASM else 256
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_w = tl.arange(0, BLOCK_W)
    n_mask = offs_n < N
    w_rows = W + offs_n[:, None].to(tl.int64) * stride_wn
    s_rows = offs_n.to(tl.int64) * stride_sn
    k_start = pid_k * K_SPLIT
    k_end = tl.minimum(k_start + K_SPLIT, K)
    words_end = k_end // CPW
    zero = tl.full((BLOCK_N,), (1 << (BITS - 1)) + OFFSET, tl.float32)  # symmetric: OFFSET + 2**(bits-1)
    if GROUP == 0:
        if HAS_ZERO:
            zero = tl.load(Z + s_rows, mask=n_mask, other=0).to(tl.float32) + OFFSET
    acc = tl.zeros((BLOCK_N, BLOCK_W), dtype=tl.float32)
    if PREFETCH:
        kw = k_start // CPW + offs_w
        words = tl.load(w_rows + kw[None, :], mask=n_mask[:, None] & (kw < words_end)[None, :], other=0)
    for k0 in range(k_start, k_end, BLOCK_W * CPW):
        kw = k0 // CPW + offs_w
        w_mask = kw < words_end
        if PREFETCH:  # the next tile's words are in flight while this one is computed
            kw_next = kw + BLOCK_W
            words_next = tl.load(w_rows + kw_next[None, :], mask=n_mask[:, None] & (kw_next < words_end)[None, :],
                                 other=0)
        else:
            words = tl.load(w_rows + kw[None, :], mask=n_mask[:, None] & w_mask[None, :], other=0)
        if GROUP == 0:
            zw = zero[:, None]
            s = 1.0
        elif TILE_SCALE:  # the tile lies in one group
            g = k0 // GROUP
            if HAS_ZERO:
                zero = tl.load(Z + s_rows + g, mask=n_mask, other=0).to(tl.float32) + OFFSET
            zw = zero[:, None]
            s = tl.load(S + s_rows + g, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        else:  # the tile spans groups: a scale (and zero point) per word
            gw = s_rows[:, None] + ((kw * CPW) // GROUP)[None, :]
            sw_mask = n_mask[:, None] & w_mask[None, :]
            zw = zero[:, None]
            if HAS_ZERO:
                zw = tl.load(Z + gw, mask=sw_mask, other=0).to(tl.float32) + OFFSET
            s = tl.load(S + gw, mask=sw_mask, other=0.0).to(tl.float32)
        part = tl.zeros((BLOCK_N, BLOCK_W), dtype=tl.float32)
        x_sum = tl.zeros((BLOCK_W,), dtype=tl.float32)
        if ASM:
            codes = _word_nibbles_asm(words) if BITS == 4 else _word_bytes_asm(words)
            for j in tl.static_range(CPW):
                xj = tl.load(X + kw * CPW + j, mask=w_mask, other=0.0).to(tl.float32)
                x_sum += xj
                part += codes[j] * xj[None, :]
        for j in tl.static_range(0 if ASM else CPW):
            xj = tl.load(X + kw * CPW + j, mask=w_mask, other=0.0).to(tl.float32)
            if EXACT:
                part += (_word_code(words, j, BITS) - zw) * xj[None, :]
            else:
                x_sum += xj
                part += _word_code(words, j, BITS) * xj[None, :]
        if not EXACT:
            part -= zw * x_sum[None, :]
        if GROUP == 0:
            acc += part
        else:
            acc += part * s
        if PREFETCH:
            words = words_next
    out = tl.sum(acc, axis=1)
    if GROUP == 0:
        out = out * tl.load(S + s_rows, mask=n_mask, other=0.0).to(tl.float32)
    if FIXUP:
        _split_fixup(out, Y, Y + offs_n, P + offs_n, N, n_mask, C + pid_n)
    else:
        tl.store(Y + offs_n, out.to(Y.dtype.element_ty), mask=n_mask)


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
            (register double-buffering, for latency-bound small batches).
        x_split: ``"mma"``/``"mma_t"`` with 4-bit codes: reorder ``x`` to its even then odd columns first (one small
            copy) so the kernel's activation loads are contiguous and pipelined.
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


def launch(x: Tensor, w: Tensor, scales: Tensor, zeros: Tensor | None, bits: int, group: int,
           cfg: KernelConfig) -> Tensor:
    """Run one configuration. ``x`` ``(M, K)``; ``w`` uint8 codes ``(N, K * bits / 8)``; ``scales``/``zeros``
    ``(N, K / G)`` (``group`` = ``G``, 0 for per-channel). Returns ``(M, N)`` in ``x.dtype``."""
    m, k = x.shape
    n = w.shape[0]
    k_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    splits = triton.cdiv(k, k_split)
    atomic = splits > 1 and cfg.kind == "gemv"  # fp32 atomics into a zeroed buffer
    fixup = splits > 1 and not atomic  # partial slices, summed by the tile's last program (_split_fixup)
    y = torch.zeros((m, n), device=x.device, dtype=torch.float32) if atomic else x.new_empty((m, n))
    partials = torch.empty((splits, m, n), device=x.device, dtype=torch.float32) if fixup else y
    z_arg = zeros if zeros is not None else scales
    if cfg.asm and cfg.kind != "words" and (bits != 4 or zeros is not None or x.dtype != torch.bfloat16
                                            or x.device.type != "cuda"):
        raise ValueError("the inline-PTX path takes symmetric 4-bit codes and bf16 activations on a GPU")
    if cfg.kind == "words":
        cpw = 32 // bits
        if m != 1 or k % cpw or cfg.block_k % cpw or w.stride(1) != 1 or w.shape[1] % 4 or w.stride(0) % 4:
            raise ValueError(f"the words kernel takes one row and whole int32 words of codes, got M={m}, K={k}")
        if cfg.asm and (x.dtype == torch.float32 or x.device.type != "cuda"):
            raise ValueError("the words kernel's inline-PTX path takes fp16/bf16 activations on a GPU")
        words = w.view(torch.int32)
        # fmt: off
        tiles = triton.cdiv(n, cfg.block_n)
        counters = _split_counters(x.device, tiles) if fixup else y
        _qmv_words_kernel[(tiles, splits)](
            x, words, scales, z_arg, y, partials, counters, n, k, k_split, words.stride(0), scales.stride(0),
            BITS=bits, GROUP=group, HAS_ZERO=zeros is not None, FIXUP=fixup,
            TILE_SCALE=group > 0 and group % cfg.block_k == 0, EXACT=x.dtype == torch.float32, ASM=cfg.asm,
            PREFETCH=cfg.prefetch,
            BLOCK_N=cfg.block_n, BLOCK_W=cfg.block_k // cpw,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        # fmt: on
    elif cfg.kind == "gemv":
        if m != 1:
            raise ValueError(f"the gemv kernel takes one row, got M={m}")
        # fmt: off
        _qmv_kernel[(triton.cdiv(n, cfg.block_n), splits)](
            x, w, scales, z_arg, y, n, k, k_split, w.stride(0), scales.stride(0),
            BITS=bits, GROUP=group, HAS_ZERO=zeros is not None, ATOMIC=atomic,
            BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    elif cfg.kind in ("mma", "mma_t"):
        mode = _MODES[x.dtype]
        x_split = bits == 4 and cfg.x_split
        if x_split:  # even columns then odd ones: contiguous activation tiles for the two nibble planes
            x = x.unflatten(1, (k // 2, 2)).transpose(1, 2).reshape(m, k)
        tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
        counters = _split_counters(x.device, tiles) if fixup else y
        _qmm_kernel[(tiles, splits)](
            x, w, scales, z_arg, y, partials, counters, m, n, k, k_split, x.stride(0), w.stride(0), scales.stride(0),
            y.stride(0),
            BITS=bits, GROUP=group, HAS_ZERO=zeros is not None, FIXUP=fixup, MODE=mode, OFFSET=_OFFSETS[mode],
            CENTER=cfg.center, ASM=cfg.asm, IEEE=mode == 0, SWAP=cfg.kind == "mma_t", PREFETCH=cfg.prefetch,
            X_SPLIT=x_split, BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        # fmt: on
    else:
        raise ValueError(f"unknown kernel kind {cfg.kind!r}: one of 'mma', 'mma_t', 'gemv', 'words'")
    return y.to(x.dtype) if atomic else y


def qmm_fwd(x: Tensor, w: Tensor, scales: Tensor, zeros: Tensor | None, bits: int, split_k: int | None = None,
            config: KernelConfig | None = None) -> Tensor:
    """``x @ dequant(W)^T`` through the kernels.

    Arguments:
        x: ``(M, K)`` fp16/bf16/fp32 with a contiguous last dim.
        w: uint8 codes, ``(N, K)`` for 8 bits or ``(N, K / 2)`` for 4 bits, contiguous last dim.
        scales: ``(N, K / G)``, contiguous; one column means per-channel.
        zeros: uint8 like ``scales``, or ``None`` (symmetric).
        split_k: force the tensor-core kernel with this split (tests); ``None``: chosen per shape.
        config: force a full :class:`KernelConfig`.
    """
    from lightning_llmopt.kernels.quant_matmul_tune import choose_config

    k = x.shape[1]
    groups = scales.shape[1]
    group = 0 if groups == 1 else k // groups
    if config is None:
        config = choose_config(x, w, scales, zeros, bits, group, split_k)
    return launch(x, w, scales, zeros, bits, group, config)


__all__ = ["KernelConfig", "launch", "qmm_fwd"]
