"""Fused Triton kernels of the engine's forward pass, and the fused forward that uses them.

Decode is bound by memory bandwidth and, at batch 1, by the number of kernels: the reference model spends about 50
small kernels per layer on norms, RoPE and activations. The fused forward runs, per layer:

- :func:`add_rms_norm`: ``r = x + delta`` (the residual add of the previous sub-layer) and RMSNorm of ``r``;
- :func:`rope_store`: rotates q and k in place (RoPE) and writes k and v into their KV-cache slots (quantized for
  an int8 cache);
- :func:`silu_mul`: the SwiGLU gate ``silu(a) * b``;
- the matrix products (cuBLAS through the model's own ``nn.Linear``) and the paged attention.

At batch 1 the matrix products are matrix-vector products, bound by streaming the weights, and each launch pays a
ramp and a drain. :func:`gemv` is a Triton kernel for them (rows of the weight split over programs, fp32 partial
sums over ``BLOCK_K`` columns, one reduction at the end) that also takes two or three weights in one launch without
concatenating them: :func:`gemv_cat` (q, k and v), :func:`gemv_swiglu` (gate and up with the SiLU product as its
epilogue), and :func:`norm_gemv_cat` / :func:`norm_gemv_swiglu`, which also fold in the residual add and RMSNorm
(every program sums the squares of the columns it streams and scales its dot products by ``rsqrt(mean + eps)`` at
the end). A batch-1 layer then runs six kernels: norm + q/k/v, RoPE + KV store, attention, wo, norm + gate/up + SiLU,
w2. On Hopper the GEMVs launch as programmatic dependents (PDL): each is scheduled while the kernel before it drains
and waits on ``griddepcontrol.wait`` before its first read. :class:`LinearChooser` times each Triton launch against
its unfused / cuBLAS equivalent once per weight shape and keeps the faster.

The elementwise kernels reproduce the reference model's rounding: RMSNorm normalises in fp32, rounds to the
activation dtype, then multiplies by the weight; RoPE rotates in fp32 then rounds; SiLU rounds before the product
(as PyTorch's eager ops do). The norm-folding GEMVs skip the two roundings of the normalised input (it never
exists as a tensor); the residual they write is rounded as :func:`add_rms_norm` rounds it. Importing this module
imports Triton; the engine imports it only on CUDA (or in interpreter tests).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from lightning_llmopt.kernels.flash_attention_interp import ensure_interpreted_stdlib

if TYPE_CHECKING:
    from lightning_llmopt.inference.runner import ModelRunner, StepInputs

ensure_interpreted_stdlib()

try:  # grid dependency control (programmatic dependent launch, Hopper and later)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton
    gdc_launch_dependents = gdc_wait = None


def _pdl(device: torch.device) -> bool:
    """Launch the GEMVs as programmatic dependents (``LLMOPT_PDL=0`` turns it off): each may be scheduled while the
    kernel before it drains, and waits (``griddepcontrol.wait``) before its first read of an activation or any
    write. Needs compute capability 9.0 or later and a compiled kernel (not the interpreter)."""
    if gdc_wait is None or device.type != "cuda" or os.environ.get("LLMOPT_PDL", "1") == "0":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _HOPPER:
        _HOPPER[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return _HOPPER[index]


_HOPPER: dict[int, bool] = {}  # device index -> compute capability 9.0 or later

__all__ = ["LinearChooser", "add_rms_norm", "fused_forward", "gemv", "gemv_cat", "gemv_swiglu", "norm_gemv_cat",
           "norm_gemv_swiglu", "rope_store", "silu_mul"]


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


@triton.jit
def _gemv_kernel(X, W0, W1, W2, B0, B1, B2, Y, N0, N1, N2, K, s0, s1, s2, DELTA, NORM_W, RES, eps,
                 NUM_W: tl.constexpr, HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr, NORM: tl.constexpr,
                 HAS_DELTA: tl.constexpr, EVEN: tl.constexpr, PDL: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """One launch for up to three weights sharing ``K``. Concatenated: output row ``r`` is row ``r`` of
    ``[W0; W1; W2]`` (q, k and v in one pass). ``SWIGLU``: program rows ``r`` of ``W0`` (gate) and ``W1`` (up) and
    writes ``silu(x W0^T) * (x W1^T)``, rounded where the unfused path rounds (each product, then the SiLU).

    ``NORM``: the input is RMSNorm of the residual ``r = x + delta`` (``HAS_DELTA``; rounded to the activation dtype,
    and written to ``RES`` by program 0) times ``NORM_W``. Every program accumulates ``sum(r^2)`` beside its dot
    products, over the same columns, and applies ``rsqrt(mean + eps)`` to its sums at the end (one pass over x: the
    normalised input is never rounded, where the unfused path rounds it twice)."""
    if PDL:
        gdc_launch_dependents()  # the next kernel may be scheduled once every program of this one has started
        gdc_wait()  # the previous kernel's writes (x, delta) are visible; nothing is read or written before this
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rows64 = rows.to(tl.int64)
    if SWIGLU:
        n_out = N0
    else:
        n_out = N0 + N1 + N2
    rmask = rows < n_out
    w_a = W0 + rows64[:, None] * s0
    if SWIGLU:
        w_b = W1 + rows64[:, None] * s1
    else:
        w_b = w_a  # unused
        if NUM_W > 1:
            w_a = tl.where(rows[:, None] >= N0, W1 + (rows64[:, None] - N0) * s1, w_a)
        if NUM_W > 2:
            w_a = tl.where(rows[:, None] >= N0 + N1, W2 + (rows64[:, None] - N0 - N1) * s2, w_a)
    acc_a = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    sq = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        cmask = cols < K
        if EVEN:
            x = tl.load(X + cols)
            wa = tl.load(w_a + cols[None, :])
        else:
            x = tl.load(X + cols, mask=cmask, other=0.0)
            wa = tl.load(w_a + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0)
        if NORM:
            if HAS_DELTA:
                x = (x.to(tl.float32) + tl.load(DELTA + cols, mask=cmask, other=0.0).to(tl.float32)).to(
                    X.dtype.element_ty)
                if pid == 0:
                    tl.store(RES + cols, x, mask=cmask)
            x = x.to(tl.float32)
            sq += x * x
            x = x * tl.load(NORM_W + cols, mask=cmask, other=0.0).to(tl.float32)
        else:
            x = x.to(tl.float32)
        acc_a += wa.to(tl.float32) * x[None, :]
        if SWIGLU:
            if EVEN:
                wb = tl.load(w_b + cols[None, :])
            else:
                wb = tl.load(w_b + cols[None, :], mask=rmask[:, None] & (cols[None, :] < K), other=0.0)
            acc_b += wb.to(tl.float32) * x[None, :]
    y = tl.sum(acc_a, 1)
    rstd = 1.0
    if NORM:
        rstd = tl.rsqrt(tl.sum(sq, 0) / K + eps)
        y = y * rstd
    if HAS_BIAS:
        b_ptr = B0 + rows
        if NUM_W > 1:
            b_ptr = tl.where(rows >= N0, B1 + (rows - N0), b_ptr)
        if NUM_W > 2:
            b_ptr = tl.where(rows >= N0 + N1, B2 + (rows - N0 - N1), b_ptr)
        y += tl.load(b_ptr, mask=rmask, other=0.0).to(tl.float32)
    if SWIGLU:
        a = y.to(Y.dtype.element_ty).to(tl.float32)
        up = (tl.sum(acc_b, 1) * rstd).to(Y.dtype.element_ty).to(tl.float32)
        gate = (a / (1.0 + tl.exp(-a))).to(Y.dtype.element_ty).to(tl.float32)
        y = gate * up
    tl.store(Y + rows, y.to(Y.dtype.element_ty), mask=rmask)


def _gemv_configs() -> list[triton.Config]:
    return [
        triton.Config({"BLOCK_N": 8, "BLOCK_K": 512}, num_warps=4, num_stages=4),
        triton.Config({"BLOCK_N": 16, "BLOCK_K": 256}, num_warps=4, num_stages=4),
        triton.Config({"BLOCK_N": 4, "BLOCK_K": 1024}, num_warps=4, num_stages=4),
        triton.Config({"BLOCK_N": 16, "BLOCK_K": 512}, num_warps=8, num_stages=3),
    ]


def _even(args: dict) -> bool:
    n_out = args["N0"] if args["SWIGLU"] else args["N0"] + args["N1"] + args["N2"]
    return args["K"] % args["BLOCK_K"] == 0 and n_out % args["BLOCK_N"] == 0


_tuned_gemv = None


def _launch_gemv(x: Tensor, weights: list[Tensor], biases: list[Tensor] | None, swiglu: bool,
                 norm: tuple[Tensor, float, Tensor | None] | None = None) -> tuple[Tensor, Tensor | None]:
    """``(y, residual)``; ``norm = (weight, eps, delta)`` normalises ``x (+ delta)`` first (residual: the sum, when
    ``delta`` is given)."""
    global _tuned_gemv
    K = weights[0].shape[1]
    for w in weights:
        if w.shape[1] != K or w.stride(1) != 1 or w.dtype != weights[0].dtype:
            raise ValueError("gemv weights must share K and dtype and have contiguous rows")
    if x.shape != (1, K):
        raise ValueError(f"gemv needs x (1, {K}), got {tuple(x.shape)}")
    if swiglu and (len(weights) != 2 or weights[0].shape != weights[1].shape):
        raise ValueError("the SwiGLU GEMV needs two weights of one shape (gate, up)")
    x = x.contiguous()
    ns = [w.shape[0] for w in weights] + [0] * (3 - len(weights))
    n_out = ns[0] if swiglu else sum(ns)
    y = torch.empty(1, n_out, dtype=torch.promote_types(x.dtype, weights[0].dtype), device=x.device)
    ws = weights + [weights[0]] * (3 - len(weights))
    bs = (biases or []) + [ws[0]] * (3 - len(biases or []))
    norm_w, eps, delta = norm if norm is not None else (x, 0.0, None)
    if norm is not None and (norm_w.shape != (K,) or (delta is not None and delta.shape != x.shape)):
        raise ValueError(f"the norm weight must be ({K},) and delta shaped like x")
    res = torch.empty_like(x) if delta is not None else None
    delta = delta.contiguous() if delta is not None else None
    args = (x, *ws, *bs, y, *ns, K, *(w.stride(0) for w in ws), delta if delta is not None else x, norm_w,
            res if res is not None else x, eps)
    consts = dict(NUM_W=len(weights), HAS_BIAS=biases is not None, SWIGLU=swiglu, NORM=norm is not None,
                  HAS_DELTA=delta is not None, PDL=_pdl(x.device))
    if x.device.type != "cuda":  # interpreter
        meta = dict(BLOCK_N=16, BLOCK_K=32)
        even = _even({**meta, **consts, "N0": ns[0], "N1": ns[1], "N2": ns[2], "K": K})
        _gemv_kernel[(triton.cdiv(n_out, 16),)](*args, **consts, EVEN=even, **meta)
        return y, res
    if _tuned_gemv is None:
        _tuned_gemv = triton.autotune(
            configs=_gemv_configs(), key=["N0", "N1", "N2", "K", "NUM_W", "SWIGLU", "NORM", "HAS_DELTA"]
        )(triton.heuristics({"EVEN": _even})(_gemv_kernel))
    launch = {"launch_pdl": True} if consts["PDL"] else {}
    _tuned_gemv[lambda meta: (triton.cdiv(n_out, meta["BLOCK_N"]),)](*args, **consts, **launch)
    return y, res


def gemv(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x @ weight.T + bias`` for one row: ``x`` ``(1, K)``, ``weight`` ``(N, K)`` (contiguous rows) -> ``(1, N)``."""
    return _launch_gemv(x, [weight], None if bias is None else [bias], False)[0]


def gemv_cat(x: Tensor, weights: list[Tensor], biases: list[Tensor] | None = None) -> Tensor:
    """``x @ cat(weights).T (+ cat(biases))`` for one row in one launch, without concatenating the weights (one to
    three ``(N_i, K)`` weights with contiguous rows) -> ``(1, sum N_i)``."""
    if not 1 <= len(weights) <= 3 or (biases is not None and len(biases) != len(weights)):
        raise ValueError("gemv_cat takes one to three weights (and as many biases, or None)")
    return _launch_gemv(x, list(weights), None if biases is None else list(biases), False)[0]


def gemv_swiglu(x: Tensor, gate: Tensor, up: Tensor) -> Tensor:
    """``silu(x @ gate.T) * (x @ up.T)`` for one row in one launch -> ``(1, N)``; rounds like
    ``silu_mul(gemv(x, gate), gemv(x, up))``."""
    return _launch_gemv(x, [gate, up], None, True)[0]


def norm_gemv_cat(x: Tensor, norm_weight: Tensor, eps: float, delta: Tensor | None, weights: list[Tensor],
                  biases: list[Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """:func:`gemv_cat` of ``rmsnorm(r) * norm_weight`` with ``r = x + delta`` (or ``x``), in one launch; returns
    ``(y, r)``."""
    if not 1 <= len(weights) <= 3 or (biases is not None and len(biases) != len(weights)):
        raise ValueError("norm_gemv_cat takes one to three weights (and as many biases, or None)")
    y, res = _launch_gemv(x, list(weights), None if biases is None else list(biases), False, (norm_weight, eps, delta))
    return y, x if res is None else res


def norm_gemv_swiglu(x: Tensor, norm_weight: Tensor, eps: float, delta: Tensor | None, gate: Tensor,
                     up: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`gemv_swiglu` of ``rmsnorm(x + delta) * norm_weight`` in one launch; returns ``(y, x + delta)``."""
    y, res = _launch_gemv(x, [gate, up], None, True, (norm_weight, eps, delta))
    return y, x if res is None else res


def _split(y: Tensor, lins: tuple[Any, ...]) -> tuple[Tensor, ...]:
    return y.split([lin.weight.shape[0] for lin in lins], dim=-1)


def _plain(lin: Any) -> bool:
    return type(lin) is torch.nn.Linear and not lin._forward_hooks and not lin._forward_pre_hooks


class LinearChooser:
    """``F.linear`` or :func:`gemv` for one-row inputs, whichever was faster for the weight's shape (timed once,
    outside CUDA-graph capture; inputs of several rows always take ``F.linear``). :meth:`qkv` and :meth:`swiglu`
    likewise choose between one fused launch (:func:`gemv_cat`, :func:`gemv_swiglu`) and the separate products."""

    def __init__(self) -> None:
        self.use_gemv: dict[tuple, bool] = {}
        # True/False: always/never the Triton GEMVs (tests; True also runs them on CPU under the interpreter)
        self.force: bool | None = None
        self.fused_calls = 0  # launches of the fused norm + q/k/v and norm + gate/up GEMVs

    def _on_device(self, x: Tensor) -> bool:
        return x.device.type == "cuda" or (self.force is True and os.environ.get("TRITON_INTERPRET") == "1")

    def __call__(self, x: Tensor, lin: Any) -> Tensor:
        # only plain dense linears have a GEMV alternative; quantized layers run their own kernels
        if x.shape[0] != 1 or not self._on_device(x) or not isinstance(lin, torch.nn.Linear):
            return lin(x)
        key = (tuple(lin.weight.shape), lin.weight.dtype)
        return self._choose(key, lambda: gemv(x, lin.weight, lin.bias), lambda: lin(x))

    def qkv(self, x: Tensor, lins: tuple[Any, Any, Any]) -> tuple[Tensor, ...]:
        """``(wq x, wk x, wv x)``; fused, they are views of one output."""
        separate = lambda: tuple(self(x, lin) for lin in lins)  # noqa: E731
        if not self._fusable(x, lins) or len({lin.bias is None for lin in lins}) > 1:
            return separate()
        key = ("qkv", *(tuple(lin.weight.shape) for lin in lins), lins[0].weight.dtype, lins[0].bias is None)
        biases = None if lins[0].bias is None else [lin.bias for lin in lins]
        return self._choose(key, lambda: _split(gemv_cat(x, [lin.weight for lin in lins], biases), lins), separate)

    def swiglu(self, x: Tensor, gate: Any, up: Any) -> Tensor:
        """``silu(gate x) * (up x)``."""
        separate = lambda: silu_mul(self(x, gate), self(x, up))  # noqa: E731
        if not self._fusable(x, (gate, up)) or gate.bias is not None or up.bias is not None:
            return separate()
        key = ("swiglu", tuple(gate.weight.shape), tuple(up.weight.shape), gate.weight.dtype)
        return self._choose(key, lambda: gemv_swiglu(x, gate.weight, up.weight), separate)

    def norm_qkv(self, x: Tensor, delta: Tensor | None, norm: Any,
                 lins: tuple[Any, Any, Any]) -> tuple[tuple[Tensor, ...], Tensor]:
        """``((wq h, wk h, wv h), r)`` with ``r = x + delta`` and ``h = norm(r)`` (:func:`add_rms_norm`)."""
        separate = lambda: self._normed(x, delta, norm, lambda h: self.qkv(h, lins))  # noqa: E731
        if not self._fusable(x, lins) or len({lin.bias is None for lin in lins}) > 1:
            return separate()
        key = ("norm+qkv", *(tuple(lin.weight.shape) for lin in lins), lins[0].weight.dtype, lins[0].bias is None,
               delta is None)
        biases = None if lins[0].bias is None else [lin.bias for lin in lins]

        def fused() -> tuple[tuple[Tensor, ...], Tensor]:
            self.fused_calls += 1
            y, res = norm_gemv_cat(x, norm.weight, norm.eps, delta, [lin.weight for lin in lins], biases)
            return _split(y, lins), res

        return self._choose(key, fused, separate)

    def norm_swiglu(self, x: Tensor, delta: Tensor | None, norm: Any, gate: Any, up: Any) -> tuple[Tensor, Tensor]:
        """``(silu(gate h) * (up h), r)`` with ``r = x + delta`` and ``h = norm(r)``."""
        separate = lambda: self._normed(x, delta, norm, lambda h: self.swiglu(h, gate, up))  # noqa: E731
        if not self._fusable(x, (gate, up)) or gate.bias is not None or up.bias is not None:
            return separate()
        key = ("norm+swiglu", tuple(gate.weight.shape), tuple(up.weight.shape), gate.weight.dtype, delta is None)

        def fused() -> tuple[Tensor, Tensor]:
            self.fused_calls += 1
            return norm_gemv_swiglu(x, norm.weight, norm.eps, delta, gate.weight, up.weight)

        return self._choose(key, fused, separate)

    @staticmethod
    def _normed(x: Tensor, delta: Tensor | None, norm: Any, fn: Any) -> tuple[Tensor, Tensor]:
        h, res = add_rms_norm(x, norm.weight, norm.eps, delta)
        return fn(h), res

    def _fusable(self, x: Tensor, lins: tuple[Any, ...]) -> bool:
        if x.shape[0] != 1 or not self._on_device(x) or not all(_plain(lin) for lin in lins):
            return False
        w0 = lins[0].weight
        return all(lin.weight.dtype == w0.dtype and lin.weight.shape[1] == w0.shape[1] for lin in lins)

    def _choose(self, key: tuple, triton_fn: Any, torch_fn: Any) -> Tensor:
        use = self.use_gemv.get(key) if self.force is None else self.force
        if use is None:
            if torch.cuda.is_current_stream_capturing():
                return torch_fn()
            use = self._decide(key, triton_fn, torch_fn)
        return triton_fn() if use else torch_fn()

    def _decide(self, key: tuple, triton_fn: Any, torch_fn: Any) -> bool:
        from triton.testing import do_bench

        triton_fn()  # autotunes
        # interleaved, best of three each: one timing of a few microseconds moves by several percent
        t_triton, t_torch = float("inf"), float("inf")
        for _ in range(3):
            t_triton = min(t_triton, do_bench(triton_fn, warmup=5, rep=25, return_mode="median"))
            t_torch = min(t_torch, do_bench(torch_fn, warmup=5, rep=25, return_mode="median"))
        # Inside the decode graph a GEMV launched as a programmatic dependent overlaps the drain of the kernel before
        # it, which these isolated timings cannot show: there, 32 wo products (4096x4096) took 0.446 ms through
        # the GEMV against 0.530 ms through cuBLAS (H100, 2026-11-25) while isolated timings called it a tie.
        margin = 1.05 if _pdl(torch.device("cuda")) else 1.0
        self.use_gemv[key] = t_triton < t_torch * margin
        return self.use_gemv[key]


def fused_forward(runner: ModelRunner, inp: StepInputs, max_context: int | None = None) -> Tensor:
    """Final-norm hidden states ``(S, dim)`` of the rows ``inp.logits_idx`` (the runner's forward, fused)."""
    model = runner.model
    assert model.tok_embeddings is not None and model.norm is not None
    lin: Any = runner.linear
    res = model.tok_embeddings(inp.input_ids)  # (N, dim)
    delta: Tensor | None = None
    pool = runner.pool
    block: Any
    for i, block in enumerate(model.layers.values()):
        attn = block.attention
        N, D = res.shape[0], attn.head_dim
        if N == 1:  # norm, q, k and v in one launch where that is faster
            qkv, res = lin.norm_qkv(res, delta, block.attention_norm, (attn.wq, attn.wk, attn.wv))
        else:
            x, res = add_rms_norm(res, block.attention_norm.weight, block.attention_norm.eps, delta)
            qkv = (lin(x, attn.wq), lin(x, attn.wk), lin(x, attn.wv))
        q, k, v = (t.view(N, -1, D) for t in qkv)  # (N, H, D), (N, H_kv, D), (N, H_kv, D)
        kc, vc = pool.layer(i)
        ks, vs = pool.layer_scales(i)
        rope_store(q, k, v, inp.positions, model.rope, inp.blocks, inp.slots, kc, vc, ks, vs)
        o = runner.attention(i, q, k, v, inp, max_context)
        a = lin(o.reshape(N, -1), attn.wo)
        ff = block.feed_forward
        if N == 1:
            h, res = lin.norm_swiglu(res, a, block.ffn_norm, ff.w1, ff.w3)
        else:
            x, res = add_rms_norm(res, block.ffn_norm.weight, block.ffn_norm.eps, a)
            h = lin.swiglu(x, ff.w1, ff.w3)
        delta = lin(h, ff.w2)
    idx = inp.logits_idx
    out, _ = add_rms_norm(res[idx], model.norm.weight, model.norm.eps, delta[idx] if delta is not None else None)
    return out
