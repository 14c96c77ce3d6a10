"""Shared Triton pieces of the weight-only quantized matmul (:mod:`~lightning_llmopt.kernels.quant_matmul_fwd`):
the exact code-to-float bit tricks, the dot/outer-product helpers, the tensor-core kernel's K-tile loader and step,
and the split-K fixup (the last program of a tile sums the partials). The scheme is described in that module."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

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
    x_rows,
    w_rows,
    m_mask,
    n_mask,
    k0,
    k_end,
    K,
    BITS: tl.constexpr,
    X_SPLIT: tl.constexpr,
    WIDEN: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One K tile's operands, masked to ``[k0, k_end)``: 4 bits: the even and odd input columns of ``x`` and the
    code bytes ``(BLOCK_N, BLOCK_K / 2)``; 8 bits: ``x`` twice and the codes ``(BLOCK_N, BLOCK_K)``. ``X_SPLIT``
    (4 bits): ``x`` rows hold their even columns then their odd ones, so both loads are contiguous (and the
    compiler's pipeliner can turn them into asynchronous copies). ``WIDEN`` (4 bits): ``x``'s whole tile twice
    (the nibbles are put back in column order by :func:`_tile_part`) and the code bytes."""
    if BITS == 4 and WIDEN:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        xa = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & (offs_k[None, :] < k_end), other=0.0)
        xb = xa
        offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        b = tl.load(w_rows + offs_b[None, :], mask=n_mask[:, None] & (offs_b[None, :] < k_end // 2), other=0)
    elif BITS == 4:
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
    WIDEN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """``x[:, tile] @ (q - z)[:, tile]^T`` in fp32 for one K tile of :func:`_load_tile` (its transpose if
    ``SWAP``); ``z`` int32 ``(BLOCK_N,)``. ``WIDEN`` (4 bits): the low and high nibbles are interleaved back into
    one ``(BLOCK_N, BLOCK_K)`` tile in registers and multiplied in one full-width product, as 8-bit codes are."""
    if SWAP:
        part = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if BITS == 4 and WIDEN:
        if ASM:
            w = tl.interleave(_nibbles_bf16_asm(b, False), _nibbles_bf16_asm(b, True))
        else:
            w = _centered(tl.interleave(b & 0xF, b >> 4), z[:, None], MODE)
        part = _dot(xa, w, part, IEEE, SWAP)
    elif BITS == 4:
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
