"""The batch-1 kernels of the weight-only quantized matmul (:mod:`~lightning_llmopt.kernels.quant_matmul_fwd`
describes them and launches them): ``_qmv_kernel`` over code bytes, ``_qmv_words_kernel`` over int32 words of
codes, and the word unpacking helpers (shift-and-mask, or ``prmt`` inline PTX in fp16/bf16 on a GPU)."""

from __future__ import annotations

import triton
import triton.language as tl

from lightning_llmopt.kernels.flash_attention_interp import ensure_interpreted_stdlib
from lightning_llmopt.kernels.pdl import gdc_launch_dependents, gdc_wait
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
        SHIFT: tl.constexpr = 15 - 8 * J  # type: ignore[no-redef]  # a constexpr per branch (@triton.jit body)
        MASK: tl.constexpr = 0x7F8000  # type: ignore[no-redef]
        MAGIC: tl.constexpr = 0x43800000  # type: ignore[no-redef]
    if SHIFT > 0:
        t = w << SHIFT
    elif SHIFT < 0:
        t = w >> (-SHIFT)  # arithmetic shift: the sign bits land above the mask
    else:
        t = w
    return ((t & MASK) | MAGIC).to(tl.float32, bitcast=True)


@triton.jit
def _word_nibbles_asm(w):
    """The eight 4-bit codes of each int32 word as fp32 with inline PTX (GPU only): one mask-and keeps the low
    nibbles, one the high ones in place; one ``prmt`` per code then writes a low nibble's byte under the exponent
    byte ``0x43`` (fp32 ``0x43000000 | q << 16`` = ``128 + q``, even codes) and a high nibble's byte, ``16 q``,
    under ``0x47`` (fp32 ``0x47000000 | 16 q << 8`` = ``32768 + 16 q``, odd codes: ``16 (2048 + q)``, so their
    activations are scaled by 1/16): 10 integer instructions per 8 codes."""
    return tl.inline_asm_elementwise(
        "{ .reg .b32 lo, hi, m, n; mov.b32 m, 0x43000000; mov.b32 n, 0x47000000; and.b32 lo, $8, 0x0F0F0F0F; "
        "and.b32 hi, $8, 0xF0F0F0F0; prmt.b32 $0, lo, m, 0x7044; prmt.b32 $1, hi, n, 0x7404; "
        "prmt.b32 $2, lo, m, 0x7144; prmt.b32 $3, hi, n, 0x7414; prmt.b32 $4, lo, m, 0x7244; "
        "prmt.b32 $5, hi, n, 0x7424; prmt.b32 $6, lo, m, 0x7344; prmt.b32 $7, hi, n, 0x7434; }",
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


@triton.jit
def _x_columns8(xt, BLOCK_W: tl.constexpr):
    """The eight columns of ``xt`` ``(BLOCK_W, 8)`` (the activations of each word's codes, row ``w`` holding
    ``x[8w : 8w + 8]``) as ``(BLOCK_W,)`` vectors, split in registers (a thread holds whole rows)."""
    t = tl.reshape(xt, (BLOCK_W, 2, 2, 2))  # column j = 4 * i1 + 2 * i2 + i3; split takes the last index
    a, b = tl.split(t)
    a0, a1 = tl.split(a)
    b0, b1 = tl.split(b)
    x0, x4 = tl.split(a0)
    x2, x6 = tl.split(a1)
    x1, x5 = tl.split(b0)
    x3, x7 = tl.split(b1)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _x_columns4(xt, BLOCK_W: tl.constexpr):
    """The four columns of ``xt`` ``(BLOCK_W, 4)`` as ``(BLOCK_W,)`` vectors (see :func:`_x_columns8`)."""
    t = tl.reshape(xt, (BLOCK_W, 2, 2))
    a, b = tl.split(t)
    x0, x2 = tl.split(a)
    x1, x3 = tl.split(b)
    return x0, x1, x2, x3


# fmt: off
@triton.jit
def _word_codes(words, BITS: tl.constexpr, ASM: tl.constexpr):
    """The codes of each int32 word as fp32 ``OFFSET + q`` (:func:`_word_code`, or inline PTX: odd 4-bit codes
    then come as ``16 (2048 + q)``, see :func:`_word_nibbles_asm`). One return at the end: with a ``return`` in each
    nested compile-time branch, Triton 3.9 compiled the 4-bit inline-PTX call to the 8-bit branch's four codes."""
    if BITS == 4:
        if ASM:
            codes = _word_nibbles_asm(words)
        else:
            codes = (_word_code(words, 0, 4), _word_code(words, 1, 4), _word_code(words, 2, 4),
                     _word_code(words, 3, 4), _word_code(words, 4, 4), _word_code(words, 5, 4),
                     _word_code(words, 6, 4), _word_code(words, 7, 4))
    elif ASM:
        codes = _word_bytes_asm(words)
    else:
        codes = _word_code(words, 0, 8), _word_code(words, 1, 8), _word_code(words, 2, 8), _word_code(words, 3, 8)
    return codes


@triton.jit
def _word_x(xt, BITS: tl.constexpr, ASM: tl.constexpr, BLOCK_W: tl.constexpr):
    """A word's activation columns as fp32 ``(BLOCK_W,)`` vectors, those of the inline-PTX odd 4-bit codes divided
    by 16, with their sum and ``x_fix`` (what the chain start adds for those codes' larger offset: ``-1920`` times
    the odd columns' sum)."""
    if BITS == 4:
        xs = _x_columns8(xt.to(tl.float32), BLOCK_W)
    else:
        xs = _x_columns4(xt.to(tl.float32), BLOCK_W)
    x_sum = xs[0]
    for j in tl.static_range(1, 32 // BITS):
        x_sum += xs[j]
    if BITS == 4 and ASM:
        x_fix = -1920.0 * (xs[1] + xs[3] + xs[5] + xs[7])
        xs = (xs[0], xs[1] * 0.0625, xs[2], xs[3] * 0.0625, xs[4], xs[5] * 0.0625, xs[6], xs[7] * 0.0625)
    else:
        x_fix = tl.zeros((BLOCK_W,), dtype=tl.float32)
    return xs, x_sum, x_fix


@triton.jit
def _codes_load(w_rows, s_ptrs, z_ptrs, k0, offs_w, col_g, words_end, zero, n_mask, GROUP: tl.constexpr,
                HAS_ZERO: tl.constexpr, TILE_SCALE: tl.constexpr, OFFSET: tl.constexpr, EVEN: tl.constexpr,
                EVICT: tl.constexpr, CPE: tl.constexpr):
    """The layer's loads of the K tile at ``k0``: the code elements, their scales and zero points (``OFFSET + z``,
    per element, per tile (``TILE_SCALE``), or ``zero``: per-channel or symmetric)."""
    kw = (k0 // CPE + offs_w).to(tl.uint32)
    w_mask = kw < words_end
    tile_mask = n_mask[:, None] & w_mask[None, :]
    w_ptrs = w_rows + kw[None, :]
    if EVEN:
        if EVICT:  # the codes are read once: let them leave the cache first
            words = tl.load(w_ptrs, eviction_policy="evict_first")
        else:
            words = tl.load(w_ptrs)
    elif EVICT:
        words = tl.load(w_ptrs, mask=tile_mask, other=0, eviction_policy="evict_first")
    else:
        words = tl.load(w_ptrs, mask=tile_mask, other=0)
    zw = zero[:, None]
    s = 1.0
    if GROUP != 0:
        if TILE_SCALE:  # the tile lies in one group
            g = k0 // GROUP
            g_mask = n_mask[:, None]
        else:  # a scale (and zero point) per element
            g = (k0 // GROUP + col_g)[None, :]
            g_mask = tile_mask
        if EVEN:
            if HAS_ZERO:
                zw = tl.load(z_ptrs + g).to(tl.float32) + OFFSET
            s = tl.load(s_ptrs + g).to(tl.float32)
        else:
            if HAS_ZERO:
                zw = tl.load(z_ptrs + g, mask=g_mask, other=0).to(tl.float32) + OFFSET
            s = tl.load(s_ptrs + g, mask=g_mask, other=0.0).to(tl.float32)
    return words, s, zw


@triton.jit
def _x_load(X, k0, offs_w, x_cols, words_end, EVEN: tl.constexpr, WIDE: tl.constexpr, CPW: tl.constexpr,
            CPE: tl.constexpr):
    """The activations of the K tile at ``k0`` (``xb``: those of a wide element's second word)."""
    kw = (k0 // CPE + offs_w).to(tl.uint32)
    x_ptrs = X + (kw[:, None] * CPE + x_cols)
    if EVEN:
        xa = tl.load(x_ptrs)
        xb = tl.load(x_ptrs + CPW) if WIDE else xa
    else:
        w_mask = kw < words_end
        xa = tl.load(x_ptrs, mask=w_mask[:, None], other=0.0)
        xb = tl.load(x_ptrs + CPW, mask=w_mask[:, None], other=0.0) if WIDE else xa
    return xa, xb


@triton.jit
def _words_part(words, xa, xb, zw, BITS: tl.constexpr, HAS_ZERO: tl.constexpr, EXACT: tl.constexpr,
                ASM: tl.constexpr, WIDE: tl.constexpr, OFFSET: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_W: tl.constexpr):
    """``sum_j (q_j - z) x_j`` over each element's codes (one int32 word, or ``WIDE`` an int64 of two: low word
    first), fp32 ``(BLOCK_N, BLOCK_W)``."""
    CPW: tl.constexpr = 32 // BITS
    if WIDE:
        codes = _word_codes(words.to(tl.int32), BITS, ASM)
        codes_b = _word_codes((words >> 32).to(tl.int32), BITS, ASM)
    else:
        codes = _word_codes(words, BITS, ASM)
    xs, x_sum, x_fix = _word_x(xa, BITS, ASM, BLOCK_W)
    if WIDE:
        xs_b, x_sum_b, x_fix_b = _word_x(xb, BITS, ASM, BLOCK_W)
    if EXACT:
        part = (codes[0] - zw) * xs[0][None, :]
        for j in tl.static_range(1, CPW):
            part += (codes[j] - zw) * xs[j][None, :]
        if WIDE:
            for j in tl.static_range(CPW):
                part += (codes_b[j] - zw) * xs_b[j][None, :]
    else:
        # part = sum_j (OFFSET_j + q_j) x_j - (OFFSET + z) sum_j x_j, the subtraction first: it starts the chain
        if WIDE:
            x_sum += x_sum_b
            x_fix += x_fix_b
        if HAS_ZERO:
            part = x_fix[None, :] - zw * x_sum[None, :]
        else:  # the symmetric zero: one start value per word, shared by the rows
            ZERO_SYM: tl.constexpr = (1 << (BITS - 1)) + OFFSET
            part = tl.broadcast_to((x_fix - ZERO_SYM * x_sum)[None, :], (BLOCK_N, BLOCK_W))
        for j in tl.static_range(CPW):
            part += codes[j] * xs[j][None, :]
        if WIDE:
            for j in tl.static_range(CPW):
                part += codes_b[j] * xs_b[j][None, :]
    return part


@triton.jit
def _words_step(acc, words, s, zw, xa, xb, BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr,
                EXACT: tl.constexpr, ASM: tl.constexpr, WIDE: tl.constexpr, OFFSET: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
    """``acc`` plus one K tile's products, scaled per group."""
    part = _words_part(words, xa, xb, zw, BITS, HAS_ZERO, EXACT, ASM, WIDE, OFFSET, BLOCK_N, BLOCK_W)
    if GROUP == 0:
        return acc + part
    return acc + part * s


@triton.jit
def _words_tiles(words, s, zw, xa, xb, w_rows, s_ptrs, z_ptrs, X, k_start, k_main, offs_w, col_g, x_cols, words_end,
                 zero, n_mask, BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr,
                 TILE_SCALE: tl.constexpr, EXACT: tl.constexpr, ASM: tl.constexpr, PREFETCH: tl.constexpr,
                 EVEN: tl.constexpr, EVICT: tl.constexpr, WIDE: tl.constexpr, OFFSET: tl.constexpr,
                 CPW: tl.constexpr, CPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
    """The ``(BLOCK_N, BLOCK_W)`` partial sums of the tiles from ``k_start`` to ``k_main``, the first tile's loads
    given (``words`` ... ``xb``)."""
    STEP: tl.constexpr = BLOCK_W * CPE
    acc = tl.zeros((BLOCK_N, BLOCK_W), dtype=tl.float32)
    if PREFETCH:  # register double-buffering: the next tile's loads are in flight while this one is computed
        for k0 in range(k_start, k_main, STEP):
            k1 = k0 + STEP  # past the end on the last step: masked or (EVEN) clamped to the last whole tile
            if EVEN:
                k1 = tl.minimum(k1, k_main - STEP)
            words1, s1, zw1 = _codes_load(w_rows, s_ptrs, z_ptrs, k1, offs_w, col_g, words_end, zero, n_mask, GROUP,
                                          HAS_ZERO, TILE_SCALE, OFFSET, EVEN, EVICT, CPE)
            xa1, xb1 = _x_load(X, k1, offs_w, x_cols, words_end, EVEN, WIDE, CPW, CPE)
            acc = _words_step(acc, words, s, zw, xa, xb, BITS, GROUP, HAS_ZERO, EXACT, ASM, WIDE, OFFSET, BLOCK_N,
                              BLOCK_W)
            words, s, zw, xa, xb = words1, s1, zw1, xa1, xb1
    else:  # the first tile, then each tile's loads and products in turn
        acc = _words_step(acc, words, s, zw, xa, xb, BITS, GROUP, HAS_ZERO, EXACT, ASM, WIDE, OFFSET, BLOCK_N, BLOCK_W)
        for k0 in range(k_start + STEP, k_main, STEP):
            words, s, zw = _codes_load(w_rows, s_ptrs, z_ptrs, k0, offs_w, col_g, words_end, zero, n_mask, GROUP,
                                       HAS_ZERO, TILE_SCALE, OFFSET, EVEN, EVICT, CPE)
            xa, xb = _x_load(X, k0, offs_w, x_cols, words_end, EVEN, WIDE, CPW, CPE)
            acc = _words_step(acc, words, s, zw, xa, xb, BITS, GROUP, HAS_ZERO, EXACT, ASM, WIDE, OFFSET, BLOCK_N,
                              BLOCK_W)
    return acc


@triton.jit(do_not_specialize=["stride_wn"])
def _qmv_words_kernel(
    X, W, S, Z, Y, P, C,
    N, K, K_SPLIT,
    stride_wn, stride_sn,
    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, FIXUP: tl.constexpr,
    TILE_SCALE: tl.constexpr, EXACT: tl.constexpr, ASM: tl.constexpr, PREFETCH: tl.constexpr, EVEN: tl.constexpr,
    PDL: tl.constexpr, WIDE: tl.constexpr, EVICT: tl.constexpr, ROW_W: tl.constexpr, ROW_S: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, REM_W: tl.constexpr,
):
    # fmt: on
    if PDL:  # a programmatic dependent (kernels.pdl): the next kernel may be scheduled once every program started
        gdc_launch_dependents()
    # Layout: the element loads are left unvectorized (``stride_wn`` is not specialized, so no row is known to be
    # 16-byte aligned), which gives each thread whole elements (an int32 word, or ``WIDE`` an int64 of two), one
    # per row of its rows; the activations are loaded as ``(BLOCK_W, CPW)`` rows of 8 or 16 contiguous bytes (two
    # such rows for a wide element), which lands each element's activations in the thread that holds it, and their
    # columns are split in registers. (Vectorized word loads put two or four words in a thread, and every
    # activation column then went through shared memory with a barrier: on an H100 that kernel was bound by its
    # L1/shared-memory traffic at under half the memory bandwidth.)
    CPW: tl.constexpr = 32 // BITS  # codes per int32 word
    CPE: tl.constexpr = CPW * 2 if WIDE else CPW  # codes per loaded element
    OFFSET: tl.constexpr = 128 if BITS == 4 else 32768 if ASM else 256
    # Addresses: unsigned element indices (no sign extension) added to per-row pointers, group indices by a shift;
    # ``EVEN`` (every row and every K tile whole) drops the masks; with ``REM_W`` > 0 (one K slice whose length is
    # not a multiple of the tile, tiles that start groups) every tile but the last is whole, and the rest of the
    # row is one masked tile of ``REM_W`` elements, loaded at the start. ``ROW_W``/``ROW_S`` > 0 are the row
    # strides as compile-time constants: the rows of a program are then immediate offsets from one address per step.
    GE: tl.constexpr = GROUP // CPE if GROUP > 0 else 1  # elements per quantization group
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = tl.arange(0, BLOCK_N)
    offs_n = pid_n * BLOCK_N + rows
    offs_w = tl.arange(0, BLOCK_W)
    n_mask = offs_n < N
    if ROW_W > 0:
        w_rows = W + (pid_n * BLOCK_N).to(tl.int64) * ROW_W + (rows * ROW_W)[:, None]
        s_rows = pid_n * BLOCK_N * ROW_S + rows * ROW_S
    else:
        w_rows = W + offs_n[:, None].to(tl.int64) * stride_wn
        s_rows = offs_n * stride_sn
    col_g = (offs_w // GE).to(tl.uint32)  # an element's group within a tile that starts one
    x_cols = tl.arange(0, CPW)[None, :].to(tl.uint32)
    k_start = pid_k * K_SPLIT
    k_end = tl.minimum(k_start + K_SPLIT, K)
    words_end = k_end // CPE
    STEP: tl.constexpr = BLOCK_W * CPE
    if REM_W > 0:
        k_main = k_end - (k_end - k_start) % STEP  # the end of the whole tiles
    else:
        k_main = k_end
    zero = tl.full((BLOCK_N,), (1 << (BITS - 1)) + OFFSET, tl.float32)  # symmetric: OFFSET + 2**(bits-1)
    if GROUP == 0:
        if HAS_ZERO:
            zero = tl.load(Z + s_rows, mask=n_mask, other=0).to(tl.float32) + OFFSET
    s_ptrs = S + s_rows[:, None]
    z_ptrs = Z + s_rows[:, None]
    # The first tile's codes, scales and zero points are the layer's own (no kernel writes them), so a programmatic
    # dependent loads them before it waits for the kernel before it: their latency overlaps that kernel's drain.
    # Nothing else is read (the activations are that kernel's output) or written before the wait.
    words, s, zw = _codes_load(w_rows, s_ptrs, z_ptrs, k_start, offs_w, col_g, words_end, zero, n_mask, GROUP,
                               HAS_ZERO, TILE_SCALE, OFFSET, EVEN, EVICT, CPE)
    if REM_W > 0:  # the short last tile, masked, in flight from the start (its latency is not left to the end)
        offs_r = tl.arange(0, REM_W)
        words_r, s_r, zw_r = _codes_load(w_rows, s_ptrs, z_ptrs, k_main, offs_r, (offs_r // GE).to(tl.uint32),
                                         words_end, zero, n_mask, GROUP, HAS_ZERO, False, OFFSET, False, EVICT, CPE)
    if PDL:
        gdc_wait()
    xa, xb = _x_load(X, k_start, offs_w, x_cols, words_end, EVEN, WIDE, CPW, CPE)
    if REM_W > 0:
        xa_r, xb_r = _x_load(X, k_main, offs_r, x_cols, words_end, False, WIDE, CPW, CPE)
    acc = _words_tiles(
        words, s, zw, xa, xb, w_rows, s_ptrs, z_ptrs, X, k_start, k_main, offs_w, col_g, x_cols, words_end, zero,
        n_mask, BITS, GROUP, HAS_ZERO, TILE_SCALE, EXACT, ASM, PREFETCH, EVEN, EVICT, WIDE, OFFSET, CPW, CPE,
        BLOCK_N, BLOCK_W)
    out = tl.sum(acc, axis=1)
    if REM_W > 0:
        acc_r = tl.zeros((BLOCK_N, REM_W), dtype=tl.float32)
        acc_r = _words_step(acc_r, words_r, s_r, zw_r, xa_r, xb_r, BITS, GROUP, HAS_ZERO, EXACT, ASM, WIDE, OFFSET,
                            BLOCK_N, REM_W)
        out += tl.sum(acc_r, axis=1)
    if GROUP == 0:
        out = out * tl.load(S + s_rows, mask=n_mask, other=0.0).to(tl.float32)
    if FIXUP:
        _split_fixup(out, Y, Y + offs_n, P + offs_n, N, n_mask, C + pid_n)
    else:
        tl.store(Y + offs_n, out.to(Y.dtype.element_ty), mask=n_mask)
