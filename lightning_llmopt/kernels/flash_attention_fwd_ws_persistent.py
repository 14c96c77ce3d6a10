"""The persistent form of the warp-specialized Hopper forward (:mod:`flash_attention_fwd_ws`), with the plain
schedule (head dim 128), for dense input and packs of equal documents.

One program per SM (at most) loops over (query block, sequence-head) tiles, striding by the grid. Per tile the
arithmetic is the non-persistent kernel's, in the same order, so outputs are bit-identical to it; what changes is
what overlaps:

- the query rows are double-buffered (``q_ready`` / ``q_empty`` per buffer) and the key/value ring's stage counter
  runs on across tiles, so the loader fetches the next tile's query rows and first key/value tiles while the
  consumers finish the current tile's softmax and write its output;
- a program's fixed costs (barrier setup, register reallocation, partition start) are paid once per SM, not once
  per tile.

Tile order. The grid is ``CH * n_mblk`` programs, ``CH = SMs // n_mblk`` (sequence, head) pairs times the query
blocks of each, and the tiles go in chunks of ``CH`` pairs, one chunk after another. Inside a chunk the query blocks
run heaviest first (every pair's block ``m`` before any block ``m - 1``: under the causal mask block ``m`` has
``m + 1`` key tiles) and every other chunk runs in reverse, so a program striding by the grid takes one heavy tile
and then one light one; when the pairs divide into chunks, the programs' work differs by at most the heaviest
tile's. Keeping a chunk's pairs together keeps their keys in L2: a first version ordered every pair's block
``m`` before any pair's block ``m - 1`` across the whole grid, and ran at 0.68-0.94x the non-persistent kernel
(H100, 2026-11-27); in chunks it ran 1.00-1.15x at head dim 128, S = 1k..16k (record
``benchmarks/results/sweeps/attention-ws-persistent-*``).
"""

from __future__ import annotations

import functools

import torch
import triton
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from lightning_llmopt.kernels.flash_attention_common import Geometry
from lightning_llmopt.kernels.flash_attention_ws_parts import (
    _LOG2E,
    LAUNCHES,
    _plain_loop,
    _tma_load,
    fresh_rows,
    kernel_operands,
    mma_layout,
    row_bounds,
    write_rows,
)
from lightning_llmopt.kernels.flash_attention_ws_plan import WsPlan


@gluon.jit
def _tile(t, n_mblk, BH, CH, num_heads, group, seq_q, seq_k, CU_SEQLENS, IS_CAUSAL: gl.constexpr,
          NCONS: gl.constexpr, BLOCK_N: gl.constexpr, IS_VARLEN: gl.constexpr):
    """Tile ``t`` of the order in the module docstring: ``(b, h, h_kv, start_m, key tiles, tok0, seq_q, seq_k)``;
    packed, sequence ``b`` is document ``b`` (rows ``tok0 ..`` of its length), and a block past its end has no key
    tile and writes nothing."""
    chunk = t // (CH * n_mblk)
    ch = gl.minimum(CH, BH - chunk * CH)  # the last chunk may hold fewer pairs
    r = t - chunk * (CH * n_mblk)
    if chunk % 2 == 1:
        r = ch * n_mblk - 1 - r
    pid_m = n_mblk - 1 - r // ch
    bh = chunk * CH + r % ch
    b = bh // num_heads
    h = bh % num_heads
    start_m = pid_m * (64 * NCONS)
    tok0 = 0
    if IS_VARLEN:
        tok0 = gl.load(CU_SEQLENS + b)
        seq_q = gl.load(CU_SEQLENS + b + 1) - tok0
        seq_k = seq_q
    hi = seq_k
    if IS_CAUSAL:
        hi = gl.maximum(gl.minimum(seq_k, start_m + 64 * NCONS + seq_k - seq_q), 0)
    n_tiles = gl.cdiv(hi, BLOCK_N)
    if start_m >= seq_q:
        n_tiles = 0
    return b, h, h // group, start_m, n_tiles, tok0, seq_q, seq_k


@gluon.jit
def _consumer(shared, ME: gl.constexpr, NCONS: gl.constexpr, HEAD_D: gl.constexpr, BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr, IS_VARLEN: gl.constexpr):
    """Query rows ``[64 ME, 64 ME + 64)`` of each of the program's tiles."""
    (q_smem, k_bufs, v_bufs, q_ready, q_empty, ready, empty, Out, LSE, CU_SEQLENS, stride_ob, stride_os, stride_oh,
     stride_lb, stride_lh, max_q, max_k, num_heads, group, n_mblk, BH, CH, total, qk_scale) = shared
    MMA_S: gl.constexpr = mma_layout(BLOCK_N)
    MMA_O: gl.constexpr = mma_layout(HEAD_D)
    it0 = 0  # the key/value ring position of the tile's first key tile
    local = 0  # the program's tiles so far (query buffer local % 2, its phase)
    for t in range(gl.program_id(0), total, gl.num_programs(0)):
        b, h, h_kv, start_m, n_tiles, tok0, seq_q, seq_k = _tile(t, n_mblk, BH, CH, num_heads, group, max_q, max_k,
                                                                 CU_SEQLENS, IS_CAUSAL, NCONS, BLOCK_N, IS_VARLEN)
        row0 = start_m + ME * 64
        q_off, full_hi = row_bounds(row0, seq_q, seq_k, BLOCK_N, IS_CAUSAL)
        qb = local % 2
        q_h = q_smem.index(qb * NCONS + ME)
        o, m_i, l_i = fresh_rows(HEAD_D, BLOCK_N)
        mbarrier.wait(q_ready.index(qb), (local // 2) & 1)
        o, m_i, l_i = _plain_loop(q_h, k_bufs, v_bufs, ready, empty, o, m_i, l_i, it0, n_tiles, row0, seq_k, q_off,
                                  full_hi, qk_scale, BLOCK_N, STAGES, IS_CAUSAL, MMA_S, MMA_O)
        mbarrier.arrive(q_empty.index(qb), count=1)  # every product reading this query buffer has retired
        it0 += n_tiles
        local += 1
        out_rows = Out + b.to(gl.int64) * stride_ob + h.to(gl.int64) * stride_oh
        lse_rows = LSE + b.to(gl.int64) * stride_lb + h.to(gl.int64) * stride_lh
        write_rows(o, m_i, l_i, out_rows, lse_rows, row0, tok0, seq_q, stride_os, HEAD_D, MMA_S, MMA_O)


@gluon.jit
def _loader(loads, NCONS: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr,
            IS_VARLEN: gl.constexpr):
    """Per tile: its query rows into a free query buffer, then its key/value tiles into the ring."""
    (q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_ready, q_empty, ready, empty, maps, max_q, max_k, num_heads,
     group, n_mblk, BH, CH, total, CU_SEQLENS) = loads
    q_rb, q_rh, q_ch, k_rb, k_rh, k_ch, v_rb, v_rh, v_ch = maps
    it = 0
    local = 0
    for t in range(gl.program_id(0), total, gl.num_programs(0)):
        b, h, h_kv, start_m, n_tiles, tok0, _, _ = _tile(t, n_mblk, BH, CH, num_heads, group, max_q, max_k, CU_SEQLENS,
                                                         IS_CAUSAL, NCONS, BLOCK_N, IS_VARLEN)
        qb = local % 2
        mbarrier.wait(q_empty.index(qb), ((local // 2) & 1) ^ 1)  # a fresh barrier passes the first round
        bar = q_ready.index(qb)
        mbarrier.expect(bar, NCONS * q_desc.block_type.nbytes)
        q_row = tok0 + b * q_rb + h * q_rh + start_m
        for i in gl.static_range(NCONS):
            _tma_load(q_desc, [q_row + 64 * i, h * q_ch], bar, q_smem.index(qb * NCONS + i))
        k_row = tok0 + b * k_rb + h_kv * k_rh
        v_row = tok0 + b * v_rb + h_kv * v_rh
        for j in range(n_tiles):
            stage = it % STAGES
            mbarrier.wait(empty.index(stage), ((it // STAGES) & 1) ^ 1)
            kv = ready.index(stage)
            mbarrier.expect(kv, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
            _tma_load(k_desc, [k_row + j * BLOCK_N, h_kv * k_ch], kv, k_bufs.index(stage))
            _tma_load(v_desc, [v_row + j * BLOCK_N, h_kv * v_ch], kv, v_bufs.index(stage))
            it += 1
        local += 1


@gluon.jit
def _ws_fwd_persistent_kernel(q_desc, k_desc, v_desc, Out, LSE, CU_SEQLENS, q_rb, q_rh, q_ch, k_rb, k_rh, k_ch, v_rb,
                              v_rh, v_ch, stride_ob, stride_os, stride_oh, stride_lb, stride_lh, seq_q, seq_k,
                              num_heads, group, n_mblk, BH, CH, qk_scale, HEAD_D: gl.constexpr,
                              BLOCK_N: gl.constexpr, STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr,
                              NCONS: gl.constexpr, CONSUMER_REGS: gl.constexpr, IS_VARLEN: gl.constexpr):
    total = n_mblk * BH
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [2 * NCONS, 64, HEAD_D], q_desc.layout)
    k_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=NCONS)  # every consumer releases a query buffer
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=NCONS)
    fence_async_shared()
    shared = (q_smem, k_bufs, v_bufs, q_ready, q_empty, ready, empty, Out, LSE, CU_SEQLENS, stride_ob, stride_os,
              stride_oh, stride_lb, stride_lh, seq_q, seq_k, num_heads, group, n_mblk, BH, CH, total, qk_scale)
    loads = (q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_ready, q_empty, ready, empty,
             (q_rb, q_rh, q_ch, k_rb, k_rh, k_ch, v_rb, v_rh, v_ch), seq_q, seq_k, num_heads, group, n_mblk, BH, CH,
             total, CU_SEQLENS)
    gl.static_assert(NCONS == 2, "the persistent forward runs two consumer warpgroups")
    gl.warp_specialize([(_consumer, (shared, 0, NCONS, HEAD_D, BLOCK_N, STAGES, IS_CAUSAL, IS_VARLEN)),
                        (_consumer, (shared, 1, NCONS, HEAD_D, BLOCK_N, STAGES, IS_CAUSAL, IS_VARLEN)),
                        (_loader, (loads, NCONS, BLOCK_N, STAGES, IS_CAUSAL, IS_VARLEN))], [4, 1], [CONSUMER_REGS, 24])


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def persistent_grid(n_mblk: int, pairs: int, sms: int) -> tuple[int, int]:
    """``(programs, CH)``: ``CH`` (sequence, head) pairs a chunk and one program per tile of a chunk, at most one
    program per SM (module docstring)."""
    chunk = max(1, min(pairs, sms // n_mblk))
    programs = sms if n_mblk > sms else chunk * n_mblk
    return min(programs, n_mblk * pairs), chunk


def ws_fwd_persistent(q: Tensor, k: Tensor, v: Tensor, geo: Geometry, causal: bool, scale: float,
                      plan: WsPlan) -> tuple[Tensor, Tensor] | None:
    """``(out, lse)`` as :func:`~lightning_llmopt.kernels.flash_attention_fwd_ws.ws_fwd` returns them, from the
    persistent kernel (``plan``: two consumers, plain schedule), or ``None`` where it does not take the call.

    It takes dense input, and packed input whose documents all have the longest one's length (``documents *
    max_seqlen == total``, known on the host without reading ``cu_seqlens``): every pair then has the same query
    blocks and the tile order balances them as in a dense batch. (Ragged packs go to the one-program-per-tile
    kernel, where the hardware balances them; the kernel itself reads each document's bounds from ``cu_seqlens``
    either way.)"""
    packed = geo.cu_seqlens is not None
    if packed and geo.batch * geo.seq_q != geo.total:
        return None
    out, lse, operands = kernel_operands(q, k, v, geo, plan.block_n)
    n_mblk = triton.cdiv(geo.seq_q, 64 * plan.consumers)
    pairs = geo.batch * geo.num_heads
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    programs, chunk = persistent_grid(n_mblk, pairs, _sm_count(index))
    args = (*operands, n_mblk, pairs, chunk, scale * _LOG2E)
    consts = dict(HEAD_D=geo.head_dim, BLOCK_N=plan.block_n, STAGES=plan.stages, IS_CAUSAL=causal,
                  NCONS=plan.consumers, CONSUMER_REGS=plan.consumer_regs, IS_VARLEN=packed)
    LAUNCHES.launch(_ws_fwd_persistent_kernel, ("persistent", plan, geo.head_dim, causal, packed), (programs,), args,
                    consts, {"num_warps": 4, "maxnreg": plan.maxnreg})
    return out, lse


__all__ = ["persistent_grid", "ws_fwd_persistent"]
