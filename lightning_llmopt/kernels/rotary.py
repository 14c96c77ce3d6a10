"""Rotary position embedding applied in place: the public function, autograd function and custom ops.

- Triton kernel and launcher: :mod:`~lightning_llmopt.kernels.rotary_triton` (imported on first use);
- custom ops ``lightning_llmopt::rotary_`` (mutates ``x``: the forward rotates q or k where they are, no new
  tensor) and ``lightning_llmopt::rotary`` (out of place: the backward, the rotation by the opposite angle), with
  fake implementations so ``torch.compile`` traces them;
- :class:`RotaryFunction`: the in-place forward under autograd (``mark_dirty``); it saves only ``cos``/``sin`` and
  the positions, nothing of the size of q or k. One tensor per call: autograd does not allow a function that
  modifies a view in place to return two tensors, so q and k take one launch each;
- :func:`apply_rotary_`, which picks the kernel or the reference
  (:func:`~lightning_llmopt.kernels.fused_ref.rotary_ref`, written back with ``copy_``);
- :func:`apply_rotary`, what the model's rotary module calls: in place where that costs nothing more, out of place
  for views under autograd and under ``torch.compile`` (:class:`RotaryOutFunction`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_llmopt.kernels.fused_common import KERNEL_DTYPES, resolve_backend
from lightning_llmopt.kernels.fused_ref import rotary_ref

__all__ = ["RotaryFunction", "RotaryOutFunction", "apply_rotary", "apply_rotary_"]


@torch.library.custom_op("lightning_llmopt::rotary_", mutates_args=("x",))
def rotary_inplace(x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor | None, inverse: bool) -> None:
    """Rotate ``x`` ``(B, T, H, D)`` in place."""
    from lightning_llmopt.kernels.rotary_triton import rotary_launch

    rotary_launch(x, x, cos, sin, positions, inverse)


@rotary_inplace.register_fake
def _(x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor | None, inverse: bool) -> None:
    return None


@torch.library.custom_op("lightning_llmopt::rotary", mutates_args=())
def rotary_out(x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor | None, inverse: bool) -> Tensor:
    """Rotated copy of ``x`` ``(B, T, H, D)``."""
    from lightning_llmopt.kernels.rotary_triton import rotary_launch

    out = torch.empty_like(x)
    rotary_launch(x, out, cos, sin, positions, inverse)
    return out


@rotary_out.register_fake
def _(x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor | None, inverse: bool) -> Tensor:
    return torch.empty_like(x)


class RotaryFunction(torch.autograd.Function):
    """In-place rotation of one ``(B, T, H, D)`` tensor; gradients for ``x`` only (cos/sin are constants)."""

    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor | None) -> Tensor:  # type: ignore
        if torch.compiler.is_compiling():
            torch.ops.lightning_llmopt.rotary_(x, cos, sin, positions, False)
        else:  # eager: the launcher directly (the custom-op dispatch costs about as much as the kernel)
            from lightning_llmopt.kernels.rotary_triton import rotary_launch

            rotary_launch(x, x, cos, sin, positions, False)
        ctx.mark_dirty(x)
        ctx.save_for_backward(cos, sin, positions)
        return x

    @staticmethod
    def backward(ctx, dy: Tensor):  # type: ignore[override]
        cos, sin, positions = ctx.saved_tensors
        dy = dy if dy.stride(-1) == 1 else dy.contiguous()
        if torch.compiler.is_compiling():
            return torch.ops.lightning_llmopt.rotary(dy, cos, sin, positions, True), None, None, None
        from lightning_llmopt.kernels.rotary_triton import rotary_launch

        dx = torch.empty_like(dy)
        rotary_launch(dy, dx, cos, sin, positions, True)
        return dx, None, None, None


def _rotated(x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor | None, inverse: bool) -> Tensor:
    """A rotated copy of ``x``: the custom op while ``torch.compile`` traces, else the launcher directly."""
    if torch.compiler.is_compiling():
        return torch.ops.lightning_llmopt.rotary(x, cos, sin, positions, inverse)
    from lightning_llmopt.kernels.rotary_triton import rotary_launch

    out = torch.empty_like(x)
    rotary_launch(x, out, cos, sin, positions, inverse)
    return out


class RotaryOutFunction(torch.autograd.Function):
    """Out-of-place rotation (the custom op ``lightning_llmopt::rotary``): what :func:`apply_rotary` uses under
    ``torch.compile``, where functionalizing the in-place op costs copies of ``x`` in the compiled graphs, and in
    eager mode for a view that autograd tracks, where the in-place op costs copies of the view's base in backward."""

    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor | None) -> Tensor:  # type: ignore
        ctx.save_for_backward(cos, sin, positions)
        return _rotated(x, cos, sin, positions, False)

    @staticmethod
    def backward(ctx, dy: Tensor):  # type: ignore[override]
        cos, sin, positions = ctx.saved_tensors
        dy = dy if dy.stride(-1) == 1 else dy.contiguous()
        return _rotated(dy, cos, sin, positions, True), None, None, None


def _prepare(
    x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor | None, backend: str | None
) -> tuple[bool, Tensor, Tensor, Tensor | None]:
    """Checked arguments for a rotation of ``x``: ``(True, cos, sin, None)`` with per-token ``(B, T, D/2)`` tables for
    the PyTorch reference (the backend rule, or a dtype / layout the kernels do not take), else ``(False, cos, sin,
    positions)`` as the kernels take them."""
    _check(x, cos, sin, positions)
    if (
        resolve_backend(backend, x.device, "rotary", defer_to_compiler=True) == "reference"
        or x.dtype not in KERNEL_DTYPES
        or x.stride(-1) != 1
    ):
        if positions is not None:
            cos, sin = cos[positions], sin[positions]  # (B, T, D/2)
        return True, cos.expand(x.shape[0], -1, -1), sin.expand(x.shape[0], -1, -1), None
    if sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    if positions is not None and positions.dtype not in (torch.int32, torch.int64):
        positions = positions.long()
    return False, cos, sin, positions


def _check(x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor | None) -> None:
    if x.ndim != 4 or x.shape[-1] % 2:
        raise ValueError(f"x must be (B, T, H, D) with an even D, got shape {tuple(x.shape)}")
    half = x.shape[-1] // 2
    if cos.shape != sin.shape:
        raise ValueError(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must have the same shape")
    if positions is not None:
        if positions.shape != x.shape[:2]:
            raise ValueError(f"positions {tuple(positions.shape)} must be (B, T) = {tuple(x.shape[:2])}")
        if cos.ndim != 2 or cos.shape[1] != half:
            raise ValueError(f"with positions, cos/sin must be (max_positions, D/2 = {half}), got {tuple(cos.shape)}")
    elif cos.ndim != 3 or cos.shape[1:] != (x.shape[1], half) or cos.shape[0] not in (1, x.shape[0]):
        raise ValueError(
            f"cos/sin must be (B or 1, T, D/2) = ({x.shape[0]}, {x.shape[1]}, {half}) without "
            f"positions, got {tuple(cos.shape)}"
        )


def apply_rotary_(
    x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor | None = None, *, backend: str | None = None
) -> Tensor:
    """Rotate ``x`` in place by rotary position embedding (rotate-half layout, channel ``c`` pairs with ``c + D/2``).

    Shapes:
        x: ``(B, T, H, D)`` with a contiguous last dim (the model's ``(B, H, T, D)`` tensors go in as
            ``x.transpose(1, 2)`` views); fp16/bf16/fp32, rotated in fp32. Returned (the same tensor).
        cos, sin: with ``positions`` ``(B, T)`` int: ``(max_positions, D/2)`` tables; without: per-token values
            ``(B, T, D/2)`` or ``(1, T, D/2)`` (Hugging Face's ``cos[..., :D/2]``). Any float dtype and strides.

    Under autograd ``x`` must not be a leaf that requires grad (as for any in-place op); its gradient is the inverse
    rotation of the incoming one. No gradient flows to ``cos``/``sin``.

    Arguments:
        backend: ``"auto"``, ``"triton"`` or ``"reference"`` (default ``$LLMOPT_FUSED_BACKEND`` or ``"auto"``).
    """
    ref, cos, sin, positions = _prepare(x, cos, sin, positions, backend)
    if ref:  # clone: the reference saves views of its input for backward, which copy_ would overwrite
        return x.copy_(rotary_ref(x.clone(), cos, sin))
    return RotaryFunction.apply(x, cos, sin, positions)


def apply_rotary(
    x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor | None = None, *, backend: str | None = None
) -> Tensor:
    """The rotated ``x`` (arguments as :func:`apply_rotary_`). Use the returned tensor:

    - in place (nothing of ``x``'s size allocated) in eager mode, unless autograd tracks ``x`` as a view: an in-place
      op on a view (the model's q and k are views of their projections) makes autograd's backward allocate, zero
      and copy the view's whole base around the op's gradient, two or three extra passes over q and k per layer;
    - out of place for such views, and under ``torch.compile`` (functionalizing the in-place custom op on views of a
      projection puts copies and clones of ``x`` into the compiled forward and backward).

    Neither way saves anything of ``x``'s size for backward."""
    if not torch.compiler.is_compiling() and not (x.requires_grad and torch.is_grad_enabled() and x._is_view()):
        return apply_rotary_(x, cos, sin, positions, backend=backend)
    ref, cos, sin, positions = _prepare(x, cos, sin, positions, backend)
    if ref:
        return rotary_ref(x, cos, sin)
    return RotaryOutFunction.apply(x, cos, sin, positions)
