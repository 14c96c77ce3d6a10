"""Triton paged-attention decode kernel (split-KV, GQA on tensor cores) and its launcher.

Design (facts from the PagedAttention, Flash-Decoding and FlashInfer papers; the code is ours):

1. One program owns one ``(sequence, key/value head, split)``. The ``GROUP = H / H_kv`` query heads that share the
   key/value head are loaded together as the rows of a ``[BLOCK_G, D]`` tile (padded to 16 rows, the smallest
   ``tl.dot``), so ``q k^T`` and ``p v`` are tensor-core dot products and every key/value byte is read once per
   group, not once per query head.
2. Keys are visited in tiles of ``BLOCK_N`` token slots; the physical block of every slot comes from the block table
   (``block_tables[b, t // PAGE]``), so a tile gathers ``BLOCK_N / PAGE`` pages of contiguous ``[PAGE, D]`` rows.
3. Online softmax in base 2 (``softmax_scale * log2(e)`` folded into one factor; for int8 caches the key scale is
   folded in too, and the value scale multiplies the output once at the end).
4. Split-KV (Flash-Decoding): each row's visible range ``[start, ctx)`` is cut into ``num_splits`` pieces of
   ``ceil((ctx - start) / num_splits)`` keys, rounded up to a multiple of 16 and to at least ``min_tokens_per_split``
   (the piece size is computed on the device from the row's own length, so a short row of a grid sized for the
   longest context, as under CUDA graphs, still spreads over every split); each program writes its normalised partial
   output and its log-sum-exp, and the partials are merged with weights ``exp2(lse_s - max_s lse)``. With one
   split the kernel writes the final output directly. Pieces past the end of a row write ``lse = -inf`` (weight 0),
   so the grid can be fixed for CUDA graphs while lengths change.
5. The partials are merged by :func:`_combine_kernel`, a second launch. A merge inside the first launch (the
   last split program of a group to arrive, counted with an atomic, merging the group's partials) was measured on an
   H100 (2026-11-25) and gained nothing: -1.5% to +1.2% at 256 MB of KV, and the same captured batch-1 decode step
   of the llama2-7b shape (5.26-5.33 ms against 5.28 ms), so the simpler two launches stay.

A row with no visible key (``ctx == 0``: padding rows of a CUDA graph) writes zeros.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from lightning_llmopt.kernels import precompile
from lightning_llmopt.kernels import shared_memory as smem
from lightning_llmopt.kernels.flash_attention_interp import ensure_interpreted_stdlib

ensure_interpreted_stdlib()  # before the kernels below are decorated

LOG2E = 1.4426950408889634


@triton.jit
def _paged_decode_kernel(
    Q,
    K,
    V,
    OUT,
    O_PART,
    LSE_PART,
    BLOCK_TABLES,
    CONTEXT_LENS,
    K_SCALE,
    V_SCALE,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_ks,
    stride_vb,
    stride_vh,
    stride_vs,
    stride_ob,
    stride_oh,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_bt,
    qk_scale,
    WINDOW,
    min_per,
    GROUP: tl.constexpr,
    HEAD_D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    QUANT: tl.constexpr,
    SPLIT: tl.constexpr,
    IEEE: tl.constexpr,
):
    b = tl.program_id(0)
    hk = tl.program_id(1)
    s = tl.program_id(2)
    ctx = tl.load(CONTEXT_LENS + b).to(tl.int32)
    start = 0
    if HAS_WINDOW:
        start = tl.maximum(ctx - WINDOW, 0)
    # this row's visible keys cut into num_programs(2) pieces (multiples of 16 keys, at least min_per): a short row
    # of a grid sized for long ones still spreads over every split
    per = tl.cdiv(ctx - start, tl.num_programs(2))
    per = tl.maximum(tl.cdiv(per, 16) * 16, min_per)
    lo = start + s * per
    hi = tl.minimum(ctx, lo + per)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = hk * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_D
    q_ptrs = Q + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    scale = qk_scale
    if QUANT:
        scale = scale * tl.load(K_SCALE + hk)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    bt = BLOCK_TABLES + b.to(tl.int64) * stride_bt
    k_base = K + hk.to(tl.int64) * stride_kh
    v_base = V + hk.to(tl.int64) * stride_vh
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        page = tl.load(bt + offs_n // PAGE, mask=n_mask, other=0).to(tl.int64)
        slot = (offs_n % PAGE).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(
            k_base + page[:, None] * stride_kb + slot[:, None] * stride_ks + offs_d[None, :], mask=kv_mask, other=0.0
        )
        if QUANT:
            k = k.to(Q.dtype.element_ty)  # |k| <= 127: exact in fp16/bf16/fp32
        if IEEE:
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        qk = tl.where(n_mask[None, :], qk * scale, float("-inf"))
        # every visited tile holds a visible key (start_n < hi), so m_new is finite
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = tl.load(
            v_base + page[:, None] * stride_vb + slot[:, None] * stride_vs + offs_d[None, :], mask=kv_mask, other=0.0
        )
        if QUANT:
            v = v.to(Q.dtype.element_ty)
        if IEEE:
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new

    if QUANT:
        acc = acc * tl.load(V_SCALE + hk)
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    out_mask = g_mask[:, None] & d_mask[None, :]
    if SPLIT:
        lse = tl.where(empty, float("-inf"), m_i + tl.math.log2(tl.where(empty, 1.0, l_i)))  # log2 units
        p_ptrs = O_PART + b.to(tl.int64) * stride_pb + heads[:, None] * stride_ph + s * stride_ps + offs_d[None, :]
        tl.store(p_ptrs, out, mask=out_mask)
        tl.store(LSE_PART + b.to(tl.int64) * stride_lb + heads * stride_lh + s, lse, mask=g_mask)
    else:
        o_ptrs = OUT + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=out_mask)


@triton.jit
def _combine_kernel(
    O_PART,
    LSE_PART,
    OUT,
    num_splits,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    HEAD_D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    lse = tl.load(LSE_PART + b.to(tl.int64) * stride_lb + h * stride_lh + offs_s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.math.exp2(lse - m)  # 0 for empty splits
    denom = tl.sum(w, 0)
    parts = tl.load(
        O_PART + b.to(tl.int64) * stride_pb + h * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
        mask=s_mask[:, None] & (offs_d[None, :] < HEAD_D),
        other=0.0,
    )
    out = tl.sum(parts * w[:, None], 0) / tl.where(denom == 0.0, 1.0, denom)
    o_ptrs = OUT + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d
    tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=offs_d < HEAD_D)


# Decode autotuning lists, ``(BLOCK_N, num_warps, num_stages)``, by padded head dim (kept short: tuning runs once per
# key, before any CUDA-graph capture). Up to 256 lanes: the measured list. Wider (MLA's absorbed decode, 512 + 64
# latent channels padded to 1024): 16-key tiles, whose two pipeline stages fit an H100/H200's 227 KiB.
_CONFIGS = {
    "narrow": [(64, 4, 3), (64, 4, 4), (128, 4, 3), (32, 2, 4)],
    "xwide": [(16, 4, 2), (16, 4, 3), (16, 8, 2)],
}


def _class(block_d: int) -> str:
    return "narrow" if block_d <= 256 else "xwide"


def _configs() -> list[triton.Config]:
    """Every list's configurations (the autotuner's; :func:`_prune` narrows them per call)."""
    rows = [t for table in _CONFIGS.values() for t in table]
    return [triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=s) for n, w, s in dict.fromkeys(rows)]


def smem_bytes(block_n: int, stages: int, block_g: int, block_d: int, q_elem: int, kv_elem: int, quant: bool) -> int:
    """Upper estimate (bytes) of a decode program's shared memory: the query tile ``BLOCK_G * BLOCK_D * q_elem``
    once, ``stages`` buffers of the key and value tiles ``2 * BLOCK_N * BLOCK_D * kv_elem``, and for an int8 cache
    the two tiles converted to the query's dtype ``2 * BLOCK_N * BLOCK_D * q_elem``."""
    quant_bytes = 2 * block_n * block_d * q_elem if quant else 0
    return block_g * block_d * q_elem + stages * 2 * block_n * block_d * kv_elem + quant_bytes


@smem.register("_paged_decode_kernel")
def _estimate(p: dict) -> int:
    return smem_bytes(p["BLOCK_N"], p["num_stages"], p["BLOCK_G"], p["BLOCK_D"], p["elem"]["Q"], p["elem"]["K"],
                      bool(p["QUANT"]))


def _prune(configs, named_args, **kwargs):  # type: ignore[no-untyped-def]
    """Keep the head-dim class's configurations whose :func:`smem_bytes` fits the device."""
    block_d, block_g, quant = kwargs["BLOCK_D"], kwargs["BLOCK_G"], kwargs["QUANT"]
    wanted = set(_CONFIGS[_class(block_d)])
    kept = [c for c in configs if (c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) in wanted]
    q, k = named_args["Q"], named_args["K"]
    call = smem.describe([("head dim", kwargs.get("HEAD_D")), ("query rows", block_g),
                          ("dtype", str(q.dtype).split(".")[-1]), ("cache", str(k.dtype).split(".")[-1])])
    return smem.fit("paged attention decode (_paged_decode_kernel)", kept,
                    lambda c: smem_bytes(c.kwargs["BLOCK_N"], c.num_stages, block_g, block_d, q.element_size(),
                                         k.element_size(), quant),
                    smem.device_limit(q.device), call)


@functools.cache
def _tuned_kernel():  # type: ignore[no-untyped-def]
    # the split sizes are not in the key: one tuning per head layout, whatever the batch (so CUDA graphs of every
    # batch size reuse it instead of re-tuning)
    return precompile.autotune(configs=_configs(), key=["GROUP", "HEAD_D", "PAGE", "QUANT", "SPLIT", "HAS_WINDOW"],
                           prune_configs_by={"early_config_prune": _prune})(_paged_decode_kernel)


def _fixed_fp32_config(consts: dict) -> dict:
    """The untuned fp32 launch (tests): 32-key tiles in two stages, or the 16-key tiles of one stage where those do
    not fit the device."""
    options = [(32, 4, 2), (16, 4, 1)]
    q_bytes = 4
    limit = None if not torch.cuda.is_available() else smem.device_limit(torch.cuda.current_device())
    n, w, s = smem.fit("paged attention decode (_paged_decode_kernel, fp32)", options,
                       lambda t: smem_bytes(t[0], t[2], consts["BLOCK_G"], consts["BLOCK_D"], q_bytes, q_bytes,
                                            consts["QUANT"]), limit, smem.describe([("head dim", consts["HEAD_D"])]),
                       count=False)[0]
    return {"BLOCK_N": n, "num_warps": w, "num_stages": s}


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def paged_decode(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    scale: float,
    window: int,
    k_scale: Tensor | None,
    v_scale: Tensor | None,
    num_splits: int,
    min_tokens_per_split: int,
) -> Tensor:
    """Launch the decode kernel (and the combine kernel when ``num_splits > 1``); arguments as
    :func:`lightning_llmopt.kernels.paged_attention`, already validated. ``window <= 0`` means no window."""
    B, H, D = q.shape
    _, H_kv, page, _ = k_cache.shape
    group = H // H_kv
    out = torch.empty_like(q)
    if B == 0:
        return out
    split = num_splits > 1
    if split:
        o_part = torch.empty(B, H, num_splits, D, device=q.device, dtype=torch.float32)
        lse_part = torch.empty(B, H, num_splits, device=q.device, dtype=torch.float32)
    else:
        o_part, lse_part = out, out  # unused
    quant = k_cache.dtype == torch.int8
    dummy = context_lens
    interp = q.device.type != "cuda"
    args = (
        q,
        k_cache,
        v_cache,
        out,
        o_part,
        lse_part,
        block_tables,
        context_lens,
        k_scale if quant else dummy,
        v_scale if quant else dummy,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        out.stride(0),
        out.stride(1),
        o_part.stride(0) if split else 0,
        o_part.stride(1) if split else 0,
        o_part.stride(2) if split else 0,
        lse_part.stride(0) if split else 0,
        lse_part.stride(1) if split else 0,
        block_tables.stride(0),
        scale * LOG2E,
        max(window, 0),
        min_tokens_per_split,
    )
    consts = dict(
        GROUP=group,
        HEAD_D=D,
        BLOCK_D=max(16, _next_pow2(D)),
        BLOCK_G=max(16, _next_pow2(group)),
        PAGE=page,
        HAS_WINDOW=window > 0,
        QUANT=quant,
        SPLIT=split,
        IEEE=q.dtype == torch.float32,
    )
    grid = (B, H_kv, num_splits)
    if interp:
        _paged_decode_kernel[grid](*args, BLOCK_N=16, num_warps=4, **consts)
    elif q.dtype == torch.float32:  # exact fp32 (tests): one fixed config, no tuning
        _paged_decode_kernel[grid](*args, **_fixed_fp32_config(consts), **consts)
    else:
        _tuned_kernel()[grid](*args, **consts)
    if split:
        _combine_kernel[(B, H)](
            o_part,
            lse_part,
            out,
            num_splits,
            o_part.stride(0),
            o_part.stride(1),
            o_part.stride(2),
            lse_part.stride(0),
            lse_part.stride(1),
            out.stride(0),
            out.stride(1),
            HEAD_D=D,
            BLOCK_D=max(16, _next_pow2(D)),
            BLOCK_S=max(2, _next_pow2(num_splits)),
            num_warps=4,
        )
    return out


__all__ = ["paged_decode"]
