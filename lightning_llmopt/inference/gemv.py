"""Triton matrix-vector products for batch-1 decode, one launch for several weights, and the folded RMSNorm.

At batch 1 a matrix product streams its weight once, and each launch pays a ramp and a drain that a small matrix
(4096 x 4096 bf16: about 14 us at full bandwidth) feels. :func:`gemv` splits the weight's rows over programs (fp32
partial sums over ``BLOCK_K`` columns, one reduction at the end); the same kernel takes two or three weights in one
launch without concatenating them:

- :func:`gemv_cat`: ``x @ [W0; W1; W2]^T`` (q, k and v);
- :func:`gemv_swiglu`: ``silu(x W_gate^T) * (x W_up^T)``, the product as the epilogue, rounded where the unfused
  path rounds (each product, then the SiLU);
- :func:`norm_gemv_cat` / :func:`norm_gemv_swiglu`: the same, of ``rmsnorm(x + delta) * w``. Every program sums the
  squares of the columns it streams beside its dot products and scales its sums by ``rsqrt(mean + eps)`` at the end
  (one pass over ``x``: the normalised input is never rounded, where the unfused path rounds it twice); program 0
  writes the residual ``x + delta``, rounded as :func:`~lightning_llmopt.inference.decode_kernels.add_rms_norm`
  rounds it.

On Hopper the kernels launch as programmatic dependents (PDL): each may be scheduled while the kernel before it
drains, and waits on ``griddepcontrol.wait`` before its first read or write. Measured on an H100 (llama2-7b shape,
batch-1 decode in CUDA graphs, 2026-11-25): one launch for q/k/v and gate/up + SiLU took a step from 6.16 to 5.76 ms,
folding the norm to 5.46 ms; with PDL the engine ran 176-181 tokens/s against 173-175 without.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from lightning_llmopt.kernels import precompile
from lightning_llmopt.kernels import shared_memory as smem
from lightning_llmopt.kernels.flash_attention_interp import ensure_interpreted_stdlib
from lightning_llmopt.kernels.pdl import gdc_launch_dependents, gdc_wait, pdl_enabled  # noqa: F401

ensure_interpreted_stdlib()

__all__ = ["MAX_ROWS", "gemv", "gemv_cat", "gemv_swiglu", "norm_gemv_cat", "norm_gemv_swiglu", "pdl_enabled"]

MAX_ROWS = 16  # input rows the GEMVs take (more than one: :func:`_gemv_rows_kernel`)


@triton.jit
def _weight_rows(W0, W1, W2, rows, N0, N1, N2, s0, s1, s2, NUM_W: tl.constexpr, SWIGLU: tl.constexpr):
    """``(n_out, row mask, pointers to the rows of A, of B)``: output row ``r`` reads row ``r`` of ``[W0; W1; W2]``
    (A; B unused), or with ``SWIGLU`` row ``r`` of ``W0`` (A, the gate) and of ``W1`` (B, the up projection)."""
    rows64 = rows.to(tl.int64)
    if SWIGLU:
        n_out = N0
    else:
        n_out = N0 + N1 + N2
    w_a = W0 + rows64[:, None] * s0
    if SWIGLU:
        w_b = W1 + rows64[:, None] * s1
    else:
        w_b = w_a  # unused
        if NUM_W > 1:
            w_a = tl.where(rows[:, None] >= N0, W1 + (rows64[:, None] - N0) * s1, w_a)
        if NUM_W > 2:
            w_a = tl.where(rows[:, None] >= N0 + N1, W2 + (rows64[:, None] - N0 - N1) * s2, w_a)
    return n_out, rows < n_out, w_a, w_b


@triton.jit
def _bias(B0, B1, B2, rows, rmask, N0, N1, NUM_W: tl.constexpr):
    """fp32 bias of output rows ``rows`` (the biases concatenated like the weights)."""
    b_ptr = B0 + rows
    if NUM_W > 1:
        b_ptr = tl.where(rows >= N0, B1 + (rows - N0), b_ptr)
    if NUM_W > 2:
        b_ptr = tl.where(rows >= N0 + N1, B2 + (rows - N0 - N1), b_ptr)
    return tl.load(b_ptr, mask=rmask, other=0.0).to(tl.float32)


@triton.jit
def _silu_times(gate, up, dtype: tl.constexpr):
    """``silu(gate) * up`` rounded where the unfused path rounds: each product, then the SiLU."""
    a = gate.to(dtype).to(tl.float32)
    u = up.to(dtype).to(tl.float32)
    return (a / (1.0 + tl.exp(-a))).to(dtype).to(tl.float32) * u


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
    n_out, rmask, w_a, w_b = _weight_rows(W0, W1, W2, rows, N0, N1, N2, s0, s1, s2, NUM_W, SWIGLU)
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
        y += _bias(B0, B1, B2, rows, rmask, N0, N1, NUM_W)
    if SWIGLU:
        y = _silu_times(y, tl.sum(acc_b, 1) * rstd, Y.dtype.element_ty)
    tl.store(Y + rows, y.to(Y.dtype.element_ty), mask=rmask)


@triton.jit
def _gemv_rows_kernel(X, W0, W1, W2, B0, B1, B2, Y, M, N0, N1, N2, K, s0, s1, s2, DELTA, NORM_W, RES, eps,
                      NUM_W: tl.constexpr, HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr, NORM: tl.constexpr,
                      HAS_DELTA: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """:func:`_gemv_kernel` for ``M <= BLOCK_M`` input rows (contiguous, ``K`` apart): each program streams its
    ``BLOCK_N`` weight rows once and multiplies them with every input row on the tensor cores (the rows padded to
    ``BLOCK_M``). ``NORM``: per input row, ``sum(r^2)`` beside the products and ``rsqrt(mean + eps)`` on the sums at
    the end, as the one-row kernel does, but the input times the norm weight is rounded to the weight dtype for the
    tensor cores. ``IEEE``: fp32 weights multiply in full fp32 (no TF32)."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_out, rmask, w_a, w_b = _weight_rows(W0, W1, W2, rows, N0, N1, N2, s0, s1, s2, NUM_W, SWIGLU)
    ms = tl.arange(0, BLOCK_M)
    mmask = ms < M
    acc_a = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    sq = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        cmask = cols < K
        xmask = mmask[:, None] & cmask[None, :]
        x_off = ms[:, None] * K + cols[None, :]
        x = tl.load(X + x_off, mask=xmask, other=0.0)
        wa = tl.load(w_a + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0)
        if NORM:
            if HAS_DELTA:
                x = (x.to(tl.float32) + tl.load(DELTA + x_off, mask=xmask, other=0.0).to(tl.float32)).to(
                    X.dtype.element_ty)
                if pid == 0:
                    tl.store(RES + x_off, x, mask=xmask)
            xf = x.to(tl.float32)
            sq += tl.sum(xf * xf, 1)
            x = xf * tl.load(NORM_W + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        x = x.to(wa.dtype)
        if IEEE:
            acc_a = tl.dot(x, tl.trans(wa), acc_a, input_precision="ieee")
        else:
            acc_a = tl.dot(x, tl.trans(wa), acc_a)
        if SWIGLU:
            wb = tl.load(w_b + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0)
            if IEEE:
                acc_b = tl.dot(x, tl.trans(wb), acc_b, input_precision="ieee")
            else:
                acc_b = tl.dot(x, tl.trans(wb), acc_b)
    y = acc_a
    rstd = tl.full([BLOCK_M], 1.0, tl.float32)
    if NORM:
        rstd = tl.rsqrt(sq / K + eps)
        y = y * rstd[:, None]
    if HAS_BIAS:
        y += _bias(B0, B1, B2, rows, rmask, N0, N1, NUM_W)[None, :]
    if SWIGLU:
        y = _silu_times(y, acc_b * rstd[:, None], Y.dtype.element_ty)
    tl.store(Y + ms[:, None] * n_out + rows[None, :], y.to(Y.dtype.element_ty), mask=mmask[:, None] & rmask[None, :])


def _rows_configs() -> list[triton.Config]:
    """Candidates of the few-row kernel. Compiled for sm90 with Triton 3.6 (2026-11-26), the folded-norm variants
    spill registers with ``BLOCK_K`` of 256 or more (and the SwiGLU one at 128); the ``BLOCK_K = 64`` tiles do not,
    so each variant has spill-free candidates (the one-weight products spill in none)."""
    return [
        triton.Config({"BLOCK_N": 16, "BLOCK_K": 256}, num_warps=4, num_stages=4),
        triton.Config({"BLOCK_N": 32, "BLOCK_K": 128}, num_warps=4, num_stages=4),
        triton.Config({"BLOCK_N": 32, "BLOCK_K": 256}, num_warps=4, num_stages=3),
        triton.Config({"BLOCK_N": 64, "BLOCK_K": 128}, num_warps=4, num_stages=3),
        triton.Config({"BLOCK_N": 16, "BLOCK_K": 512}, num_warps=8, num_stages=3),
        triton.Config({"BLOCK_N": 16, "BLOCK_K": 64}, num_warps=4, num_stages=3),
        triton.Config({"BLOCK_N": 32, "BLOCK_K": 64}, num_warps=4, num_stages=3),
        triton.Config({"BLOCK_N": 64, "BLOCK_K": 64}, num_warps=4, num_stages=3),
    ]


def _gemv_configs() -> list[triton.Config]:
    return [
        triton.Config({"BLOCK_N": 8, "BLOCK_K": 512}, num_warps=4, num_stages=4),
        triton.Config({"BLOCK_N": 16, "BLOCK_K": 256}, num_warps=4, num_stages=4),
        triton.Config({"BLOCK_N": 4, "BLOCK_K": 1024}, num_warps=4, num_stages=4),
        triton.Config({"BLOCK_N": 16, "BLOCK_K": 512}, num_warps=8, num_stages=3),
    ]


def smem_bytes(rows_kernel: bool, block_n: int, block_k: int, stages: int, num_w: int, x_elem: int, w_elem: int,
               swiglu: bool, has_delta: bool, block_m: int = 16) -> int:
    """Upper estimate (bytes) of a GEMV program's shared memory; ``num_b``: weight tiles per step (2 with SwiGLU).

    - one-row kernel (element-wise products, no ``tl.dot``): ``stages`` buffers of the step's loads
      ``num_b * BLOCK_N * BLOCK_K * w_elem + BLOCK_K * (x_elem + 8)`` (weights; ``x``, ``delta`` and the norm
      weight), and one fp32 ``BLOCK_N x BLOCK_K`` tile for the final reduction;
    - few-row kernel (tensor cores): ``stages`` buffers of ``BLOCK_M * BLOCK_K * x_elem`` (twice with ``delta``),
      ``num_b * BLOCK_N * BLOCK_K * w_elem`` and ``BLOCK_K * 4`` (the norm weight), one ``BLOCK_M x BLOCK_K``
      operand tile in the weights' dtype (the rounded input), and one fp32 ``BLOCK_M x BLOCK_N`` epilogue tile."""
    num_b = 2 if swiglu else 1
    if not rows_kernel:
        step = num_b * block_n * block_k * w_elem + block_k * (x_elem + 8)
        return stages * step + block_n * block_k * 4
    x_tiles = block_m * block_k * x_elem * (2 if has_delta else 1)
    step = x_tiles + num_b * block_n * block_k * w_elem + block_k * 4
    return stages * step + block_m * block_k * w_elem + block_m * block_n * 4


def _estimate(rows_kernel: bool):  # type: ignore[no-untyped-def]
    def estimate(p: dict) -> int:
        return smem_bytes(rows_kernel, p["BLOCK_N"], p["BLOCK_K"], p["num_stages"], p["NUM_W"], p["elem"]["X"],
                          p["elem"]["W0"], bool(p["SWIGLU"]), bool(p["HAS_DELTA"]), p.get("BLOCK_M", 16))

    return estimate


smem.register("_gemv_kernel")(_estimate(False))
smem.register("_gemv_rows_kernel")(_estimate(True))


def _prune(rows_kernel: bool):  # type: ignore[no-untyped-def]
    """``early_config_prune``: the configurations whose :func:`smem_bytes` fits the device."""

    def prune(configs, named_args, **kwargs):  # type: ignore[no-untyped-def]
        x, w = named_args["X"], named_args["W0"]
        name = "_gemv_rows_kernel" if rows_kernel else "_gemv_kernel"
        return smem.fit(f"gemv ({name})", configs,
                        lambda c: smem_bytes(rows_kernel, c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_stages,
                                             kwargs["NUM_W"], x.element_size(), w.element_size(), kwargs["SWIGLU"],
                                             kwargs["HAS_DELTA"], kwargs.get("BLOCK_M", 16)),
                        smem.device_limit(x.device), smem.describe([("K", named_args.get("K"))]))

    return prune


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
    if x.dim() != 2 or x.shape[1] != K or not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"gemv needs x (M, {K}) with 1 <= M <= {MAX_ROWS}, got {tuple(x.shape)}")
    if swiglu and (len(weights) != 2 or weights[0].shape != weights[1].shape):
        raise ValueError("the SwiGLU GEMV needs two weights of one shape (gate, up)")
    x = x.contiguous()
    ns = [w.shape[0] for w in weights] + [0] * (3 - len(weights))
    n_out = ns[0] if swiglu else sum(ns)
    M = x.shape[0]
    y = torch.empty(M, n_out, dtype=torch.promote_types(x.dtype, weights[0].dtype), device=x.device)
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
                  HAS_DELTA=delta is not None, PDL=pdl_enabled(x.device))
    if M > 1:
        _launch_rows(args, consts, M, n_out, weights[0].dtype == torch.float32)
        return y, res
    if x.device.type != "cuda":  # interpreter
        meta = dict(BLOCK_N=16, BLOCK_K=32)
        even = _even({**meta, **consts, "N0": ns[0], "N1": ns[1], "N2": ns[2], "K": K})
        _gemv_kernel[(triton.cdiv(n_out, 16),)](*args, **consts, EVEN=even, **meta)
        return y, res
    if _tuned_gemv is None:
        _tuned_gemv = precompile.autotune(
            configs=_gemv_configs(), key=["N0", "N1", "N2", "K", "NUM_W", "SWIGLU", "NORM", "HAS_DELTA"],
            prune_configs_by={"early_config_prune": _prune(False)},
        )(triton.heuristics({"EVEN": _even})(_gemv_kernel))
    launch = {"launch_pdl": True} if consts["PDL"] else {}
    _tuned_gemv[lambda meta: (triton.cdiv(n_out, meta["BLOCK_N"]),)](*args, **consts, **launch)
    return y, res


_tuned_rows = None


def _launch_rows(args: tuple, consts: dict, M: int, n_out: int, ieee: bool) -> None:
    """:func:`_gemv_rows_kernel` for ``args`` of :func:`_launch_gemv` (``M`` inserted after ``Y``)."""
    global _tuned_rows
    args = (*args[:8], M, *args[8:])
    x = args[0]
    if x.device.type != "cuda":  # interpreter
        _gemv_rows_kernel[(triton.cdiv(n_out, 16),)](*args, **consts, IEEE=ieee, BLOCK_M=16, BLOCK_N=16, BLOCK_K=32)
        return
    if _tuned_rows is None:
        _tuned_rows = precompile.autotune(
            configs=_rows_configs(), key=["N0", "N1", "N2", "K", "NUM_W", "SWIGLU", "NORM", "HAS_DELTA", "IEEE"],
            prune_configs_by={"early_config_prune": _prune(True)},
        )(_gemv_rows_kernel)
    launch = {"launch_pdl": True} if consts["PDL"] else {}
    _tuned_rows[lambda meta: (triton.cdiv(n_out, meta["BLOCK_N"]),)](*args, **consts, IEEE=ieee, BLOCK_M=16, **launch)


def gemv(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x @ weight.T + bias`` for a few rows: ``x`` ``(M, K)`` (``M <= MAX_ROWS``), ``weight`` ``(N, K)``
    (contiguous rows) -> ``(M, N)``."""
    return _launch_gemv(x, [weight], None if bias is None else [bias], False)[0]


def gemv_cat(x: Tensor, weights: list[Tensor], biases: list[Tensor] | None = None) -> Tensor:
    """``x @ cat(weights).T (+ cat(biases))`` for up to ``MAX_ROWS`` rows in one launch, without concatenating the
    weights (one to three ``(N_i, K)`` weights with contiguous rows) -> ``(M, sum N_i)``."""
    if not 1 <= len(weights) <= 3 or (biases is not None and len(biases) != len(weights)):
        raise ValueError("gemv_cat takes one to three weights (and as many biases, or None)")
    return _launch_gemv(x, list(weights), None if biases is None else list(biases), False)[0]


def gemv_swiglu(x: Tensor, gate: Tensor, up: Tensor) -> Tensor:
    """``silu(x @ gate.T) * (x @ up.T)`` for up to ``MAX_ROWS`` rows in one launch -> ``(M, N)``; rounds like
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
