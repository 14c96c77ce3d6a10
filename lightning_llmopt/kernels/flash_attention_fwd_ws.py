"""A warp-specialized flash-attention forward for Hopper (sm_90) in Gluon, FA3's structure.

One program per ``64 NCONS`` query rows of one (sequence, head), in ``NCONS + 1`` partitions:

- ``NCONS`` (2 or 3) consumers of one warpgroup (4 warps) each, on 64 query rows of the block: per key tile
  ``s = q k^T`` (asynchronous WGMMA, both operands in shared memory), the online softmax in registers (masks only
  on the causal diagonal and the ragged end), ``o += p v`` with ``p`` as the register operand, then the release of
  the stage;
- one loader warp: TMA copies of the query rows, then of each key/value tile into a ring of ``STAGES`` stages,
  behind mbarriers (``ready``: the bytes landed; ``empty``: every consumer released the stage).

In the plain schedule the consumers run the same loop independently, so one's softmax runs while another's products
occupy the tensor cores. The ping-pong schedule (``PP``) makes that explicit: each consumer issues ``o += p_{j-1}
v_{j-1}`` and ``s_j = q k_j^T`` together, only in its turn, handed round the consumers on named barriers (ids 8..10,
above the ones Triton gives the partitions), and runs its softmax while the next consumer's products run.
Register budgets move from the loader (24 a thread) to the consumers with ``setmaxnreg``.

Which schedule, if any, takes a call is decided on the host (:mod:`flash_attention_ws_plan`).

Each tensor is viewed as a 2-D row-major matrix for its TMA descriptor: dense ``(B, S, H, D)`` contiguous (rows
``b S + s``, columns ``h D + d``), dense ``(B, H, S, D)`` storage seen through a transposed view (rows
``(b H + h) S + s``), or packed ``(total, H, D)`` with heads side by side (rows are tokens; document ``b`` of
``cu_seqlens`` is rows ``[tok0, tok0 + length)``). The grid covers the longest document; a block past its own
document's end returns before it sets anything up (without that, a pack of one long and many short documents ran
at half speed). Rows of a tile past the sequence are read from the next sequence, head or document (zero-filled
past the tensor) and masked, so their probabilities are exactly 0. Outputs are written with ordinary stores through
``out``'s strides; ``lse`` is natural-log, ``-inf`` and output 0 on a row that sees no key.
"""

from __future__ import annotations

import functools

import torch
import triton
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from lightning_llmopt.kernels.flash_attention_common import Geometry
from lightning_llmopt.kernels.flash_attention_ws_plan import WsPlan, tma_rows
from lightning_llmopt.kernels.launch_cache import LaunchCache

# TMA copy into shared memory: ``async_copy_global_to_shared`` up to Triton 3.6, ``async_load`` later
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_LOG2E = 1.4426950408889634


# launches after the first of each (kernel, plan, head dim, mask, packing) skip JITFunction.run (launch_cache.py)
LAUNCHES = LaunchCache()
_NAMED_BAR0 = gl.constexpr(8)  # the ping-pong's named barriers: 8 + consumer


@gluon.jit
def _softmax_tile(s, m_i, l_i, start_n, row0, seq_k, q_off, full_hi, qk_scale, BLOCK_N: gl.constexpr,
                  IS_CAUSAL: gl.constexpr, MMA_S: gl.constexpr):
    """Probabilities of one score tile, the running output's rescale factor, the new row max and row sum."""
    if start_n >= full_hi:  # the causal diagonal or the ragged end
        offs_n = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, MMA_S))
        offs_m = row0 + gl.arange(0, 64, layout=gl.SliceLayout(1, MMA_S))
        ok = offs_n[None, :] < seq_k
        if IS_CAUSAL:
            ok = ok & (offs_n[None, :] <= offs_m[:, None] + q_off)
        s = gl.where(ok, s * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # rows that see no key yet
        p = gl.exp2(s - m_use[:, None])
    else:  # the scale is positive: it commutes with the max and rides on the subtraction
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        m_use = m_new
        p = gl.exp2(s * qk_scale - m_use[:, None])
    alpha = gl.exp2(m_i - m_use)
    return p, alpha, m_new, l_i * alpha + gl.sum(p, 1)


@gluon.jit
def _named_bar(bar_id: gl.constexpr, ARRIVE: gl.constexpr):
    """``bar.arrive`` (``ARRIVE``) or ``bar.sync`` on named barrier ``bar_id``, counting two warpgroups' threads;
    one element a thread, so each thread executes it once."""
    ids = gl.full([128], bar_id, gl.int32, gl.BlockedLayout([1], [32], [4], [0]))
    if ARRIVE:
        gl.inline_asm_elementwise("bar.arrive $1, 256; mov.u32 $0, 0;", "=r,r", [ids], dtype=gl.int32,
                                  is_pure=False, pack=1)
    else:
        gl.inline_asm_elementwise("bar.sync $1, 256; mov.u32 $0, 0;", "=r,r", [ids], dtype=gl.int32,
                                  is_pure=False, pack=1)


@gluon.jit
def _plain_loop(q_h, k_bufs, v_bufs, ready, empty, o, m_i, l_i, it0, n_tiles, row0, seq_k, q_off, full_hi,
                qk_scale, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr, MMA_S: gl.constexpr,
                MMA_O: gl.constexpr):
    """Per key tile: ``s = q k^T``, softmax, ``o += p v``, each product retired before the next step. The tiles
    are the ring's ``it0``-th onwards (0 here; the persistent kernel's ring runs on across its tiles)."""
    OP_A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA_O, k_width=2)
    zero_s = gl.zeros([64, BLOCK_N], gl.float32, MMA_S)
    for j in range(n_tiles):
        stage = (it0 + j) % STAGES
        mbarrier.wait(ready.index(stage), ((it0 + j) // STAGES) & 1)
        s = warpgroup_mma(q_h, k_bufs.index(stage).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        p, alpha, m_i, l_i = _softmax_tile(s, m_i, l_i, j * BLOCK_N, row0, seq_k, q_off, full_hi, qk_scale,
                                           BLOCK_N, IS_CAUSAL, MMA_S)
        o = o * gl.convert_layout(alpha, gl.SliceLayout(1, MMA_O))[:, None]
        o = warpgroup_mma(gl.convert_layout(p.to(q_h.dtype), OP_A), v_bufs.index(stage), o, is_async=True)
        o = warpgroup_mma_wait(num_outstanding=0, deps=(o,))
        mbarrier.arrive(empty.index(stage), count=1)
    return o, m_i, l_i


@gluon.jit
def _pingpong_loop(q_h, k_bufs, v_bufs, ready, empty, o, m_i, l_i, n_tiles, row0, seq_k, q_off, full_hi, qk_scale,
                   ME: gl.constexpr, NCONS: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                   IS_CAUSAL: gl.constexpr, MMA_S: gl.constexpr, MMA_O: gl.constexpr):
    """The ping-pong schedule (module docstring); needs ``n_tiles >= 1``. Consumer ``ME`` waits on barrier ``8 +
    ME`` before issuing its products and arrives on the next consumer's after; consumer 0 opens the round itself
    and the last consumer skips its final hand-off, so every barrier ends with as many arrivals as waits. No
    product is in flight across a wait (ptxas would serialize every WGMMA of the kernel)."""
    OP_A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA_O, k_width=2)
    MINE: gl.constexpr = _NAMED_BAR0 + ME
    NEXT: gl.constexpr = _NAMED_BAR0 + (ME + 1) % NCONS
    zero_s = gl.zeros([64, BLOCK_N], gl.float32, MMA_S)
    if ME == 0:
        _named_bar(MINE, True)
    mbarrier.wait(ready.index(0), 0)
    _named_bar(MINE, False)
    s = warpgroup_mma(q_h, k_bufs.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    _named_bar(NEXT, True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
    p, alpha, m_i, l_i = _softmax_tile(s, m_i, l_i, 0, row0, seq_k, q_off, full_hi, qk_scale, BLOCK_N, IS_CAUSAL,
                                       MMA_S)
    p_op = gl.convert_layout(p.to(q_h.dtype), OP_A)
    for j in range(1, n_tiles):
        stage = j % STAGES
        prev = (j - 1) % STAGES
        mbarrier.wait(ready.index(stage), (j // STAGES) & 1)
        _named_bar(MINE, False)
        o = warpgroup_mma(p_op, v_bufs.index(prev), o, is_async=True)
        s = warpgroup_mma(q_h, k_bufs.index(stage).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        _named_bar(NEXT, True)
        o, s = warpgroup_mma_wait(num_outstanding=0, deps=(o, s))
        mbarrier.arrive(empty.index(prev), count=1)
        p, alpha, m_i, l_i = _softmax_tile(s, m_i, l_i, j * BLOCK_N, row0, seq_k, q_off, full_hi, qk_scale,
                                           BLOCK_N, IS_CAUSAL, MMA_S)
        o = o * gl.convert_layout(alpha, gl.SliceLayout(1, MMA_O))[:, None]
        p_op = gl.convert_layout(p.to(q_h.dtype), OP_A)
    last = (n_tiles - 1) % STAGES
    _named_bar(MINE, False)
    o = warpgroup_mma(p_op, v_bufs.index(last), o, is_async=True)
    if ME != NCONS - 1:
        _named_bar(NEXT, True)
    o = warpgroup_mma_wait(num_outstanding=0, deps=(o,))
    mbarrier.arrive(empty.index(last), count=1)
    return o, m_i, l_i


@gluon.jit
def _consumer(shared, ME: gl.constexpr, NCONS: gl.constexpr, PP: gl.constexpr, HEAD_D: gl.constexpr,
              BLOCK_N: gl.constexpr, STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr):
    """Query rows ``[64 ME, 64 ME + 64)`` of the block: the key tiles in order, then the output and ``lse``.
    ``shared``: the arguments every consumer of the program gets (the kernel's ``shared`` tuple)."""
    (q_smem, k_bufs, v_bufs, q_bar, ready, empty, Out, LSE, stride_ob, stride_os, stride_oh, stride_lb, stride_lh, b, h,
     start_m, n_tiles, seq_q, seq_k, qk_scale, tok0) = shared
    MMA_S: gl.constexpr = mma_layout(BLOCK_N)
    MMA_O: gl.constexpr = mma_layout(HEAD_D)
    row0 = start_m + ME * 64
    q_off, full_hi = row_bounds(row0, seq_q, seq_k, BLOCK_N, IS_CAUSAL)
    q_h = q_smem.index(ME)
    o, m_i, l_i = fresh_rows(HEAD_D, BLOCK_N)
    mbarrier.wait(q_bar, 0)
    if PP:
        if n_tiles > 0:  # the same for every consumer of the block, so the barriers stay matched
            o, m_i, l_i = _pingpong_loop(q_h, k_bufs, v_bufs, ready, empty, o, m_i, l_i, n_tiles, row0, seq_k, q_off,
                                         full_hi, qk_scale, ME, NCONS, BLOCK_N, STAGES, IS_CAUSAL, MMA_S, MMA_O)
    else:
        o, m_i, l_i = _plain_loop(q_h, k_bufs, v_bufs, ready, empty, o, m_i, l_i, 0, n_tiles, row0, seq_k, q_off,
                                  full_hi, qk_scale, BLOCK_N, STAGES, IS_CAUSAL, MMA_S, MMA_O)
    out_rows = Out + b.to(gl.int64) * stride_ob + h.to(gl.int64) * stride_oh
    lse_rows = LSE + b.to(gl.int64) * stride_lb + h.to(gl.int64) * stride_lh
    write_rows(o, m_i, l_i, out_rows, lse_rows, row0, tok0, seq_q, stride_os, HEAD_D, MMA_S, MMA_O)


@gluon.constexpr_function
def mma_layout(n):  # type: ignore[no-untyped-def]
    """The WGMMA accumulator layout of a warpgroup's ``64 x n`` product."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])


@gluon.jit
def row_bounds(row0, seq_q, seq_k, BLOCK_N: gl.constexpr, IS_CAUSAL: gl.constexpr):
    """``(q_off, full_hi)`` of the 64 query rows from ``row0``: the causal mask's bottom-right offset, and the key
    index below which tiles need no mask."""
    q_off = seq_k - seq_q
    full_hi = (seq_k // BLOCK_N) * BLOCK_N
    if IS_CAUSAL:
        full_hi = gl.minimum(full_hi, ((row0 + q_off + 1) // BLOCK_N) * BLOCK_N)
    return q_off, full_hi


@gluon.jit
def fresh_rows(HEAD_D: gl.constexpr, BLOCK_N: gl.constexpr):
    """The output accumulator, row max and row sum of 64 query rows before any key."""
    o = gl.zeros([64, HEAD_D], gl.float32, mma_layout(HEAD_D))
    m_i = gl.full([64], float("-inf"), gl.float32, gl.SliceLayout(1, mma_layout(BLOCK_N)))
    l_i = gl.zeros([64], gl.float32, gl.SliceLayout(1, mma_layout(BLOCK_N)))
    return o, m_i, l_i


@gluon.jit
def write_rows(o, m_i, l_i, out_rows, lse_rows, row0, tok0, seq_q, stride_os, HEAD_D: gl.constexpr,
               MMA_S: gl.constexpr, MMA_O: gl.constexpr):
    """``o / l`` to the rows ``row0 + i < seq_q`` of a sequence starting ``tok0`` rows (stride ``stride_os``) after
    ``out_rows``, and their natural-log ``lse`` (``-inf`` where no key was visible, with output 0) after
    ``lse_rows``."""
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, MMA_O))
    out = o / gl.where(l_o == 0.0, 1.0, l_o)[:, None]
    offs_m = row0 + gl.arange(0, 64, layout=gl.SliceLayout(1, MMA_O))
    offs_d = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, MMA_O))
    o_ptrs = out_rows + (tok0 + offs_m[:, None]).to(gl.int64) * stride_os + offs_d[None, :]
    gl.store(o_ptrs, out.to(out_rows.dtype.element_ty), mask=offs_m[:, None] < seq_q)
    lse = (m_i + gl.log2(l_i)) * 0.6931471805599453
    offs_l = row0 + gl.arange(0, 64, layout=gl.SliceLayout(1, MMA_S))
    gl.store(lse_rows + tok0 + offs_l, lse, mask=offs_l < seq_q)


@gluon.jit
def _loader(loads, NCONS: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """The consumers' query rows once, then each key/value tile into the next free stage."""
    (q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_bar, ready, empty, q_row, q_col, k_row, k_col, v_row, v_col,
     n_tiles) = loads
    mbarrier.expect(q_bar, NCONS * q_desc.block_type.nbytes)
    for i in gl.static_range(NCONS):
        _tma_load(q_desc, [q_row + 64 * i, q_col], q_bar, q_smem.index(i))
    for j in range(n_tiles):
        stage = j % STAGES
        mbarrier.wait(empty.index(stage), ((j // STAGES) & 1) ^ 1)  # a fresh barrier passes the first round
        bar = ready.index(stage)
        mbarrier.expect(bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        _tma_load(k_desc, [k_row + j * BLOCK_N, k_col], bar, k_bufs.index(stage))
        _tma_load(v_desc, [v_row + j * BLOCK_N, v_col], bar, v_bufs.index(stage))


@gluon.jit
def _ws_fwd_kernel(q_desc, k_desc, v_desc, Out, LSE, CU_SEQLENS, q_rb, q_rh, q_ch, k_rb, k_rh, k_ch, v_rb, v_rh,
                   v_ch, stride_ob, stride_os, stride_oh, stride_lb, stride_lh, seq_q, seq_k, num_heads, group,
                   qk_scale, HEAD_D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                   IS_CAUSAL: gl.constexpr, NCONS: gl.constexpr, PP: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                   IS_VARLEN: gl.constexpr):
    pid_m = gl.num_programs(0) - 1 - gl.program_id(0)  # causal blocks late in the sequence have the most work
    pid_bh = gl.program_id(1)
    b = pid_bh // num_heads
    h = pid_bh % num_heads
    h_kv = h // group
    start_m = pid_m * (64 * NCONS)
    tok0 = 0
    if IS_VARLEN:  # document b: rows [tok0, tok0 + length) of the packed tensors
        tok0 = gl.load(CU_SEQLENS + b)
        seq_q = gl.load(CU_SEQLENS + b + 1) - tok0
        seq_k = seq_q
        if start_m >= seq_q:  # a block past the document's end (the grid covers the longest): nothing to do
            return
    hi = seq_k
    if IS_CAUSAL:
        hi = gl.maximum(gl.minimum(seq_k, start_m + 64 * NCONS + seq_k - seq_q), 0)
    n_tiles = gl.cdiv(hi, BLOCK_N)
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [NCONS, 64, HEAD_D], q_desc.layout)
    k_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=NCONS)  # every consumer releases a stage
    fence_async_shared()
    q_row = tok0 + b * q_rb + h * q_rh + start_m
    k_row = tok0 + b * k_rb + h_kv * k_rh
    v_row = tok0 + b * v_rb + h_kv * v_rh
    shared = (q_smem, k_bufs, v_bufs, q_bar, ready, empty, Out, LSE, stride_ob, stride_os, stride_oh, stride_lb,
              stride_lh, b, h, start_m, n_tiles, seq_q, seq_k, qk_scale, tok0)
    loads = (q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_bar, ready, empty, q_row, h * q_ch, k_row, h_kv * k_ch,
             v_row, h_kv * v_ch, n_tiles)
    if NCONS == 2:
        gl.warp_specialize([(_consumer, (shared, 0, NCONS, PP, HEAD_D, BLOCK_N, STAGES, IS_CAUSAL)),
                            (_consumer, (shared, 1, NCONS, PP, HEAD_D, BLOCK_N, STAGES, IS_CAUSAL)),
                            (_loader, (loads, NCONS, BLOCK_N, STAGES))], [4, 1], [CONSUMER_REGS, 24])
    else:
        gl.warp_specialize([(_consumer, (shared, 0, NCONS, PP, HEAD_D, BLOCK_N, STAGES, IS_CAUSAL)),
                            (_consumer, (shared, 1, NCONS, PP, HEAD_D, BLOCK_N, STAGES, IS_CAUSAL)),
                            (_consumer, (shared, 2, NCONS, PP, HEAD_D, BLOCK_N, STAGES, IS_CAUSAL)),
                            (_loader, (loads, NCONS, BLOCK_N, STAGES))], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, 24])


@functools.cache
def _smem_layout(block_rows: int, head_dim: int, bf16: bool):  # type: ignore[no-untyped-def]
    return gl.NVMMASharedLayout.get_default_for([block_rows, head_dim], gl.bfloat16 if bf16 else gl.float16)


def _descriptor(t: Tensor, block_rows: int) -> tuple[TensorDescriptor, tuple[int, int, int]]:
    rows, row_stride, per_b, per_h, col_h = tma_rows(t)  # type: ignore[misc]
    D = t.shape[-1]
    layout = _smem_layout(block_rows, D, t.dtype == torch.bfloat16)
    cols = t.shape[-2] * D if col_h else D  # a row holds every head ((B, S, H, D), packed), or one head's values
    desc = TensorDescriptor(t, [rows, cols], [row_stride, 1], [block_rows, D], layout)
    return desc, (per_b, per_h, col_h)


def kernel_operands(q: Tensor, k: Tensor, v: Tensor, geo: Geometry, block_n: int) -> tuple[Tensor, Tensor, tuple]:
    """``(out, lse, operands)``: fresh outputs and the arguments both forward kernels begin with (descriptors,
    outputs, ``cu_seqlens``, row maps, output strides, lengths, heads, GQA group)."""
    packed = geo.cu_seqlens is not None
    out = torch.empty_like(q)
    lse = q.new_empty(geo.lse_shape, dtype=torch.float32)  # torch.empty(device=...) took 6 us of host time (H100)
    q_desc, q_map = _descriptor(q, 64)
    k_desc, k_map = _descriptor(k, block_n)
    v_desc, v_map = _descriptor(v, block_n)
    # strides of out (batch, sequence, head) and lse (batch, head); packed: no batch stride, tok0 offsets instead
    sb, ss, sh = (0, *out.stride()[:2]) if packed else out.stride()[:3]
    lb, lh = (0, lse.stride(0)) if packed else lse.stride()[:2]
    operands = (q_desc, k_desc, v_desc, out, lse, geo.cu_seqlens if packed else lse, *q_map, *k_map, *v_map, sb, ss,
                sh, lb, lh, geo.seq_q, geo.seq_k, geo.num_heads, geo.group)
    return out, lse, operands


def ws_fwd(q: Tensor, k: Tensor, v: Tensor, geo: Geometry, causal: bool, scale: float,
           plan: WsPlan) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` as :func:`~lightning_llmopt.kernels.flash_attention_fwd.flash_fwd` returns them, launched by
    ``plan`` (from :func:`ws_plan`)."""
    packed = geo.cu_seqlens is not None
    if plan.persistent:
        from lightning_llmopt.kernels.flash_attention_fwd_ws_persistent import ws_fwd_persistent

        taken = ws_fwd_persistent(q, k, v, geo, causal, scale, plan)
        if taken is not None:
            return taken
    out, lse, operands = kernel_operands(q, k, v, geo, plan.block_n)
    grid = (triton.cdiv(geo.seq_q, 64 * plan.consumers), geo.batch * geo.num_heads)
    args = (*operands, scale * _LOG2E)
    consts = dict(HEAD_D=geo.head_dim, BLOCK_N=plan.block_n, STAGES=plan.stages, IS_CAUSAL=causal,
                  NCONS=plan.consumers, PP=plan.pingpong, CONSUMER_REGS=plan.consumer_regs, IS_VARLEN=packed)
    LAUNCHES.launch(_ws_fwd_kernel, ("ws", plan, geo.head_dim, causal, packed), grid, args, consts,
                    {"num_warps": 4, "maxnreg": plan.maxnreg})
    return out, lse


__all__ = ["kernel_operands", "ws_fwd"]
