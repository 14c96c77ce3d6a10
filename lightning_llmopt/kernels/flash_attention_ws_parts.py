"""Pieces shared by the warp-specialized Hopper forward (:mod:`flash_attention_fwd_ws`) and its persistent form
(:mod:`flash_attention_fwd_ws_persistent`): the TMA descriptors and kernel operands, the launch cache, and the
Gluon helpers of one consumer's 64 query rows (mask bounds, the online-softmax step, the plain key loop, the
output and ``lse`` write).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from lightning_llmopt.kernels.flash_attention_common import Geometry
from lightning_llmopt.kernels.flash_attention_ws_plan import tma_rows
from lightning_llmopt.kernels.launch_cache import LaunchCache

# TMA copy into shared memory: ``async_copy_global_to_shared`` up to Triton 3.6, ``async_load`` later
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_LOG2E = 1.4426950408889634


# launches after the first of each (kernel, plan, head dim, mask, packing) skip JITFunction.run (launch_cache.py)
LAUNCHES = LaunchCache()


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


__all__ = ["LAUNCHES", "fresh_rows", "kernel_operands", "mma_layout", "row_bounds", "write_rows"]
