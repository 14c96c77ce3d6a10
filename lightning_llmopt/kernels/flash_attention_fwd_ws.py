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

Which schedule, if any, takes a call is decided on the host (:mod:`flash_attention_ws_plan`). The pieces this
kernel shares with its persistent form (:mod:`flash_attention_fwd_ws_persistent`) are in
:mod:`flash_attention_ws_parts`.

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

import triton
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from lightning_llmopt.kernels.flash_attention_common import Geometry
from lightning_llmopt.kernels.flash_attention_fwd_ws_persistent import ws_fwd_persistent
from lightning_llmopt.kernels.flash_attention_ws_parts import (
    _LOG2E,
    LAUNCHES,
    _plain_loop,
    _softmax_tile,
    _tma_load,
    fresh_rows,
    kernel_operands,
    mma_layout,
    row_bounds,
    write_rows,
)
from lightning_llmopt.kernels.flash_attention_ws_plan import WsPlan

_NAMED_BAR0 = gl.constexpr(8)  # the ping-pong's named barriers: 8 + consumer


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


def ws_fwd(q: Tensor, k: Tensor, v: Tensor, geo: Geometry, causal: bool, scale: float,
           plan: WsPlan) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` as :func:`~lightning_llmopt.kernels.flash_attention_fwd.flash_fwd` returns them, launched by
    ``plan`` (from :func:`ws_plan`)."""
    packed = geo.cu_seqlens is not None
    if plan.persistent:
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
