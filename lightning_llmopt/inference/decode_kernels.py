"""Fused elementwise Triton kernels of the engine's forward pass, and the fused forward that uses them.

Decode is bound by memory bandwidth and, at batch 1, by the number of kernels: the reference model spends about 50
small kernels per layer on norms, RoPE and activations. The fused forward runs, per layer:

- :func:`add_rms_norm`: ``r = x + delta`` (the residual add of the previous sub-layer) and RMSNorm of ``r``;
- :func:`rope_store`: rotates q and k in place (RoPE) and writes k and v into their KV-cache slots (quantized for
  an int8 cache);
- :func:`silu_mul`: the SwiGLU gate ``silu(a) * b``;
- the matrix products and the paged attention.

At batch 1 the runner's :class:`~lightning_llmopt.inference.linear_chooser.LinearChooser` picks, per weight shape,
cuBLAS or the Triton GEMVs of :mod:`~lightning_llmopt.inference.gemv`, which also fold the residual add and RMSNorm
into one launch for q/k/v and one for gate/up + SiLU: a batch-1 layer then runs six kernels (norm + q/k/v, RoPE + KV
store, attention, wo, norm + gate/up + SiLU, w2).

The elementwise kernels reproduce the reference model's rounding: RMSNorm normalises in fp32, rounds to the
activation dtype, then multiplies by the weight; RoPE rotates in fp32 then rounds; SiLU rounds before the product
(as PyTorch's eager ops do). Importing this module imports Triton; the engine imports it only on CUDA (or in
interpreter tests).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch
import triton
import triton.language as tl
from torch import Tensor

from lightning_llmopt.kernels.flash_attention_interp import ensure_interpreted_stdlib

if TYPE_CHECKING:
    from lightning_llmopt.inference.kv_pool import KVPool
    from lightning_llmopt.inference.step_inputs import StepInputs
    from lightning_llmopt.models.llama import Llama

ensure_interpreted_stdlib()

__all__ = ["FusedRunner", "add_rms_norm", "fused_forward", "rope_store", "silu_mul"]


class FusedRunner(Protocol):
    """What :func:`fused_forward` reads of the :class:`~lightning_llmopt.inference.runner.ModelRunner` that calls it
    (handed in, so this module does not import the runner above it)."""

    model: Llama
    cfg: Any
    linear: Any
    pool: KVPool
    slot: list[int]

    def _inputs_for(self, inp: StepInputs, layer: int) -> StepInputs: ...

    def attention(
        self, layer: int, q: Tensor, k: Tensor, v: Tensor, inp: StepInputs, max_context: int | None = None
    ) -> Tensor: ...


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@triton.jit
def _add_rms_norm_kernel(
    X,
    DELTA,
    W,
    OUT,
    RES,
    stride_x,
    stride_d,
    stride_o,
    stride_r,
    n_cols,
    eps,
    HAS_DELTA: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_DELTA:
        d = tl.load(DELTA + row * stride_d + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(RES + row * stride_r + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, 0) / n_cols
    normed = (xf * tl.rsqrt(var + eps)).to(X.dtype.element_ty)
    w = tl.load(W + cols, mask=mask, other=0.0)
    out = normed.to(tl.float32) * w.to(tl.float32)
    tl.store(OUT + row * stride_o + cols, out.to(OUT.dtype.element_ty), mask=mask)


def add_rms_norm(x: Tensor, weight: Tensor, eps: float, delta: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``(rmsnorm(r) * weight, r)`` with ``r = x + delta`` (or ``x``); ``x``, ``delta`` ``(N, dim)``."""
    N, dim = x.shape
    out = torch.empty(N, dim, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    res = torch.empty_like(x) if delta is not None else x
    if N:
        _add_rms_norm_kernel[(N,)](
            x,
            delta if delta is not None else x,
            weight,
            out,
            res,
            x.stride(0),
            delta.stride(0) if delta is not None else 0,
            out.stride(0),
            res.stride(0),
            dim,
            eps,
            HAS_DELTA=delta is not None,
            BLOCK=_pow2(dim),
            num_warps=8 if dim >= 2048 else 4,
        )
    return out, res


@triton.jit
def _rope_store_kernel(
    Q,
    K,
    V,
    POS,
    ROPE,
    BLOCKS,
    SLOTS,
    KC,
    VC,
    K_SCALE,
    V_SCALE,
    stride_qn,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_rp,
    stride_cb,
    stride_ch,
    stride_cs,
    n_heads,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    QUANT: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    c = tl.arange(0, BLOCK_H)
    mask = c < HALF
    pos = tl.load(POS + n)
    cos = tl.load(ROPE + pos * stride_rp + 2 * c, mask=mask, other=1.0)
    sin = tl.load(ROPE + pos * stride_rp + 2 * c + 1, mask=mask, other=0.0)
    if h < n_heads:
        base = Q + n * stride_qn + h * stride_qh
        x1 = tl.load(base + c, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(base + HALF + c, mask=mask, other=0.0).to(tl.float32)
        tl.store(base + c, (x1 * cos - x2 * sin).to(Q.dtype.element_ty), mask=mask)
        tl.store(base + HALF + c, (x2 * cos + x1 * sin).to(Q.dtype.element_ty), mask=mask)
    else:
        j = h - n_heads
        base = K + n * stride_kn + j * stride_kh
        x1 = tl.load(base + c, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(base + HALF + c, mask=mask, other=0.0).to(tl.float32)
        k1 = (x1 * cos - x2 * sin).to(K.dtype.element_ty)
        k2 = (x2 * cos + x1 * sin).to(K.dtype.element_ty)
        tl.store(base + c, k1, mask=mask)
        tl.store(base + HALF + c, k2, mask=mask)
        vbase = V + n * stride_vn + j * stride_vh
        v1 = tl.load(vbase + c, mask=mask, other=0.0)
        v2 = tl.load(vbase + HALF + c, mask=mask, other=0.0)
        blk = tl.load(BLOCKS + n)
        slot = tl.load(SLOTS + n)
        dst = blk * stride_cb + j * stride_ch + slot * stride_cs
        if QUANT:
            ks = tl.load(K_SCALE + j)
            vs = tl.load(V_SCALE + j)
            # round half up (PyTorch rounds half to even: the two differ only on exact ties)
            k1 = tl.minimum(tl.maximum(tl.floor(k1.to(tl.float32) / ks + 0.5), -127.0), 127.0)
            k2 = tl.minimum(tl.maximum(tl.floor(k2.to(tl.float32) / ks + 0.5), -127.0), 127.0)
            v1 = tl.minimum(tl.maximum(tl.floor(v1.to(tl.float32) / vs + 0.5), -127.0), 127.0)
            v2 = tl.minimum(tl.maximum(tl.floor(v2.to(tl.float32) / vs + 0.5), -127.0), 127.0)
        tl.store(KC + dst + c, k1.to(KC.dtype.element_ty), mask=mask)
        tl.store(KC + dst + HALF + c, k2.to(KC.dtype.element_ty), mask=mask)
        tl.store(VC + dst + c, v1.to(VC.dtype.element_ty), mask=mask)
        tl.store(VC + dst + HALF + c, v2.to(VC.dtype.element_ty), mask=mask)


def rope_store(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    positions: Tensor,
    rope: Tensor,
    blocks: Tensor,
    slots: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> None:
    """Rotate ``q`` ``(N, H, D)`` and ``k`` ``(N, H_kv, D)`` in place and store k/v at ``(blocks, slots)``.

    ``rope`` is the model's ``(max_seq_len, D/2, 2)`` fp32 (cos, sin) table; caches are ``(num_blocks, H_kv,
    block_size, D)`` (int8 with ``k_scale``/``v_scale`` ``(H_kv,)``).
    """
    N, H, D = q.shape
    H_kv = k.shape[1]
    if N == 0:
        return
    quant = k_cache.dtype == torch.int8
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous head dim")
    _rope_store_kernel[(N, H + H_kv)](
        q,
        k,
        v,
        positions,
        rope,
        blocks,
        slots,
        k_cache,
        v_cache,
        k_scale if quant else rope,
        v_scale if quant else rope,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        rope.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        H,
        HALF=D // 2,
        BLOCK_H=_pow2(D // 2),
        QUANT=quant,
        num_warps=1,
    )


@triton.jit
def _silu_mul_kernel(A, B, OUT, n_elements, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    a = tl.load(A + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + offs, mask=mask, other=0.0)
    s = (a / (1.0 + tl.exp(-a))).to(B.dtype.element_ty)
    tl.store(OUT + offs, (s.to(tl.float32) * b.to(tl.float32)).to(OUT.dtype.element_ty), mask=mask)


def silu_mul(a: Tensor, b: Tensor) -> Tensor:
    """``silu(a) * b`` of two contiguous tensors of one shape and dtype."""
    out = torch.empty_like(b)
    n = b.numel()
    if n:
        block = 1024
        _silu_mul_kernel[(triton.cdiv(n, block),)](a, b, out, n, BLOCK=block, num_warps=4)
    return out


def fused_forward(runner: FusedRunner, inp: StepInputs, max_context: int | None = None) -> Tensor:
    """Final-norm hidden states ``(S, dim)`` of the rows ``inp.logits_idx`` (the runner's forward, fused)."""
    model = runner.model
    assert model.tok_embeddings is not None and model.norm is not None
    lin: Any = runner.linear
    res = model.tok_embeddings(inp.input_ids)  # (N, dim)
    delta: Tensor | None = None
    pool = runner.pool
    block: Any
    step_kv: dict[int, tuple[Tensor, Tensor]] = {}  # cross-layer KV sharing: this step's K/V of each producer
    for i, block in enumerate(model.layers.values()):
        attn = block.attention
        N, D = res.shape[0], attn.head_dim
        src, slot = runner.cfg.kv_source(i), runner.slot[i]  # the pool slot of its K/V (KV groups: of its group)
        kc, vc = pool.layer(slot)
        ks, vs = pool.layer_scales(slot)
        ginp = runner._inputs_for(inp, i)
        if src == i:
            # norm, q, k and v in one launch where that is faster (a few rows; more take add_rms_norm and cuBLAS)
            qkv, res = lin.norm_qkv(res, delta, block.attention_norm, (attn.wq, attn.wk, attn.wv))
            q, k, v = (t.view(N, -1, D) for t in qkv)  # (N, H, D), (N, H_kv, D), (N, H_kv, D)
            rope_store(q, k, v, inp.positions, model.rope, ginp.blocks, ginp.slots, kc, vc, ks, vs)
            step_kv[i] = (k, v)
        else:  # a reader: its queries only (rotated: no key heads, nothing stored), its source's K/V
            (q,), res = lin.norm_qkv(res, delta, block.attention_norm, (attn.wq,))
            q = q.view(N, -1, D)
            rope_store(q, q[:, :0], q[:, :0], inp.positions, model.rope, ginp.blocks, ginp.slots, kc, vc, ks, vs)
            k, v = step_kv[src]
        o = runner.attention(i, q, k, v, inp, max_context)
        a = lin(o.reshape(N, -1), attn.wo)
        ff = block.feed_forward
        h, res = lin.norm_swiglu(res, a, block.ffn_norm, ff.w1, ff.w3)
        delta = lin(h, ff.w2)
    idx = inp.logits_idx
    out, _ = add_rms_norm(res[idx], model.norm.weight, model.norm.eps, delta[idx] if delta is not None else None)
    return out
