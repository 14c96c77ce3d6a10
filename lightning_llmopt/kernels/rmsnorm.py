"""RMSNorm: the public function, its autograd function and its ``torch.library`` custom ops.

- Triton kernels and launchers: :mod:`~lightning_llmopt.kernels.rmsnorm_triton` (imported on first use);
- custom ops ``lightning_llmopt::rms_norm_fwd`` / ``::rms_norm_bwd`` with fake implementations, so
  ``torch.compile`` traces them;
- :class:`RMSNormFunction` (``torch.autograd.Function``) over the two ops; it saves ``x`` and the fp32 ``1/rms`` of
  each row (4 bytes a row) instead of the fp32 intermediates eager PyTorch keeps;
- :func:`rms_norm`, which picks the kernels or :func:`~lightning_llmopt.kernels.fused_ref.rms_norm_ref`
  (backend switch: :mod:`~lightning_llmopt.kernels.fused_common`);
- :func:`add_rms_norm` (:class:`AddRMSNormFunction`): ``h = x + r`` and the norm of ``h`` in one pass, and in
  backward the residual stream's gradient added into the norm's input gradient in the same pass (a pre-norm block's
  ``h = x + attn(...)`` followed by ``ffn_norm(h)``). Under ``torch.compile`` it is the plain add and
  :func:`rms_norm`, which the compiler fuses itself. Its backward writes the bf16 gradient of a bf16 branch output
  in the same pass as the fp32 one of an fp32 residual stream;
- :func:`rms_norm_residual` (:class:`RMSNormResidualFunction`): the block's first norm, passing ``x`` through so the
  residual stream's gradient joins the norm's input gradient in its backward kernel.
"""

from __future__ import annotations

from typing import overload

import torch
from torch import Tensor

from lightning_llmopt.kernels.fused_common import KERNEL_DTYPES, resolve_backend
from lightning_llmopt.kernels.fused_ref import rms_norm_ref

__all__ = [
    "AddRMSNormFunction",
    "RMSNormFunction",
    "RMSNormResidualFunction",
    "add_rms_norm",
    "rms_norm",
    "rms_norm_residual",
]


@torch.library.custom_op("lightning_llmopt::rms_norm_fwd", mutates_args=())
def rms_norm_fwd(x: Tensor, weight: Tensor, eps: float, out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``x`` ``(N, D)`` -> ``(y, rstd)``: ``y`` ``(N, D)`` in ``out_dtype``, ``rstd`` ``(N,)`` fp32."""
    from lightning_llmopt.kernels.rmsnorm_triton import rms_norm_fwd_launch

    return rms_norm_fwd_launch(x, weight, eps, out_dtype)


@rms_norm_fwd.register_fake
def _(x: Tensor, weight: Tensor, eps: float, out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    return x.new_empty(x.shape, dtype=out_dtype), x.new_empty((x.shape[0],), dtype=torch.float32)


@torch.library.custom_op("lightning_llmopt::rms_norm_bwd", mutates_args=())
def rms_norm_bwd(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    """``(dx, dweight)``."""
    from lightning_llmopt.kernels.rmsnorm_triton import rms_norm_bwd_launch

    dx, dw = rms_norm_bwd_launch(dy, x, weight, rstd)
    return dx, dw


@rms_norm_bwd.register_fake
def _(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(weight)


class RMSNormFunction(torch.autograd.Function):
    """Autograd over the two custom ops; ``x`` is ``(N, D)`` with a contiguous last dim.

    Eager calls go to the launchers directly (the custom-op dispatch costs tens of microseconds a call, as much as
    a small kernel takes); under ``torch.compile`` the ops are traced.
    """

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float, out_dtype: torch.dtype) -> Tensor:  # type: ignore
        if torch.compiler.is_compiling():
            y, rstd = torch.ops.lightning_llmopt.rms_norm_fwd(x, weight, eps, out_dtype)
        else:
            from lightning_llmopt.kernels.rmsnorm_triton import rms_norm_fwd_launch

            # without a backward to come (inference, no_grad) the per-row statistics are not written
            y, rstd = rms_norm_fwd_launch(x, weight, eps, out_dtype, store_rstd=any(ctx.needs_input_grad[:2]))
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):  # type: ignore[override]
        x, weight, rstd = ctx.saved_tensors
        dy = dy if dy.stride(-1) == 1 else dy.contiguous()
        if torch.compiler.is_compiling():
            dx, dw = torch.ops.lightning_llmopt.rms_norm_bwd(dy, x, weight, rstd)
        else:
            from lightning_llmopt.kernels.rmsnorm_triton import rms_norm_bwd_launch

            dx, dw = rms_norm_bwd_launch(dy, x, weight, rstd)
        return dx, dw, None, None


def _check_weight(x: Tensor, weight: Tensor) -> int:
    """The normalized size ``D`` (x's last dim), after checking that ``weight`` is ``(D,)``."""
    d = x.shape[-1]
    if weight.shape != (d,):
        raise ValueError(f"weight shape {tuple(weight.shape)} must be ({d},), the last dim of x {tuple(x.shape)}")
    return d


def rms_norm(
    x: Tensor, weight: Tensor, eps: float = 1e-5, *, out_dtype: torch.dtype | None = None, backend: str | None = None
) -> Tensor:
    """Root-mean-square norm ``round_to(x.dtype)(x / sqrt(mean(x^2) + eps)) * weight`` over the last dim.

    Shapes: ``x`` ``(..., D)`` (any strides), ``weight`` ``(D,)``; returns ``(..., D)`` in ``out_dtype``, default
    the promotion of x's and weight's dtypes (what Llama's and Hugging Face's ``normed.to(x.dtype) * weight`` gives).
    A narrower ``out_dtype`` (e.g. bf16 from an fp32 residual stream under autocast) saves the cast the next matmul
    would do. Statistics in fp32. fp16/bf16/fp32 in the kernels; other dtypes (fp64) take the reference.

    Arguments:
        eps: added to the mean square.
        backend: ``"auto"``, ``"triton"`` or ``"reference"`` (default ``$LLMOPT_FUSED_BACKEND`` or ``"auto"``).
    """
    d = _check_weight(x, weight)
    out_dtype = out_dtype or torch.promote_types(x.dtype, weight.dtype)
    if (
        resolve_backend(backend, x.device, "rms_norm", defer_to_compiler=True) == "reference"
        or x.dtype not in KERNEL_DTYPES
        or weight.dtype not in KERNEL_DTYPES
        or out_dtype not in KERNEL_DTYPES
    ):
        return rms_norm_ref(x, weight, eps, out_dtype=out_dtype)
    x2 = x.reshape(-1, d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    return RMSNormFunction.apply(x2, w, float(eps), out_dtype).view(*x.shape[:-1], d)


@overload
def _unit_stride(t: Tensor) -> Tensor: ...
@overload
def _unit_stride(t: Tensor | None) -> Tensor | None: ...
def _unit_stride(t: Tensor | None) -> Tensor | None:
    """``t`` with a contiguous last dim (an incoming gradient may be a strided view), or None."""
    return t if t is None or t.stride(-1) == 1 else t.contiguous()


class AddRMSNormFunction(torch.autograd.Function):
    """``(h, y)`` with ``h = x + r`` (the promoted dtype) and ``y = rms_norm(h)``; ``x``, ``r`` ``(N, D)`` with a
    contiguous last dim. Saves ``h`` and the fp32 ``1/rms`` of each row, as :class:`RMSNormFunction` saves ``x``."""

    @staticmethod
    def forward(ctx, x: Tensor, r: Tensor, weight: Tensor, eps: float, out_dtype: torch.dtype):  # type: ignore
        from lightning_llmopt.kernels.rmsnorm_triton import rms_norm_fwd_launch

        y, rstd, h = rms_norm_fwd_launch(x, weight, eps, out_dtype, residual=r)  # type: ignore[misc]
        ctx.save_for_backward(h, weight, rstd)
        ctx.dtypes = (x.dtype, r.dtype)
        return h, y

    @staticmethod
    def backward(ctx, dh: Tensor | None, dy: Tensor):  # type: ignore[override]
        from lightning_llmopt.kernels.rmsnorm_triton import rms_norm_bwd_launch

        h, weight, rstd = ctx.saved_tensors
        dy, dh = _unit_stride(dy), _unit_stride(dh)
        x_dtype, r_dtype = ctx.dtypes
        other = next((t for t in (x_dtype, r_dtype) if t != h.dtype), None)  # a bf16 branch beside an fp32 stream
        if other is None:
            dh_total, dw = rms_norm_bwd_launch(dy, h, weight, rstd, dres=dh)
            return dh_total, dh_total, dw, None, None
        dh_total, dw, dh_other = rms_norm_bwd_launch(dy, h, weight, rstd, dres=dh, dx2_dtype=other)
        return (
            (dh_total if x_dtype == h.dtype else dh_other),
            (dh_total if r_dtype == h.dtype else dh_other),
            dw,
            None,
            None,
        )


class RMSNormResidualFunction(torch.autograd.Function):
    """``(x, rms_norm(x))``: ``x`` passed through as a second output, so that its gradient along the residual
    stream comes back into this function's backward and joins the norm's input gradient in the backward kernel
    (``dres``), instead of autograd adding the two ``(N, D)`` gradients of ``x`` in a pass of its own. Saves what
    :class:`RMSNormFunction` saves."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float, out_dtype: torch.dtype):  # type: ignore
        from lightning_llmopt.kernels.rmsnorm_triton import rms_norm_fwd_launch

        y, rstd = rms_norm_fwd_launch(x, weight, eps, out_dtype)
        ctx.save_for_backward(x, weight, rstd)
        return x.view_as(x), y

    @staticmethod
    def backward(ctx, dx_stream: Tensor | None, dy: Tensor):  # type: ignore[override]
        from lightning_llmopt.kernels.rmsnorm_triton import rms_norm_bwd_launch

        x, weight, rstd = ctx.saved_tensors
        dx, dw = rms_norm_bwd_launch(_unit_stride(dy), x, weight, rstd, dres=_unit_stride(dx_stream))
        return dx, dw, None, None


def rms_norm_residual(
    x: Tensor, weight: Tensor, eps: float = 1e-5, *, out_dtype: torch.dtype | None = None, backend: str | None = None
) -> tuple[Tensor, Tensor]:
    """``(x, rms_norm(x, weight, eps, out_dtype=out_dtype))`` for a pre-norm block's first norm; use the returned
    ``x`` (an alias of the input, no copy) for the residual stream. Then ``x`` has one consumer in the autograd
    graph, and the backward kernel adds the stream's gradient into the norm's input gradient: one pass instead of the
    norm's backward plus autograd's accumulation of the two gradients of ``x``. Values and gradients are those of
    ``rms_norm(x)`` with ``x`` used twice. Under ``torch.compile`` (the compiler fuses the accumulation itself), with
    the reference backend or without autograd: ``x`` itself and :func:`rms_norm`."""
    d = _check_weight(x, weight)
    out_dtype = out_dtype or torch.promote_types(x.dtype, weight.dtype)
    if (
        torch.compiler.is_compiling()
        or not torch.is_grad_enabled()
        or not (x.requires_grad or weight.requires_grad)
        or resolve_backend(backend, x.device, "rms_norm_residual", defer_to_compiler=True) == "reference"
        or any(t not in KERNEL_DTYPES for t in (x.dtype, weight.dtype, out_dtype))
        or not x.is_contiguous()
    ):
        return x, rms_norm(x, weight, eps, out_dtype=out_dtype, backend=backend)
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    x_out, y = RMSNormResidualFunction.apply(x.view(-1, d), w, float(eps), out_dtype)
    return x_out.view(x.shape), y.view(x.shape)


def add_rms_norm(
    x: Tensor,
    r: Tensor,
    weight: Tensor,
    eps: float = 1e-5,
    *,
    out_dtype: torch.dtype | None = None,
    backend: str | None = None,
) -> tuple[Tensor, Tensor]:
    """``(h, rms_norm(h, weight, eps, out_dtype=out_dtype))`` with ``h = x + r``, in one pass each way.

    Shapes: ``x``, ``r`` ``(..., D)``, ``weight`` ``(D,)``; ``h`` in the promotion of x's and r's dtypes (an fp32
    residual stream plus a bf16 branch output gives fp32, as ``x + r`` does), ``y`` as :func:`rms_norm` gives it.
    Gradients equal those of ``h = x + r; y = rms_norm(h)`` (the add's gradient goes to both inputs in their dtypes).
    """
    if x.shape != r.shape:
        raise ValueError(f"x {tuple(x.shape)} and r {tuple(r.shape)} must have the same shape")
    d = _check_weight(x, weight)
    h_dtype = torch.promote_types(x.dtype, r.dtype)
    out_dtype = out_dtype or torch.promote_types(h_dtype, weight.dtype)
    if (
        torch.compiler.is_compiling()
        or resolve_backend(backend, x.device, "add_rms_norm", defer_to_compiler=True) == "reference"
        or any(t not in KERNEL_DTYPES for t in (x.dtype, r.dtype, weight.dtype, out_dtype))
    ):
        h = x + r
        return h, rms_norm(h, weight, eps, out_dtype=out_dtype, backend=backend)
    x2, r2 = (t.reshape(-1, d) for t in (x, r))
    x2, r2 = (t if t.stride(-1) == 1 else t.contiguous() for t in (x2, r2))
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    h, y = AddRMSNormFunction.apply(x2, r2, w, float(eps), out_dtype)
    return h.view(*x.shape[:-1], d), y.view(*x.shape[:-1], d)
