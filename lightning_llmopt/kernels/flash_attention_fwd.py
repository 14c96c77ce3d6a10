"""Triton forward kernel of flash attention (FlashAttention-2, Dao, arXiv 2307.08691, Algorithm 1) and its launcher.

One program owns ``BLOCK_M`` queries of one (sequence, head) and streams the visible key tiles:

1. load the query tile once; fold ``softmax_scale * log2(e)`` into one factor so the softmax uses ``exp2``;
2. split the visible key range ``[lo, hi)`` into the tiles that need a mask (the left window edge, the causal
   diagonal, the ragged end of the sequence) and the tiles that are visible to every query of the block, which run
   without any mask arithmetic; tiles no query of the block can see are never visited (causal upper triangle,
   keys left of the window, other documents of a packed batch);
3. per tile: ``s = q k^T`` (fp32 accumulation), running row max ``m``, rescale of the running sum ``l`` and the
   output accumulator by ``exp2(m_old - m_new)``, ``acc += p v``; in the unmasked band the scale multiplies the
   row max and rides on the subtraction (``exp2(s * c - m)``, one FMA a score) and the loads take no mask;
4. write ``acc / l`` and ``lse = (m + log2 l) * ln 2`` (natural log, what ring attention merges).

A row with no visible key keeps ``m = -inf``; the subtraction uses 0 instead, so it ends with ``l = 0``, output 0
and ``lse = -inf``, never NaN. GQA: query head ``h`` reads key/value head ``h // (H // H_kv)``; nothing is repeated.
Head dims that are not powers of two are padded to ``BLOCK_D`` lanes, masked on load and store.

On a Hopper GPU, fp16/bf16 calls with head dim 64 or 128 (dense, or packed with head dim 128) go to the
warp-specialized Gluon forward instead where it measured faster
(:mod:`~lightning_llmopt.kernels.flash_attention_fwd_ws`; ``LLMOPT_FLASH_FWD=triton`` keeps them here).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from lightning_llmopt.kernels import precompile
from lightning_llmopt.kernels.flash_attention_common import (
    LOG2E,
    TUNE_KEY,
    ChosenConfigs,
    Geometry,
    LaunchConfig,
    interpreter_block,
    launch_configs,
    prune_for_head_dim,
    tune_key,
    use_interpreter_config,
)
from lightning_llmopt.kernels.flash_attention_interp import ensure_interpreted_stdlib
from lightning_llmopt.kernels.flash_attention_ws_plan import ws_plan

ensure_interpreted_stdlib()  # before the kernels below are decorated


@triton.jit
def _visible_tile(qk, offs_m, offs_n, q_off, seq_k, WINDOW, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Scores with invisible keys set to -inf (causal, window, keys past the sequence end)."""
    q_pos = offs_m[:, None] + q_off
    k_pos = offs_n[None, :]
    ok = k_pos < seq_k
    if IS_CAUSAL:
        ok = ok & (k_pos <= q_pos)
    if HAS_WINDOW:
        ok = ok & (q_pos - k_pos < WINDOW)
    return tl.where(ok, qk, float("-inf"))


@triton.jit
def _fwd_tiles(acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_vs, offs_m, offs_d, q_off, seq_k, lo, hi,
               qk_scale, WINDOW, HEAD_D: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
               IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, IEEE: tl.constexpr, FULL_LOADS: tl.constexpr):
    """``FULL_LOADS``: every key of ``[lo, hi)`` exists and ``HEAD_D`` fills the lanes, so loads take no mask."""
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k_ptrs = k_base + offs_n[:, None] * stride_ks + offs_d[None, :]
        v_ptrs = v_base + offs_n[:, None] * stride_vs + offs_d[None, :]
        kv_mask = (offs_n[:, None] < seq_k) & (offs_d[None, :] < HEAD_D)
        if FULL_LOADS:
            k = tl.load(k_ptrs)
        else:
            k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
        if IEEE:
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        if MASKED:
            qk = _visible_tile(qk * qk_scale, offs_m, offs_n, q_off, seq_k, WINDOW, IS_CAUSAL, HAS_WINDOW)
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that see nothing yet: avoid -inf - -inf
            p = tl.math.exp2(qk - m_use[:, None])
        else:
            # the scale is positive, so it commutes with the max; the scaling then rides on the subtraction (FMA)
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            m_use = m_new
            p = tl.math.exp2(qk * qk_scale - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if FULL_LOADS:
            v = tl.load(v_ptrs)
        else:
            v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
        if IEEE:
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _flash_fwd_kernel(
    Q, K, V, O, LSE, CU_SEQLENS,  # noqa: E741
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh,
    stride_lb, stride_lh,
    seq_q, seq_k, num_heads, group, qk_scale, WINDOW, tune_q, tune_k,  # tune_*: autotuning key only
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, IS_VARLEN: tl.constexpr, IEEE: tl.constexpr,
):
    # Causal blocks late in the sequence have the most work: start them first.
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // num_heads
    h = pid_bh % num_heads
    h_kv = h // group
    if IS_VARLEN:
        tok0 = tl.load(CU_SEQLENS + b)
        seq_q = tl.load(CU_SEQLENS + b + 1) - tok0
        seq_k = seq_q
    else:
        tok0 = 0
    start_m = pid_m * BLOCK_M
    if start_m >= seq_q:
        return
    q_off = seq_k - seq_q  # bottom-right alignment of causal/window masks
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_base = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh + tok0.to(tl.int64) * stride_qs
    k_base = K + b.to(tl.int64) * stride_kb + h_kv.to(tl.int64) * stride_kh + tok0.to(tl.int64) * stride_ks
    v_base = V + b.to(tl.int64) * stride_vb + h_kv.to(tl.int64) * stride_vh + tok0.to(tl.int64) * stride_vs
    q_mask = (offs_m[:, None] < seq_q) & (offs_d[None, :] < HEAD_D)
    q = tl.load(q_base + offs_m[:, None] * stride_qs + offs_d[None, :], mask=q_mask, other=0.0)

    # Visible key range of the block, then the part of it that every query of the block sees.
    lo = 0
    hi = seq_k
    full_lo = 0
    full_hi = (seq_k // BLOCK_N) * BLOCK_N
    if IS_CAUSAL:
        hi = tl.minimum(seq_k, start_m + BLOCK_M + q_off)
        full_hi = tl.minimum(full_hi, ((start_m + q_off + 1) // BLOCK_N) * BLOCK_N)
    if HAS_WINDOW:
        lo = tl.maximum(0, start_m + q_off - WINDOW + 1)
        lo = (lo // BLOCK_N) * BLOCK_N
        full_lo = tl.maximum(0, start_m + BLOCK_M - 1 + q_off - WINDOW + 1)
        full_lo = tl.cdiv(full_lo, BLOCK_N) * BLOCK_N
    hi = tl.maximum(hi, 0)
    full_lo = tl.maximum(full_lo, lo)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # masked tiles left of the fully visible band (window edge)
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_vs, offs_m, offs_d, q_off, seq_k,
                               lo, tl.minimum(full_lo, hi), qk_scale, WINDOW, HEAD_D, BLOCK_N, True, IS_CAUSAL,
                               HAS_WINDOW, IEEE, False)
    # fully visible tiles: no mask arithmetic
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_vs, offs_m, offs_d, q_off, seq_k,
                               full_lo, full_hi, qk_scale, WINDOW, HEAD_D, BLOCK_N, False, IS_CAUSAL, HAS_WINDOW,
                               IEEE, HEAD_D == BLOCK_D)
    # masked tiles right of it (causal diagonal, ragged sequence end)
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_vs, offs_m, offs_d, q_off, seq_k,
                               tl.maximum(full_hi, full_lo), hi, qk_scale, WINDOW, HEAD_D, BLOCK_N, True, IS_CAUSAL,
                               HAS_WINDOW, IEEE, False)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453  # -inf where no key was visible
    o_base = O + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh + tok0.to(tl.int64) * stride_os
    tl.store(o_base + offs_m[:, None] * stride_os + offs_d[None, :], out.to(O.dtype.element_ty), mask=q_mask)
    lse_base = LSE + b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh + tok0
    tl.store(lse_base + offs_m, lse, mask=offs_m < seq_q)


_tuned_fwd = None


def _tuned_fwd_kernel():  # type: ignore[no-untyped-def]
    global _tuned_fwd
    if _tuned_fwd is None:
        _tuned_fwd = precompile.autotune(
            configs=[triton.Config(kw, num_warps=w, num_stages=s) for kw, w, s in launch_configs("fwd")],
            key=TUNE_KEY,
            prune_configs_by={"early_config_prune": prune_for_head_dim("fwd")},
        )(_flash_fwd_kernel)
    return _tuned_fwd


_CHOSEN = ChosenConfigs(_tuned_fwd_kernel)


def _ws_forward(q: Tensor, k: Tensor, v: Tensor, geo: Geometry, causal: bool, scale: float,
                window: int | None) -> tuple[Tensor, Tensor] | None:
    """``(out, lse)`` from the warp-specialized forward where it takes the call, else ``None`` (also where this
    Triton has no Gluon)."""
    plan = ws_plan(q, k, v, geo, causal, window)  # host-side rule: no Gluon import unless the kernel takes the call
    if plan is None:
        return None
    try:
        from lightning_llmopt.kernels import flash_attention_fwd_ws as ws
    except ImportError:  # a Triton without Gluon's Hopper API
        return None
    return ws.ws_fwd(q, k, v, geo, causal, scale, plan)


def flash_fwd(q: Tensor, k: Tensor, v: Tensor, geo: Geometry, causal: bool, scale: float,
              window: int | None, config: LaunchConfig | None = None) -> tuple[Tensor, Tensor]:
    """Launch the forward kernel. Shapes as :mod:`lightning_llmopt.kernels.flash_attention` (dense or packed).

    Returns ``out`` (like ``q``) and ``lse`` (fp32, ``(B, H, S_q)`` dense or ``(H, total)`` packed). ``config``
    (``({BLOCK_M, BLOCK_N}, num_warps, num_stages)``) bypasses autotuning: benchmarks/sweep_attention.py times
    candidate configurations with it.
    """
    if config is None and q.is_cuda:
        taken = _ws_forward(q, k, v, geo, causal, scale, window)
        if taken is not None:
            return taken
    out = torch.empty_like(q)
    lse = q.new_empty(geo.lse_shape, dtype=torch.float32)  # torch.empty(device=...) took 6 us of host time (H100)
    args = (
        q, k, v, out, lse, geo.cu_seqlens if geo.cu_seqlens is not None else q,
        *geo.strides(q), *geo.strides(k), *geo.strides(v), *geo.strides(out), *geo.lse_strides(lse),
        geo.seq_q, geo.seq_k, geo.num_heads, geo.group,
    )
    consts = dict(HEAD_D=geo.head_dim, BLOCK_D=geo.block_d, IS_CAUSAL=causal, HAS_WINDOW=window is not None,
                  IS_VARLEN=geo.cu_seqlens is not None, IEEE=q.dtype == torch.float32)
    qk_scale = scale * LOG2E
    win = window if window is not None else 0
    if use_interpreter_config(q) and config is None:
        config = ({"BLOCK_M": interpreter_block(geo.max_q), "BLOCK_N": interpreter_block(geo.max_k)}, 4, 1)
    if config is not None:
        blocks, warps, stages = config
        grid_fixed = (triton.cdiv(geo.max_q, blocks["BLOCK_M"]), geo.batch * geo.num_heads)
        _flash_fwd_kernel[grid_fixed](*args, qk_scale, win, *geo.tuning(window), **blocks, num_warps=warps,
                                      num_stages=stages, **consts)
    else:

        def grid(meta):  # type: ignore[no-untyped-def]
            return (triton.cdiv(geo.max_q, meta["BLOCK_M"]), geo.batch * geo.num_heads)

        _CHOSEN.launch(tune_key(geo, consts, q.dtype, window), grid, (*args, qk_scale, win, *geo.tuning(window)),
                       consts)
    return out, lse


__all__ = ["flash_fwd"]
