"""Grouped GEMM for Mixture-of-Experts: one matmul per expert over that expert's rows, in one kernel launch.

``grouped_mm(x, w, counts)``: ``x`` ``(M, K)`` holds the tokens sorted by expert, ``counts`` ``(E,)`` how many rows
each expert owns (in order), ``w`` ``(E, N, K)`` one ``nn.Linear``-layout weight per expert. Returns ``(M, N)`` with
``y[rows of e] = x[rows of e] @ w[e].T``. Differentiable in ``x`` and ``w``: ``dx`` is the grouped GEMM of ``dy``
with ``w`` transposed, ``dw[e] = dy[rows of e].T @ x[rows of e]``.

Layers (CONVENTIONS.md): Triton kernels in :mod:`~lightning_llmopt.kernels.grouped_gemm_triton` (loaded on first
use); custom ops ``lightning_llmopt::grouped_mm`` and ``lightning_llmopt::grouped_mm_wgrad`` with fake
implementations for ``torch.compile``; :class:`GroupedMM` (autograd); :func:`grouped_mm_ref`, a per-expert loop in
PyTorch that is the CPU path and the test oracle. Backend: the ``backend`` argument, else ``LLMOPT_GROUPED_GEMM``,
else ``"auto"`` (Triton for CUDA tensors when Triton is installed; the reference otherwise). ``"triton"`` on CPU
needs ``TRITON_INTERPRET=1``. ``"torch"`` calls ``torch._grouped_mm`` (CUTLASS on Hopper; differentiable in torch),
which ran 1.5-2.2x faster than our Triton kernel on an H100 in ``benchmarks/bench_grouped_gemm.py`` (record
``grouped-gemm-nvidia-h100-80gb-hbm3``); it is opt-in until its GPU test (odd and empty expert groups) has run.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from lightning_llmopt._triton_env import triton_available, triton_interpreter_enabled

__all__ = ["GroupedMM", "grouped_mm", "grouped_mm_ref", "grouped_mm_torch"]

_ENV = "LLMOPT_GROUPED_GEMM"
_BACKENDS = ("auto", "triton", "reference", "torch")


def grouped_mm_ref(x: Tensor, w: Tensor, counts: Tensor) -> Tensor:
    """Reference: a Python loop over experts (synchronises on ``counts``)."""
    sizes = [int(c) for c in counts.tolist()]
    outs = [chunk @ w[e].t() for e, chunk in enumerate(torch.split(x, sizes)) if sizes[e] > 0]
    if not outs:
        return x.new_zeros((x.shape[0], w.shape[1]))
    return torch.cat(outs)


@torch.library.custom_op("lightning_llmopt::grouped_mm", mutates_args=())
def _grouped_mm_op(x: Tensor, w: Tensor, counts: Tensor) -> Tensor:
    from lightning_llmopt.kernels.grouped_gemm_triton import grouped_mm_triton

    return grouped_mm_triton(x, w, counts)


@_grouped_mm_op.register_fake
def _(x: Tensor, w: Tensor, counts: Tensor) -> Tensor:
    return x.new_empty((x.shape[0], w.shape[1]))


@torch.library.custom_op("lightning_llmopt::grouped_mm_wgrad", mutates_args=())
def _grouped_wgrad_op(dy: Tensor, x: Tensor, counts: Tensor, w_like: Tensor) -> Tensor:
    from lightning_llmopt.kernels.grouped_gemm_triton import grouped_wgrad_triton

    return grouped_wgrad_triton(dy, x, counts, w_like.dtype)


@_grouped_wgrad_op.register_fake
def _(dy: Tensor, x: Tensor, counts: Tensor, w_like: Tensor) -> Tensor:
    return w_like.new_empty(w_like.shape)


class GroupedMM(torch.autograd.Function):
    """Autograd over the two custom ops."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, counts: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, w, counts)
        return _grouped_mm_op(x, w, counts)

    @staticmethod
    def backward(ctx, dy: Tensor) -> tuple[Tensor | None, Tensor | None, None]:  # type: ignore[override]
        x, w, counts = ctx.saved_tensors
        dy = dy.contiguous()
        dx = _grouped_mm_op(dy, w.transpose(1, 2), counts) if ctx.needs_input_grad[0] else None
        dw = _grouped_wgrad_op(dy, x, counts, w) if ctx.needs_input_grad[1] else None
        return dx, dw, None


def resolve_backend(backend: str | None, device: torch.device) -> str:
    name = (backend or os.environ.get(_ENV) or "auto").lower()
    if name not in _BACKENDS:
        raise ValueError(f"grouped GEMM backend ({name!r}) must be one of {_BACKENDS} (argument or ${_ENV})")
    if name == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "reference"
    if name == "triton" and device.type != "cuda" and not triton_interpreter_enabled():
        raise RuntimeError(f"grouped GEMM backend 'triton' on {device.type} tensors needs TRITON_INTERPRET=1")
    if name == "torch" and not hasattr(torch, "_grouped_mm"):
        raise RuntimeError(f"grouped GEMM backend 'torch' needs torch._grouped_mm (torch {torch.__version__} lacks it)")
    return name


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous (``torch._grouped_mm``'s backward rejects
    stride-0 gradients such as the one ``y.sum()`` sends)."""

    @staticmethod
    def forward(ctx, y: Tensor) -> Tensor:  # type: ignore[override]
        return y

    @staticmethod
    def backward(ctx, dy: Tensor) -> Tensor:  # type: ignore[override]
        return dy.contiguous()


def grouped_mm_torch(x: Tensor, w: Tensor, counts: Tensor) -> Tensor:
    """``torch._grouped_mm`` with group end offsets from ``counts`` (int32); autograd is torch's."""
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    return _ContiguousGrad.apply(torch._grouped_mm(x, w.transpose(1, 2), offs=offs))


def grouped_mm(x: Tensor, w: Tensor, counts: Tensor, backend: str | None = None) -> Tensor:
    """``(M, K), (E, N, K), (E,) -> (M, N)``; see the module docstring. ``x`` and ``w`` share a dtype."""
    if x.ndim != 2 or w.ndim != 3 or counts.ndim != 1:
        raise ValueError(
            f"grouped_mm expects x (M, K), w (E, N, K), counts (E,); got {tuple(x.shape)}, "
            f"{tuple(w.shape)}, {tuple(counts.shape)}"
        )
    if w.shape[0] != counts.shape[0] or w.shape[2] != x.shape[1]:
        raise ValueError(f"w {tuple(w.shape)} must be (E={counts.shape[0]}, N, K={x.shape[1]})")
    if x.dtype != w.dtype:
        raise ValueError(f"x ({x.dtype}) and w ({w.dtype}) must have the same dtype")
    name = resolve_backend(backend, x.device)
    if name == "reference":
        return grouped_mm_ref(x, w, counts)
    if name == "torch":
        return grouped_mm_torch(x.contiguous(), w, counts)
    return GroupedMM.apply(x.contiguous(), w, counts)
