"""The batch-1 kernels of the weight-only quantized matmul (:mod:`~lightning_llmopt.kernels.quant_matmul_fwd`
describes them and launches them): ``_qmv_kernel`` over code bytes, ``_qmv_words_kernel`` over int32 words of
codes, and the word unpacking helpers (shift-and-mask, or ``prmt`` inline PTX in fp16/bf16 on a GPU)."""

from __future__ import annotations

import triton
import triton.language as tl

from lightning_llmopt.kernels.flash_attention_interp import ensure_interpreted_stdlib
from lightning_llmopt.kernels.quant_matmul_tiles import _centered_f32, _split_fixup

ensure_interpreted_stdlib()  # before the kernels below are decorated


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
