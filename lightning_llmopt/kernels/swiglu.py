"""SwiGLU activation ``silu(gate) * up``: the public function, its autograd function and its custom ops.

- Triton kernels and launchers: :mod:`~lightning_llmopt.kernels.swiglu_triton` (imported on first use);
- custom ops ``lightning_llmopt::swiglu_fwd`` / ``::swiglu_bwd`` with fake implementations;
- :class:`SwiGLUFunction`: saves ``gate`` and ``up`` only (eager PyTorch also keeps ``silu(gate)``), recomputes the
  sigmoid in the backward;
- :func:`swiglu`, which picks the kernels or :func:`~lightning_llmopt.kernels.fused_ref.swiglu_ref`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_llmopt.kernels.fused_common import KERNEL_DTYPES, resolve_backend
from lightning_llmopt.kernels.fused_ref import swiglu_ref

__all__ = ["SwiGLUFunction", "swiglu"]


@torch.library.custom_op("lightning_llmopt::swiglu_fwd", mutates_args=())
def swiglu_fwd(gate: Tensor, up: Tensor) -> Tensor:
    """``silu(gate) * up``, contiguous, gate's dtype."""
    from lightning_llmopt.kernels.swiglu_triton import swiglu_fwd_launch

    return swiglu_fwd_launch(gate, up)


@swiglu_fwd.register_fake
def _(gate: Tensor, up: Tensor) -> Tensor:
    return gate.new_empty(gate.shape)


@torch.library.custom_op("lightning_llmopt::swiglu_bwd", mutates_args=())
def swiglu_bwd(dh: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    """``(dgate, dup)``."""
    from lightning_llmopt.kernels.swiglu_triton import swiglu_bwd_launch

    return swiglu_bwd_launch(dh, gate, up)


@swiglu_bwd.register_fake
def _(dh: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    return gate.new_empty(gate.shape), up.new_empty(up.shape)


class SwiGLUFunction(torch.autograd.Function):
    """Autograd over the two custom ops (eager calls go to the launchers directly: the custom-op dispatch costs tens
    of microseconds a call; under ``torch.compile`` the ops are traced)."""

    @staticmethod
    def forward(ctx, gate: Tensor, up: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(gate, up)
        if torch.compiler.is_compiling():
            return torch.ops.lightning_llmopt.swiglu_fwd(gate, up)
        from lightning_llmopt.kernels.swiglu_triton import swiglu_fwd_launch

        return swiglu_fwd_launch(gate, up)

    @staticmethod
    def backward(ctx, dh: Tensor):  # type: ignore[override]
        gate, up = ctx.saved_tensors
        if torch.compiler.is_compiling():
            return torch.ops.lightning_llmopt.swiglu_bwd(dh, gate, up)
        from lightning_llmopt.kernels.swiglu_triton import swiglu_bwd_launch

        return swiglu_bwd_launch(dh, gate, up)


def swiglu(gate: Tensor, up: Tensor, *, backend: str | None = None) -> Tensor:
    """``silu(gate) * up`` computed in fp32 with one rounding (Shazeer, arXiv 2002.05202).

    Shapes: ``gate`` and ``up`` of the same shape ``(..., F)`` and dtype (fp16/bf16/fp32 in the kernels; other
    dtypes take the reference); any strides with a contiguous last dim. Returns a contiguous tensor of that shape.

    Arguments:
        backend: ``"auto"``, ``"triton"`` or ``"reference"`` (default ``$LLMOPT_FUSED_BACKEND`` or ``"auto"``).
    """
    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} must have the same shape")
    if gate.dtype != up.dtype:
        raise ValueError(f"gate ({gate.dtype}) and up ({up.dtype}) must have the same dtype")
    if (
        resolve_backend(backend, gate.device, "swiglu", defer_to_compiler=True) == "reference"
        or gate.dtype not in KERNEL_DTYPES
    ):
        return swiglu_ref(gate, up)
    return SwiGLUFunction.apply(gate, up)
