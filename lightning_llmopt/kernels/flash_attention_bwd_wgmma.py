"""The dK/dV pass of the flash-attention backward for Hopper (sm_90), written in Gluon with explicit async WGMMA.

Same mathematics, grid and outputs as ``_flash_bwd_dkdv_kernel`` in :mod:`flash_attention_bwd` (one program per key
tile and key/value head or head slot, looping over the query heads of its share of the GQA group and over the query
tiles that see its keys), but the schedule is written out instead of left to Triton's pipeliner, which waits on
every non-accumulating matrix product as soon as it is issued. Per query tile ``i`` (``S`` shared-memory stages):

1. wait for tile ``i``'s copies (``q``, ``dO`` and the rows' ``lse2`` and ``delta``), then start the copies of tile
   ``i + S - 2`` into the stage whose last readers (the dV/dK products of tile ``i - 2``) retired in the previous
   step;
2. issue ``S^T = k q^T`` and ``dP^T = v dO^T`` together; wait for ``S^T`` only;
3. ``P^T = exp2(S^T - lse2)`` on the CUDA cores while ``dP^T`` runs on the tensor cores;
4. issue ``dV += P^T dO``; wait for ``dP^T`` only;
5. ``dS^T = P^T (dP^T - delta)`` while ``dV`` runs; issue ``dK += dS^T q`` and go on to the next tile.

The accumulators stay in flight across the loop's back edge. Query tiles of all heads of the program run as one flat
sequence so that the copy pipeline does not drain between heads. Rows past a sequence are copied as zeros, which
makes their products vanish without masks; only tiles on the causal diagonal, the window edge or a ragged end mask
``P^T``. Measurements and the ptxas pitfalls that shaped the loop: docs/flash_attention.md.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)

from lightning_llmopt.kernels import precompile
from lightning_llmopt.kernels import shared_memory as smem
from lightning_llmopt.kernels.flash_attention_common import (
    DKDV_TUNE_KEY,
    ChosenConfigs,
    LaunchConfig,
    as_launch_config,
    cuda_capability,
)

# a CTA-wide barrier: ``thread_barrier`` up to Triton 3.6, ``barrier`` in later releases
_cta_barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier
# cp.async of a pointer tensor into shared memory: ``async_copy_global_to_shared`` up to 3.6, ``async_load`` later
_copy_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared


@gluon.jit
def _next_tile(h, start_m, lo, hi, BLOCK_M: gl.constexpr):
    """The flat step after (query head ``h``, query tile at ``start_m``): the next tile, or the next head's first."""
    start_m += BLOCK_M
    wrap = start_m >= hi
    return gl.where(wrap, h + 1, h), gl.where(wrap, lo, start_m)


@gluon.jit
def _issue_tile(live, stage, h, start_m, bufs, bases, q_offs, do_offs, rows, stats_rows, stride_qs, stride_qh,
                stride_ds, stride_dh, stride_lh, seq_q):
    """Start the asynchronous copies of the tile of query head ``h`` at row ``start_m`` into ``stage``: its ``q``
    and ``dO`` rows and its per-row log-sum-exp (log2 units) and ``delta``, committed as one group. Rows past the
    sequence (and every row unless ``live``: every step commits a group) are zero-filled, which makes their products
    0 (``dO = 0`` and ``q = 0``: ``p = 1`` multiplies zeros). ``bases``: the sequence's first row of ``q``, ``dO``,
    ``lse2``, ``delta``; ``*_offs``, ``rows``, ``stats_rows``: the tile's element offsets and row numbers."""
    q_bufs, do_bufs, lse_bufs, delta_bufs = bufs
    q_base, do_base, lse_base, delta_base = bases
    limit = gl.where(live, seq_q - start_m, 0)
    ok = rows[:, None] < limit
    _copy_async(q_bufs.index(stage), q_base + (h.to(gl.int64) * stride_qh + start_m.to(gl.int64) * stride_qs)
                + q_offs, mask=ok)
    _copy_async(do_bufs.index(stage), do_base + (h.to(gl.int64) * stride_dh + start_m.to(gl.int64) * stride_ds)
                + do_offs, mask=ok)
    stats = h.to(gl.int64) * stride_lh + start_m + stats_rows
    ok_stats = stats_rows < limit
    _copy_async(lse_bufs.index(stage), lse_base + stats, mask=ok_stats)
    _copy_async(delta_bufs.index(stage), delta_base + stats, mask=ok_stats)
    async_copy.commit_group()


@gluon.jit
def _kv_tile(X, b, h_kv, tok0_64, start_n, seq_k, stride_b, stride_s, stride_h, BLOCK_N: gl.constexpr,
             HEAD_D: gl.constexpr, LOAD: gl.constexpr, SMEM: gl.constexpr):
    offs_n = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LOAD))
    offs_d = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, LOAD))
    ptrs = X + b.to(gl.int64) * stride_b + h_kv.to(gl.int64) * stride_h + (tok0_64 + offs_n[:, None]) * stride_s
    x = gl.load(ptrs + offs_d[None, :], mask=(offs_n[:, None] < seq_k) & (offs_d[None, :] < HEAD_D), other=0.0)
    return gl.allocate_shared_memory(X.dtype.element_ty, [BLOCK_N, HEAD_D], SMEM, x)


@gluon.jit
def _query_range(start_n, seq_q, q_off, WINDOW, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 IS_CAUSAL: gl.constexpr, HAS_WINDOW: gl.constexpr):
    """Query tiles ``[lo, hi)`` that see some key of the tile at ``start_n``, and ``[full_lo, full_hi)``, the tiles
    every pair of which is visible (no mask). The Triton pass computes the same inline: a Gluon kernel cannot call a
    ``triton.jit`` helper in a process where ``TRITON_INTERPRET=1`` turned it into an interpreted function."""
    lo = 0
    hi = seq_q
    full_lo = 0
    full_hi = (seq_q // BLOCK_M) * BLOCK_M
    if IS_CAUSAL:
        lo = gl.maximum(0, start_n - q_off)
        lo = (lo // BLOCK_M) * BLOCK_M
        full_lo = gl.maximum(0, start_n + BLOCK_N - 1 - q_off)
        full_lo = gl.cdiv(full_lo, BLOCK_M) * BLOCK_M
    if HAS_WINDOW:
        hi = gl.minimum(seq_q, start_n + BLOCK_N - 1 + WINDOW - q_off)
        full_hi = gl.minimum(full_hi, (gl.maximum(0, start_n + WINDOW - q_off) // BLOCK_M) * BLOCK_M)
    hi = gl.maximum(hi, 0)
    return lo, hi, gl.maximum(full_lo, lo), full_hi


@gluon.jit
def _dkdv_wgmma_kernel(
    Q, K, V, DO, LSE2, DELTA, DK, DV, CU_SEQLENS,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_db, stride_ds, stride_dh,
    stride_dkb, stride_dks, stride_dkh,
    stride_dvb, stride_dvs, stride_dvh,
    stride_lb, stride_lh,
    seq_q, seq_k, num_kv_heads, group, split, qk_scale, sm_scale, WINDOW, tune_q, tune_k,  # tune_*: autotuning key
    HEAD_D: gl.constexpr, BLOCK_D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    IS_CAUSAL: gl.constexpr, HAS_WINDOW: gl.constexpr, IS_VARLEN: gl.constexpr, IEEE: gl.constexpr,
):  # BLOCK_D (= HEAD_D) and IEEE (False) keep the Triton pass's constexprs
    NW: gl.constexpr = gl.num_warps()
    MMA_S: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                    instr_shape=[16, BLOCK_M, 16])
    MMA_D: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                    instr_shape=[16, HEAD_D, 16])
    OP_A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA_D, k_width=2)
    SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128 if HEAD_D >= 64 else HEAD_D * 2,
                                              element_bitwidth=16, rank=2)
    LOAD: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[32 // (HEAD_D // 8), HEAD_D // 8],
                                          warps_per_cta=[NW, 1], order=[1, 0])
    COLS: gl.constexpr = gl.SliceLayout(0, MMA_S)
    VEC_LOAD: gl.constexpr = gl.BlockedLayout(size_per_thread=[4], threads_per_warp=[32], warps_per_cta=[NW],
                                              order=[0])
    VEC_SMEM: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])

    pid_n = gl.program_id(0)
    pid_bh = gl.program_id(1)
    b = pid_bh // (num_kv_heads * split)
    h_kv = (pid_bh // split) % num_kv_heads
    part = pid_bh % split
    per_part = group // split
    if IS_VARLEN:
        tok0 = gl.load(CU_SEQLENS + b)
        seq_q = gl.load(CU_SEQLENS + b + 1) - tok0
        seq_k = seq_q
    else:
        tok0 = 0
    start_n = pid_n * BLOCK_N
    if start_n < seq_k:
        tok0_64 = tok0.to(gl.int64)
        q_off = seq_k - seq_q
        k_smem = _kv_tile(K, b, h_kv, tok0_64, start_n, seq_k, stride_kb, stride_ks, stride_kh, BLOCK_N, HEAD_D,
                          LOAD, SMEM)
        v_smem = _kv_tile(V, b, h_kv, tok0_64, start_n, seq_k, stride_vb, stride_vs, stride_vh, BLOCK_N, HEAD_D,
                          LOAD, SMEM)
        lo, hi, full_lo, full_hi = _query_range(start_n, seq_q, q_off, WINDOW, BLOCK_M, BLOCK_N, IS_CAUSAL,
                                                HAS_WINDOW)
        n_tiles = gl.maximum(gl.cdiv(hi - lo, BLOCK_M), 0)
        total = per_part * n_tiles
        h_first = h_kv * group + part * per_part
        q_bufs = gl.allocate_shared_memory(Q.dtype.element_ty, [STAGES, BLOCK_M, HEAD_D], SMEM)
        do_bufs = gl.allocate_shared_memory(Q.dtype.element_ty, [STAGES, BLOCK_M, HEAD_D], SMEM)
        lse_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], VEC_SMEM)
        delta_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], VEC_SMEM)
        bufs = (q_bufs, do_bufs, lse_bufs, delta_bufs)
        ld_rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, LOAD))
        ld_cols = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, LOAD))
        q_offs = ld_rows[:, None] * stride_qs + ld_cols[None, :]
        do_offs = ld_rows[:, None] * stride_ds + ld_cols[None, :]
        q_base = Q + b.to(gl.int64) * stride_qb + tok0_64 * stride_qs
        do_base = DO + b.to(gl.int64) * stride_db + tok0_64 * stride_ds
        bases = (q_base, do_base, LSE2 + b.to(gl.int64) * stride_lb + tok0_64,
                 DELTA + b.to(gl.int64) * stride_lb + tok0_64)
        stats_rows = gl.arange(0, BLOCK_M, layout=VEC_LOAD)
        h_ld = h_first  # the tile whose copies start next
        m_ld = lo
        for t in gl.static_range(STAGES - 2):
            _issue_tile(t < total, t, h_ld, m_ld, bufs, bases, q_offs, do_offs, ld_rows, stats_rows, stride_qs,
                        stride_qh, stride_ds, stride_dh, stride_lh, seq_q)
            h_ld, m_ld = _next_tile(h_ld, m_ld, lo, hi, BLOCK_M)
        offs_n = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, MMA_S))
        dk = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_D], gl.float32, MMA_D))  # in flight across iterations
        dv = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_D], gl.float32, MMA_D))
        zero_s = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, MMA_S)
        h = h_first
        start_m = lo
        for t in range(gl.maximum(total, 1)):  # at least once (all lanes masked off when total = 0): a loop that
            # may be skipped leaves a path on which the accumulators are copied, and ptxas then serializes the WGMMAs
            async_copy.wait_group(STAGES - 3)
            _cta_barrier()  # every warp's copies of tile t landed; every warp retired tile t - 2's products
            fence_async_shared()
            # tile t - 2's stage: its readers retired before this step's first wait, in every warp (the barrier)
            stage_ld = (t + STAGES - 2) % STAGES
            _issue_tile(t + STAGES - 2 < total, stage_ld, h_ld, m_ld, bufs, bases, q_offs, do_offs, ld_rows,
                        stats_rows, stride_qs, stride_qh, stride_ds, stride_dh, stride_lh, seq_q)
            h_ld, m_ld = _next_tile(h_ld, m_ld, lo, hi, BLOCK_M)
            offs_m = start_m + gl.arange(0, BLOCK_M, layout=COLS)
            row_ok = offs_m < seq_q
            q_s = q_bufs.index(t % STAGES)
            do_s = do_bufs.index(t % STAGES)
            lse = lse_bufs.index(t % STAGES).load(COLS)
            delta = delta_bufs.index(t % STAGES).load(COLS)
            s_t = warpgroup_mma(k_smem, q_s.permute((1, 0)), zero_s, use_acc=False, is_async=True)
            dp_t = warpgroup_mma(v_smem, do_s.permute((1, 0)), zero_s, use_acc=False, is_async=True)
            s_t = warpgroup_mma_wait(num_outstanding=1, deps=(s_t,))
            p_t = gl.exp2(s_t * qk_scale - lse[None, :])
            if (start_m < full_lo) | (start_m >= full_hi):  # causal diagonal, window edge or ragged last tile
                q_pos = offs_m[None, :] + q_off
                ok = row_ok[None, :] & (offs_n[:, None] < seq_k)
                if IS_CAUSAL:
                    ok = ok & (offs_n[:, None] <= q_pos)
                if HAS_WINDOW:
                    ok = ok & (q_pos - offs_n[:, None] < WINDOW)
                p_t = gl.where(ok, p_t, 0.0)
            dv = warpgroup_mma(gl.convert_layout(p_t.to(Q.dtype.element_ty), OP_A), do_s, dv, is_async=True)
            dp_t = warpgroup_mma_wait(num_outstanding=1, deps=(dp_t,))
            ds_t = p_t * (dp_t - delta[None, :])
            dk = warpgroup_mma(gl.convert_layout(ds_t.to(Q.dtype.element_ty), OP_A), q_s, dk, is_async=True)
            h, start_m = _next_tile(h, start_m, lo, hi, BLOCK_M)
        dk, dv = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv))
        async_copy.wait_group(0)
        h_out = h_kv * split + part
        offs_nd = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, MMA_D))
        offs_d = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, MMA_D))
        rows = tok0_64 + offs_nd[:, None]
        out_ok = (offs_nd[:, None] < seq_k) & (offs_d[None, :] < HEAD_D)
        gl.store(DK + b.to(gl.int64) * stride_dkb + h_out.to(gl.int64) * stride_dkh + rows * stride_dks
                 + offs_d[None, :], (dk * sm_scale).to(DK.dtype.element_ty), mask=out_ok)
        gl.store(DV + b.to(gl.int64) * stride_dvb + h_out.to(gl.int64) * stride_dvh + rows * stride_dvs
                 + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=out_ok)


# Autotuning lists, ``(BLOCK_M, BLOCK_N, num_warps, STAGES)`` by head-dim class: launches that compile for sm_90
# without register spills or serialized WGMMAs (Triton 3.6's ptxas), narrowed by the H100 sweep.
_CONFIGS = {
    "narrow": [(64, 64, 4, 4), (64, 64, 4, 3), (32, 64, 4, 4)],
    "wide": [(32, 64, 4, 4), (32, 128, 8, 4), (32, 128, 8, 3)],
}


def wgmma_configs(block_d: int) -> list[LaunchConfig]:
    """Launch configurations of the Gluon dK/dV pass for a head dim ``block_d``; ``stages`` is its ``STAGES``."""
    return [as_launch_config(t) for t in _CONFIGS["narrow" if block_d <= 64 else "wide"]]


@smem.register("_dkdv_wgmma_kernel")
def _estimate(p: dict) -> int:
    return wgmma_smem_bytes(p["BLOCK_M"], p["BLOCK_N"], p["STAGES"], p["HEAD_D"])


def wgmma_smem_bytes(block_m: int, block_n: int, stages: int, head_dim: int) -> int:
    """Upper estimate (bytes) of the pass's shared memory, 16-bit inputs: the key and value tiles
    ``2 * BLOCK_N * HEAD_D * 2``, ``STAGES`` stages of query and dO tiles ``2 * BLOCK_M * HEAD_D * 2`` and of the rows'
    fp32 lse2 and delta ``2 * BLOCK_M * 4``, and one ``BLOCK_N x BLOCK_M`` 16-bit tile for the layout conversion of
    ``P^T`` / ``dS^T`` into the WGMMA operand (the allocations are explicit in the kernel above)."""
    return 2 * block_n * head_dim * 2 + stages * (2 * block_m * head_dim * 2 + 2 * block_m * 4) + block_n * block_m * 2


def _prune(configs, named_args, **kwargs):  # type: ignore[no-untyped-def]
    block_d = kwargs.get("BLOCK_D", named_args.get("BLOCK_D"))
    wanted = [(c[0]["BLOCK_M"], c[0]["BLOCK_N"], c[1], c[2]) for c in wgmma_configs(block_d)]
    kept = [c for c in configs if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.kwargs["STAGES"]) in wanted]
    q = named_args["Q"]
    return smem.fit("flash attention dkdv (_dkdv_wgmma_kernel)", kept,
                    lambda c: wgmma_smem_bytes(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["STAGES"], block_d),
                    smem.device_limit(q.device), smem.describe([("head dim", block_d)]))


_tuner: list[object] = []


def _make_tuner():  # type: ignore[no-untyped-def]
    if not _tuner:
        every = {t for rows in _CONFIGS.values() for t in rows}
        configs = [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "STAGES": s}, num_warps=w, num_stages=1)
                   for m, n, w, s in sorted(every)]
        tune = precompile.autotune(configs=configs, key=DKDV_TUNE_KEY, prune_configs_by={"early_config_prune": _prune})
        _tuner.append(tune(_dkdv_wgmma_kernel))
    return _tuner[0]


_CHOSEN = ChosenConfigs(_make_tuner)


def launch_dkdv(args: tuple, consts: dict, grid: Callable[[dict], tuple], key: tuple,
                config: LaunchConfig | None = None) -> None:
    """Launch the Gluon dK/dV pass with the Triton pass's arguments and constexprs: at ``config``
    (``(blocks, num_warps, STAGES)``), or autotuned per ``key``."""
    if config is None:
        _CHOSEN.launch(key, grid, args, consts)
        return
    blocks, warps, stages = config
    _dkdv_wgmma_kernel[grid(blocks)](*args, **blocks, STAGES=stages, num_warps=warps, **consts)


def wgmma_supported(tensors: tuple[torch.Tensor, ...], head_dim: int, block_d: int) -> bool:
    """Whether the Gluon dK/dV pass applies to the inputs it reads (``q, k, v, dO``): a Hopper GPU, 16-bit inputs,
    head dim 64 or 128 (no padding), and rows it can copy 16 bytes at a time (16-byte aligned addresses, strides of
    whole 8-element groups; elsewhere its ``cp.async`` copies do not compile)."""
    q = tensors[0]
    if not (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and head_dim == block_d
            and head_dim in (64, 128)):
        return False
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    return cuda_capability(index) == (9, 0) and all(
        t.data_ptr() % 16 == 0 and all(s % 8 == 0 for s in t.stride()[:-1]) for t in tensors
    )


__all__ = ["launch_dkdv", "wgmma_configs", "wgmma_supported"]
