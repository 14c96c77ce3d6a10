"""Triton backward kernels of flash attention (FlashAttention-2, arXiv 2307.08691, Algorithm 2) and their launcher.

The attention matrix is recomputed from ``q``, ``k`` and the saved log-sum-exp, never stored. Two launches:

1. dQ pass: one program per (query tile, query head), over the same key tiles as the forward, ``dQ += dS k``. It
   first computes its tile's ``delta = rowsum(dO * O)`` (fp32, the softmax-Jacobian term ``D_i`` of the paper)
   from the ``dO`` tile it holds anyway, and writes it out for the next pass (a separate delta kernel cost 49 of
   1004 us of a packed 16 x 1k-token forward + backward on an H100; folded in here, 18 us), with ``lse2``, the
   log-sum-exp in log2 units.
2. dK/dV pass: one program per (key tile, key/value head). It loops over the query heads of its GQA group and over
   the query tiles that can see its keys (causal: from the diagonal on; window: up to ``window`` past the tile),
   with ``p^T = exp2(k q^T * scale*log2 e - lse2)``, ``dV += p^T dO``, ``dS^T = p^T (v dO^T - delta)``,
   ``dK += dS^T q``. The sum over the query group happens in registers: no atomics, no repeated K/V. For causal
   attention with 4 or more query heads per key/value head, up to 4 programs share a key/value head, each over
   part of the group, and their slots are summed after the launch (:func:`gqa_split`). On Hopper, 16-bit inputs
   at head dim 64 or 128 take the Gluon version of this pass (:mod:`flash_attention_bwd_wgmma`).

Both passes split their loops into masked tiles (window edge, causal diagonal) and tiles every pair of which is
visible (no mask arithmetic), and skip invisible tiles. A query row without visible keys has ``lse = -inf``;
``lse2`` holds ``+inf`` there so that its probabilities are 0 (no NaN). Padded rows/keys load zeros, ``lse2 = +inf``.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from lightning_llmopt.kernels import precompile
from lightning_llmopt.kernels.flash_attention_bwd_wgmma import launch_dkdv, wgmma_supported
from lightning_llmopt.kernels.flash_attention_common import (
    DKDV_TUNE_KEY,
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

ensure_interpreted_stdlib()  # before the kernels below are decorated


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _dot_acc(a, b, acc, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _dkdv_tiles(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qs, stride_ds, offs_n, offs_d,
                q_off, seq_q, lo, hi, qk_scale, WINDOW, HEAD_D: tl.constexpr, BLOCK_M: tl.constexpr,
                MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, IEEE: tl.constexpr,
                FULL_LOADS: tl.constexpr):
    """``FULL_LOADS``: every query row of ``[lo, hi)`` exists and ``HEAD_D`` fills the lanes (no load masks)."""
    for start_m in range(lo, hi, BLOCK_M):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        offs_m = start_m + tl.arange(0, BLOCK_M)
        row_ok = offs_m < seq_q
        q_ptrs = q_base + offs_m[None, :] * stride_qs + offs_d[:, None]
        do_ptrs = do_base + offs_m[:, None] * stride_ds + offs_d[None, :]
        if FULL_LOADS:
            q_t = tl.load(q_ptrs)  # (D, M)
            lse = tl.load(lse_base + offs_m)
        else:
            q_t = tl.load(q_ptrs, mask=row_ok[None, :] & (offs_d[:, None] < HEAD_D), other=0.0)
            lse = tl.load(lse_base + offs_m, mask=row_ok, other=float("inf"))
        qk_t = _dot(k, q_t, IEEE) * qk_scale  # (N, M), log2 units
        p_t = tl.math.exp2(qk_t - lse[None, :])
        if MASKED:
            q_pos = offs_m[None, :] + q_off
            ok = offs_n[:, None] >= 0
            if IS_CAUSAL:
                ok = ok & (offs_n[:, None] <= q_pos)
            if HAS_WINDOW:
                ok = ok & (q_pos - offs_n[:, None] < WINDOW)
            p_t = tl.where(ok, p_t, 0.0)
        if FULL_LOADS:
            do = tl.load(do_ptrs)  # (M, D)
            delta = tl.load(delta_base + offs_m)
        else:
            do = tl.load(do_ptrs, mask=row_ok[:, None] & (offs_d[None, :] < HEAD_D), other=0.0)
            delta = tl.load(delta_base + offs_m, mask=row_ok, other=0.0)
        dv = _dot_acc(p_t.to(do.dtype), do, dv, IEEE)
        dp_t = _dot(v, tl.trans(do), IEEE)  # (N, M)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = _dot_acc(ds_t.to(q_t.dtype), tl.trans(q_t), dk, IEEE)
    return dk, dv


@triton.jit
def _flash_bwd_dkdv_kernel(
    Q, K, V, DO, LSE2, DELTA, DK, DV, CU_SEQLENS,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_db, stride_ds, stride_dh,
    stride_dkb, stride_dks, stride_dkh,
    stride_dvb, stride_dvs, stride_dvh,
    stride_lb, stride_lh,
    seq_q, seq_k, num_kv_heads, group, split, qk_scale, sm_scale, WINDOW, tune_q, tune_k,  # tune_*: autotuning key
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, IS_VARLEN: tl.constexpr, IEEE: tl.constexpr,
):
    # ``split`` programs share a key/value head, each summing ``group // split`` query heads into its own slot of
    # DK/DV (head ``h_kv * split + part``), which the launcher reduces when ``split > 1``
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // (num_kv_heads * split)
    h_kv = (pid_bh // split) % num_kv_heads
    part = pid_bh % split
    h_out = h_kv * split + part
    per_part = group // split
    if IS_VARLEN:
        tok0 = tl.load(CU_SEQLENS + b)
        seq_q = tl.load(CU_SEQLENS + b + 1) - tok0
        seq_k = seq_q
    else:
        tok0 = 0
    start_n = pid_n * BLOCK_N
    if start_n >= seq_k:
        return
    q_off = seq_k - seq_q
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    kv_mask = (offs_n[:, None] < seq_k) & (offs_d[None, :] < HEAD_D)
    tok0_64 = tok0.to(tl.int64)
    k = tl.load(K + b.to(tl.int64) * stride_kb + h_kv.to(tl.int64) * stride_kh + (tok0_64 + offs_n[:, None]) * stride_ks
                + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + b.to(tl.int64) * stride_vb + h_kv.to(tl.int64) * stride_vh + (tok0_64 + offs_n[:, None]) * stride_vs
                + offs_d[None, :], mask=kv_mask, other=0.0)

    # Query tiles that see some key of this tile, and the band of them that sees all of its keys.
    lo = 0
    hi = seq_q
    full_lo = 0
    full_hi = (seq_q // BLOCK_M) * BLOCK_M  # a ragged last query tile goes to the masked loop
    if IS_CAUSAL:
        lo = tl.maximum(0, start_n - q_off)
        lo = (lo // BLOCK_M) * BLOCK_M
        full_lo = tl.maximum(0, start_n + BLOCK_N - 1 - q_off)
        full_lo = tl.cdiv(full_lo, BLOCK_M) * BLOCK_M
    if HAS_WINDOW:
        hi = tl.minimum(seq_q, start_n + BLOCK_N - 1 + WINDOW - q_off)
        full_hi = tl.minimum(full_hi, (tl.maximum(0, start_n + WINDOW - q_off) // BLOCK_M) * BLOCK_M)
    hi = tl.maximum(hi, 0)
    full_lo = tl.maximum(full_lo, lo)
    full_hi = tl.minimum(full_hi, (hi // BLOCK_M) * BLOCK_M)

    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    for g in range(part * per_part, (part + 1) * per_part):
        h = h_kv * group + g
        q_base = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh + tok0_64 * stride_qs
        do_base = DO + b.to(tl.int64) * stride_db + h.to(tl.int64) * stride_dh + tok0_64 * stride_ds
        lse_base = LSE2 + b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh + tok0
        delta_base = DELTA + b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh + tok0
        dk, dv = _dkdv_tiles(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qs, stride_ds, offs_n,
                             offs_d, q_off, seq_q, lo, tl.minimum(full_lo, hi), qk_scale, WINDOW, HEAD_D, BLOCK_M,
                             True, IS_CAUSAL, HAS_WINDOW, IEEE, False)
        dk, dv = _dkdv_tiles(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qs, stride_ds, offs_n,
                             offs_d, q_off, seq_q, full_lo, full_hi, qk_scale, WINDOW, HEAD_D, BLOCK_M,
                             False, IS_CAUSAL, HAS_WINDOW, IEEE, HEAD_D == BLOCK_D)
        dk, dv = _dkdv_tiles(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qs, stride_ds, offs_n,
                             offs_d, q_off, seq_q, tl.maximum(full_hi, full_lo), hi, qk_scale, WINDOW, HEAD_D,
                             BLOCK_M, True, IS_CAUSAL, HAS_WINDOW, IEEE, False)
    dk = dk * sm_scale
    rows = (tok0_64 + offs_n[:, None])
    tl.store(DK + b.to(tl.int64) * stride_dkb + h_out.to(tl.int64) * stride_dkh + rows * stride_dks + offs_d[None, :],
             dk.to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + b.to(tl.int64) * stride_dvb + h_out.to(tl.int64) * stride_dvh + rows * stride_dvs + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _dq_tiles(dq, q, do, lse, delta, k_base, v_base, stride_ks, stride_vs, offs_m, offs_d, q_off, seq_k, lo, hi,
              qk_scale, WINDOW, HEAD_D: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
              IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, IEEE: tl.constexpr, FULL_LOADS: tl.constexpr):
    """``FULL_LOADS``: every key of ``[lo, hi)`` exists and ``HEAD_D`` fills the lanes (no load masks)."""
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k_ptrs = k_base + offs_n[None, :] * stride_ks + offs_d[:, None]  # (D, N)
        v_ptrs = v_base + offs_n[None, :] * stride_vs + offs_d[:, None]
        if FULL_LOADS:
            k_t = tl.load(k_ptrs)
            v_t = tl.load(v_ptrs)
        else:
            kv_mask_t = (offs_n[None, :] < seq_k) & (offs_d[:, None] < HEAD_D)
            k_t = tl.load(k_ptrs, mask=kv_mask_t, other=0.0)
            v_t = tl.load(v_ptrs, mask=kv_mask_t, other=0.0)
        qk = _dot(q, k_t, IEEE) * qk_scale
        p = tl.math.exp2(qk - lse[:, None])
        if MASKED:
            q_pos = offs_m[:, None] + q_off
            ok = offs_n[None, :] < seq_k
            if IS_CAUSAL:
                ok = ok & (offs_n[None, :] <= q_pos)
            if HAS_WINDOW:
                ok = ok & (q_pos - offs_n[None, :] < WINDOW)
            p = tl.where(ok, p, 0.0)
        dp = _dot(do, v_t, IEEE)
        ds = p * (dp - delta[:, None])
        dq = _dot_acc(ds.to(k_t.dtype), tl.trans(k_t), dq, IEEE)
    return dq


@triton.jit
def _flash_bwd_dq_kernel(
    Q, K, V, O, DO, LSE, DELTA, LSE2, DQ, CU_SEQLENS,  # noqa: E741
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh,
    stride_db, stride_ds, stride_dh,
    stride_dqb, stride_dqs, stride_dqh,
    stride_lb, stride_lh,
    seq_q, seq_k, num_heads, group, qk_scale, sm_scale, WINDOW, tune_q, tune_k,  # tune_*: autotuning key only
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, IS_VARLEN: tl.constexpr, IEEE: tl.constexpr,
):
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
    q_off = seq_k - seq_q
    tok0_64 = tok0.to(tl.int64)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < seq_q
    mask = row_ok[:, None] & (offs_d[None, :] < HEAD_D)
    rows = tok0_64 + offs_m[:, None]
    q = tl.load(Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh + rows * stride_qs + offs_d[None, :],
                mask=mask, other=0.0)
    do = tl.load(DO + b.to(tl.int64) * stride_db + h.to(tl.int64) * stride_dh + rows * stride_ds + offs_d[None, :],
                 mask=mask, other=0.0)
    o = tl.load(O + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh + rows * stride_os + offs_d[None, :],
                mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)  # this tile's D_i; the dK/dV pass reads it after
    lse_off = b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh + tok0 + offs_m
    tl.store(DELTA + lse_off, delta, mask=row_ok)
    lse = tl.load(LSE + lse_off, mask=row_ok, other=float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse) * 1.4426950408889634
    tl.store(LSE2 + lse_off, lse, mask=row_ok)  # in log2 units, +inf for rows without keys: the dK/dV pass reads it
    k_base = K + b.to(tl.int64) * stride_kb + h_kv.to(tl.int64) * stride_kh + tok0_64 * stride_ks
    v_base = V + b.to(tl.int64) * stride_vb + h_kv.to(tl.int64) * stride_vh + tok0_64 * stride_vs

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

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    dq = _dq_tiles(dq, q, do, lse, delta, k_base, v_base, stride_ks, stride_vs, offs_m, offs_d, q_off, seq_k, lo,
                   tl.minimum(full_lo, hi), qk_scale, WINDOW, HEAD_D, BLOCK_N, True, IS_CAUSAL, HAS_WINDOW, IEEE,
                   False)
    dq = _dq_tiles(dq, q, do, lse, delta, k_base, v_base, stride_ks, stride_vs, offs_m, offs_d, q_off, seq_k,
                   full_lo, full_hi, qk_scale, WINDOW, HEAD_D, BLOCK_N, False, IS_CAUSAL, HAS_WINDOW, IEEE,
                   HEAD_D == BLOCK_D)
    dq = _dq_tiles(dq, q, do, lse, delta, k_base, v_base, stride_ks, stride_vs, offs_m, offs_d, q_off, seq_k,
                   tl.maximum(full_hi, full_lo), hi, qk_scale, WINDOW, HEAD_D, BLOCK_N, True, IS_CAUSAL,
                   HAS_WINDOW, IEEE, False)
    dq = dq * sm_scale
    tl.store(DQ + b.to(tl.int64) * stride_dqb + h.to(tl.int64) * stride_dqh + rows * stride_dqs + offs_d[None, :],
             dq.to(DQ.dtype.element_ty), mask=mask)


_tuned: dict[str, object] = {}


def _tuned_kernel(name: str):  # type: ignore[no-untyped-def]
    if name not in _tuned:
        kernel = _flash_bwd_dkdv_kernel if name == "dkdv" else _flash_bwd_dq_kernel
        table = launch_configs(name)
        _tuned[name] = precompile.autotune(
            configs=[triton.Config(kw, num_warps=w, num_stages=s) for kw, w, s in table],
            key=DKDV_TUNE_KEY if name == "dkdv" else TUNE_KEY,
            prune_configs_by={"early_config_prune": prune_for_head_dim(name)},
        )(kernel)
    return _tuned[name]


_CHOSEN = {name: ChosenConfigs(functools.partial(_tuned_kernel, name)) for name in ("dkdv", "dq")}


def _row_stats(lse: Tensor) -> tuple[Tensor, Tensor]:
    """``(delta, lse2)`` buffers laid out like ``lse``, from one allocation where ``lse`` is contiguous (an
    allocation cost ~16 us of host time in the autograd thread on an H100 host), the second one starting 128 bytes
    aligned so that both pointers keep the kernels' 16-byte specialization."""
    if not lse.is_contiguous():  # the passes index both with lse's strides
        return torch.empty_like(lse), torch.empty_like(lse)
    n = lse.numel()
    start = -(-n // 32) * 32
    flat = lse.new_empty(start + n)
    return flat[:n].view(lse.shape), flat[start:].view(lse.shape)


def flash_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, geo: Geometry, causal: bool,
              scale: float, window: int | None, configs: dict[str, LaunchConfig] | None = None,
              split: int | None = None, dkdv_impl: str | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients ``(dq, dk, dv)`` shaped like ``(q, k, v)``, in their dtypes (fp32 accumulation inside).

    ``configs`` maps ``"dkdv"`` / ``"dq"`` to a launch configuration that bypasses that pass's autotuning (for
    benchmarks/sweep_attention.py); a pass not named is autotuned. ``split`` (a divisor of the GQA group; default
    :func:`gqa_split`): dK/dV programs per key/value head, each summing its share of the query heads into a slot of
    a ``split``-times larger buffer that is then reduced over the slots. ``dkdv_impl``: ``"wgmma"`` (the Gluon pass of
    :mod:`flash_attention_bwd_wgmma`, Hopper only) or ``"triton"``; by default the Gluon pass where it applies.
    """
    if do.stride(-1) != 1:
        do = do.contiguous()
    kv_heads = geo.num_heads // geo.group
    interpreted = use_interpreter_config(q)
    gluon = not interpreted and wgmma_supported((q, k, v, do), geo.head_dim, geo.block_d)
    dkdv_impl = dkdv_impl or ("wgmma" if gluon else "triton")
    if dkdv_impl not in ("wgmma", "triton") or (dkdv_impl == "wgmma" and not gluon):
        raise ValueError(f"dkdv_impl={dkdv_impl!r}: 'triton', or 'wgmma' for 16-bit head dim 64/128 on sm_90 "
                         "(16-byte aligned rows)")
    if split is None:  # the Gluon pass's 64-key tiles make twice the programs: a 4-way split becomes 2-way
        split = gqa_split(geo, causal, window)
        split = 2 if dkdv_impl == "wgmma" and split == 4 else split
    if split < 1 or geo.group % split:
        raise ValueError(f"split={split} must divide the GQA group of {geo.group} query heads per key/value head")
    dq = torch.empty_like(q)
    if split == 1:
        dk, dv = torch.empty_like(k), torch.empty_like(v)
    else:  # one slot per program: head h_kv * split + part
        dk, dv = (t.new_empty((*t.shape[:-2], kv_heads * split, t.shape[-1])) for t in (k, v))
    delta, lse2 = _row_stats(lse)
    cu = geo.cu_seqlens if geo.cu_seqlens is not None else q
    varlen = geo.cu_seqlens is not None
    bh = geo.batch * geo.num_heads
    consts = dict(HEAD_D=geo.head_dim, BLOCK_D=geo.block_d, IS_CAUSAL=causal, HAS_WINDOW=window is not None,
                  IS_VARLEN=varlen, IEEE=q.dtype == torch.float32)
    common = (geo.seq_q, geo.seq_k)
    tail = (scale * LOG2E, scale, window if window is not None else 0, *geo.tuning(window))
    dkdv_args = (q, k, v, do, lse2, delta, dk, dv, cu, *geo.strides(q), *geo.strides(k), *geo.strides(v),
                 *geo.strides(do), *geo.strides(dk), *geo.strides(dv), *geo.lse_strides(lse), *common, kv_heads,
                 geo.group, split, *tail)
    dq_args = (q, k, v, out, do, lse, delta, lse2, dq, cu, *geo.strides(q), *geo.strides(k), *geo.strides(v),
               *geo.strides(out), *geo.strides(do), *geo.strides(dq), *geo.lse_strides(lse), *common, geo.num_heads,
               geo.group, *tail)
    configs = dict(configs or {})
    if interpreted:
        blocks = {"BLOCK_M": interpreter_block(geo.max_q), "BLOCK_N": interpreter_block(geo.max_k)}
        configs = {"dkdv": (blocks, 4, 1), "dq": (blocks, 4, 1), **configs}
    passes = (  # the dQ pass writes delta and lse2, which the dK/dV pass reads
        ("dq", _flash_bwd_dq_kernel, dq_args, lambda m: (triton.cdiv(geo.max_q, m["BLOCK_M"]), bh)),
        ("dkdv", _flash_bwd_dkdv_kernel, dkdv_args, lambda m: (triton.cdiv(geo.max_k, m["BLOCK_N"]),
                                                               geo.batch * kv_heads * split)),
    )
    for name, kernel, args, grid in passes:
        key = tune_key(geo, consts, q.dtype, window) + ((geo.group, split) if name == "dkdv" else ())
        if name == "dkdv" and dkdv_impl == "wgmma":
            launch_dkdv(args, consts, grid, key, configs.get(name))
        elif name in configs:
            blocks, warps, stages = configs[name]
            kernel[grid(blocks)](*args, **blocks, num_warps=warps, num_stages=stages, **consts)
        else:
            _CHOSEN[name].launch(key, grid, args, consts)
    if split > 1:  # sum the slots (fp32 accumulation, one rounding to the gradient's dtype)
        dk, dv = (t.unflatten(-2, (kv_heads, split)).sum(-2) for t in (dk, dv))
    return dq, dk, dv


def gqa_split(geo: Geometry, causal: bool, window: int | None) -> int:
    """dK/dV programs per key/value head (see :func:`flash_bwd`): for causal attention (dense or packed) with
    groups of 4 or more query heads per key/value head, the largest divisor of the group up to 4; otherwise one
    program summing the whole group in registers.

    Why: with causal masking the first key tiles see every query tile and the last ones almost none, and a program
    over the whole group runs ``group`` times longer, leaving fewer, longer programs to balance across the SMs.
    On an H100 (B = 4, S = 4096, benchmarks/sweep_attention.py ``--splits``, 2026-11-26) the whole backward at the
    ``1b`` preset's hd64 32-over-4 heads took 2.57 ms with one program per key/value head and 2.30 ms with 4;
    without the causal mask splitting cost time (hd64 4:1: 3.78 / 3.88 / 3.92 ms with 1 / 2 / 4). The other shapes
    measured are in docs/flash_attention.md. Sliding windows and groups below 4 keep one program.
    """
    if not causal or window is not None or geo.group < 4:
        return 1
    return max(d for d in (1, 2, 3, 4) if geo.group % d == 0)


__all__ = ["flash_bwd", "gqa_split"]
