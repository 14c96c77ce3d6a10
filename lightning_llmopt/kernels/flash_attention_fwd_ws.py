"""A warp-specialized flash-attention forward for Hopper (sm_90) in Gluon, FA3's structure (opt-in).

One program per 128 query rows of one (sequence, head), in three partitions:

- two consumers of one warpgroup (4 warps) each, on query rows ``[0, 64)`` and ``[64, 128)`` of the block: per key
  tile ``s = q k^T`` (asynchronous WGMMA, both operands in shared memory), the online softmax in registers (masks
  only on the causal diagonal and the ragged end), ``o += p v`` with ``p`` as the register operand, then the
  release of the stage;
- one loader warp: TMA copies of the two query halves, then of each key/value tile into a ring of ``STAGES`` stages,
  behind mbarriers (``ready``: the bytes landed; ``empty``: both consumers released the stage).

The two consumers run the same loop independently, so one's softmax runs while the other's products occupy the
tensor cores; register budgets are moved from the loader (24 a thread) to the consumers (240) with ``setmaxnreg``.

Dense inputs only, in one of two layouts per tensor, viewed as 2-D row-major matrices for the TMA descriptors:
``(B, S, H, D)`` contiguous (rows ``b S + s``, columns ``h D + d``) or ``(B, H, S, D)`` storage seen through a
transposed view (rows ``(b H + h) S + s``). Rows of a tile past the sequence are read from the next sequence or
head (zero-filled past the tensor) and masked, so their probabilities are exactly 0. Outputs are written with
ordinary stores through ``out``'s strides; ``lse`` is natural-log, ``-inf`` and output 0 on a row that sees no key.

Selected by ``LLMOPT_FLASH_FWD=ws`` (:func:`ws_supported` says where it applies); measured against the Triton
forward and SDPA-cuDNN in docs/flash_attention.md.
"""

from __future__ import annotations

import os

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

# TMA copy into shared memory: ``async_copy_global_to_shared`` up to Triton 3.6, ``async_load`` later
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_LOG2E = 1.4426950408889634
# (BLOCK_N, STAGES) by head dim: the best of an H100 sweep at hd128 (B*S = 16k, S 1k..16k, 2026-11-27); hd64 not
# yet swept
_LAUNCH = {64: (128, 3), 128: (128, 2)}
_MAXNREG = 168  # 12 warps a program (three warpgroups) x 168 registers fit the register file


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
def _consumer(q_smem, k_bufs, v_bufs, q_bar, ready, empty, Out, LSE, stride_ob, stride_os, stride_oh, stride_lb,
              stride_lh, b, h, start_m, n_tiles, seq_q, seq_k, qk_scale, HALF: gl.constexpr, HEAD_D: gl.constexpr,
              BLOCK_N: gl.constexpr, STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr):
    """Query rows ``[64 HALF, 64 HALF + 64)`` of the block: the key tiles in order, then the output and ``lse``."""
    MMA_S: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                    instr_shape=[16, BLOCK_N, 16])
    MMA_O: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                    instr_shape=[16, HEAD_D, 16])
    OP_A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA_O, k_width=2)
    row0 = start_m + HALF * 64
    q_off = seq_k - seq_q  # bottom-right alignment of the causal mask
    full_hi = (seq_k // BLOCK_N) * BLOCK_N  # tiles below it need no mask
    if IS_CAUSAL:
        full_hi = gl.minimum(full_hi, ((row0 + q_off + 1) // BLOCK_N) * BLOCK_N)
    q_h = q_smem.index(HALF)
    zero_s = gl.zeros([64, BLOCK_N], gl.float32, MMA_S)
    o = gl.zeros([64, HEAD_D], gl.float32, MMA_O)
    m_i = gl.full([64], float("-inf"), gl.float32, gl.SliceLayout(1, MMA_S))
    l_i = gl.zeros([64], gl.float32, gl.SliceLayout(1, MMA_S))
    mbarrier.wait(q_bar, 0)
    for j in range(n_tiles):
        stage = j % STAGES
        mbarrier.wait(ready.index(stage), (j // STAGES) & 1)
        s = warpgroup_mma(q_h, k_bufs.index(stage).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        p, alpha, m_i, l_i = _softmax_tile(s, m_i, l_i, j * BLOCK_N, row0, seq_k, q_off, full_hi, qk_scale,
                                           BLOCK_N, IS_CAUSAL, MMA_S)
        o = o * gl.convert_layout(alpha, gl.SliceLayout(1, MMA_O))[:, None]
        o = warpgroup_mma(gl.convert_layout(p.to(q_smem.dtype), OP_A), v_bufs.index(stage), o, is_async=True)
        o = warpgroup_mma_wait(num_outstanding=0, deps=(o,))
        mbarrier.arrive(empty.index(stage), count=1)
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, MMA_O))
    out = o / gl.where(l_o == 0.0, 1.0, l_o)[:, None]
    offs_m = row0 + gl.arange(0, 64, layout=gl.SliceLayout(1, MMA_O))
    offs_d = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, MMA_O))
    o_ptrs = (Out + b.to(gl.int64) * stride_ob + h.to(gl.int64) * stride_oh
              + offs_m[:, None].to(gl.int64) * stride_os + offs_d[None, :])
    gl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=offs_m[:, None] < seq_q)
    lse = (m_i + gl.log2(l_i)) * 0.6931471805599453  # -inf where no key was visible
    offs_l = row0 + gl.arange(0, 64, layout=gl.SliceLayout(1, MMA_S))
    gl.store(LSE + b.to(gl.int64) * stride_lb + h.to(gl.int64) * stride_lh + offs_l, lse, mask=offs_l < seq_q)


@gluon.jit
def _loader(q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_bar, ready, empty, q_row, q_col, k_row, k_col, v_row,
            v_col, n_tiles, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """The query halves once, then each key/value tile into the next free stage."""
    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
    _tma_load(q_desc, [q_row, q_col], q_bar, q_smem.index(0))
    _tma_load(q_desc, [q_row + 64, q_col], q_bar, q_smem.index(1))
    for j in range(n_tiles):
        stage = j % STAGES
        mbarrier.wait(empty.index(stage), ((j // STAGES) & 1) ^ 1)  # a fresh barrier passes the first round
        bar = ready.index(stage)
        mbarrier.expect(bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        _tma_load(k_desc, [k_row + j * BLOCK_N, k_col], bar, k_bufs.index(stage))
        _tma_load(v_desc, [v_row + j * BLOCK_N, v_col], bar, v_bufs.index(stage))


@gluon.jit
def _ws_fwd_kernel(q_desc, k_desc, v_desc, Out, LSE, q_rb, q_rh, q_ch, k_rb, k_rh, k_ch, v_rb, v_rh, v_ch,
                   stride_ob, stride_os, stride_oh, stride_lb, stride_lh, seq_q, seq_k, num_heads, group, qk_scale,
                   HEAD_D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr):
    pid_m = gl.num_programs(0) - 1 - gl.program_id(0)  # causal blocks late in the sequence have the most work
    pid_bh = gl.program_id(1)
    b = pid_bh // num_heads
    h = pid_bh % num_heads
    h_kv = h // group
    start_m = pid_m * 128
    hi = seq_k
    if IS_CAUSAL:
        hi = gl.maximum(gl.minimum(seq_k, start_m + 128 + seq_k - seq_q), 0)
    n_tiles = gl.cdiv(hi, BLOCK_N)
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [2, 64, HEAD_D], q_desc.layout)
    k_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both consumers release a stage
    fence_async_shared()
    # fmt: off
    gl.warp_specialize([
        (_consumer, (q_smem, k_bufs, v_bufs, q_bar, ready, empty, Out, LSE, stride_ob, stride_os, stride_oh, stride_lb,
                     stride_lh, b, h, start_m, n_tiles, seq_q, seq_k, qk_scale, 0, HEAD_D, BLOCK_N, STAGES,
                     IS_CAUSAL)),
        (_consumer, (q_smem, k_bufs, v_bufs, q_bar, ready, empty, Out, LSE, stride_ob, stride_os, stride_oh, stride_lb,
                     stride_lh, b, h, start_m, n_tiles, seq_q, seq_k, qk_scale, 1, HEAD_D, BLOCK_N, STAGES,
                     IS_CAUSAL)),
        (_loader, (q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_bar, ready, empty,
                   b * q_rb + h * q_rh + start_m, h * q_ch, b * k_rb + h_kv * k_rh, h_kv * k_ch,
                   b * v_rb + h_kv * v_rh, h_kv * v_ch, n_tiles, BLOCK_N, STAGES)),
    ], [4, 1], [240, 24])
    # fmt: on


def tma_rows(t: Tensor) -> tuple[int, int, int, int, int] | None:
    """How a dense ``(B, S, H, D)`` tensor ``t`` is seen as a 2-D row-major matrix for TMA: ``(rows, row_stride,
    row_per_b, row_per_h, col_per_h)`` (element ``(b, s, h, d)`` at row ``b row_per_b + h row_per_h + s``, column
    ``h col_per_h + d``), or ``None`` for other strides. ``(B, S, H, D)`` contiguous and ``(B, H, S, D)`` contiguous
    storage seen through ``transpose(1, 2)`` qualify."""
    B, S, H, D = t.shape
    sb, ss, sh, sd = t.stride()
    if sd != 1 or (ss * t.element_size()) % 16 or t.data_ptr() % 16:
        return None
    if sh == D and ss == H * D and sb == S * H * D:  # (B, S, H, D)
        return B * S, ss, S, 0, D
    if ss == D and sh == S * D and sb == H * S * D:  # (B, H, S, D) storage
        return B * H * S, ss, H * S, S, 0
    return None


def ws_supported(q: Tensor, k: Tensor, v: Tensor, geo: Geometry, window: int | None) -> bool:
    """Whether the warp-specialized forward takes this call: requested (``LLMOPT_FLASH_FWD=ws``), a Hopper GPU
    (compute capability 9.0), fp16/bf16, dense, no window, head dim 64 or 128, and TMA-compatible layouts."""
    if os.environ.get("LLMOPT_FLASH_FWD", "triton") != "ws" or q.device.type != "cuda":
        return False
    if torch.cuda.get_device_capability(q.device) != (9, 0) or q.dtype not in (torch.float16, torch.bfloat16):
        return False
    if geo.cu_seqlens is not None or window is not None or geo.head_dim not in _LAUNCH:
        return False
    return all(tma_rows(t) is not None for t in (q, k, v))


def _descriptor(t: Tensor, block_rows: int) -> tuple[TensorDescriptor, tuple[int, int, int]]:
    rows, row_stride, per_b, per_h, col_h = tma_rows(t)  # type: ignore[misc]
    D = t.shape[-1]
    layout = gl.NVMMASharedLayout.get_default_for([block_rows, D], gl.bfloat16 if t.dtype == torch.bfloat16
                                                  else gl.float16)
    cols = row_stride if col_h else D  # a row holds every head (B, S, H, D), or one head's D values
    desc = TensorDescriptor(t, [rows, cols], [row_stride, 1], [block_rows, D], layout)
    return desc, (per_b, per_h, col_h)


def ws_fwd(q: Tensor, k: Tensor, v: Tensor, geo: Geometry, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` as :func:`~lightning_llmopt.kernels.flash_attention_fwd.flash_fwd` returns them, for a call
    :func:`ws_supported` accepts."""
    block_n, stages = _LAUNCH[geo.head_dim]
    out = torch.empty_like(q)
    lse = torch.empty(geo.lse_shape, device=q.device, dtype=torch.float32)
    q_desc, q_map = _descriptor(q, 64)
    k_desc, k_map = _descriptor(k, block_n)
    v_desc, v_map = _descriptor(v, block_n)
    sb, ss, sh, _ = out.stride()
    grid = (triton.cdiv(geo.seq_q, 128), geo.batch * geo.num_heads)
    _ws_fwd_kernel[grid](
        q_desc, k_desc, v_desc, out, lse, *q_map, *k_map, *v_map, sb, ss, sh, lse.stride(0), lse.stride(1),
        geo.seq_q, geo.seq_k, geo.num_heads, geo.group, scale * _LOG2E, HEAD_D=geo.head_dim, BLOCK_N=block_n,
        STAGES=stages, IS_CAUSAL=causal, num_warps=4, maxnreg=_MAXNREG,
    )
    return out, lse


__all__ = ["tma_rows", "ws_fwd", "ws_supported"]
