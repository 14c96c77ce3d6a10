"""RMSNorm module on the fused kernel (:func:`lightning_llmopt.kernels.rmsnorm.rms_norm`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_llmopt.kernels.fused_common import autocast_dtype
from lightning_llmopt.kernels.rmsnorm import add_rms_norm, rms_norm, rms_norm_residual
from lightning_llmopt.layers.shards import norm_operands
from lightning_llmopt.models.llama import RMSNorm

__all__ = ["FusedRMSNorm"]


class FusedRMSNorm(RMSNorm):
    """Drop-in :class:`~lightning_llmopt.models.llama.RMSNorm` (same ``weight``, same ``reset_parameters``) running the
    Triton kernel on CUDA and the PyTorch reference elsewhere.

    Arguments:
        dim: normalized size (the last dim of the input).
        eps: added to the mean square.
        cast_to_autocast: under autocast, return the autocast dtype (bf16) instead of the promoted dtype (fp32 for
            an fp32 residual stream and fp32 weight): the consumers of a norm in the Llama family are matmuls, which
            would cast to that dtype anyway, so the fp32 output and its cast are skipped.
        backend: ``"auto"``, ``"triton"`` or ``"reference"`` (see :mod:`lightning_llmopt.kernels.fused_common`).

    Under tensor parallelism the kernel runs on the local shard (:func:`~lightning_llmopt.layers.shards.
    norm_operands`): DTensor inputs keep their layout on the output; for plain-tensor inputs with a DTensor weight,
    :attr:`sequence_parallel` (set by :func:`~lightning_llmopt.parallel.fused.apply_kernels`) says whether they are
    sequence shards, which makes the weight's gradient ``Partial`` (summed over ``tp`` after backward).

    Shapes: ``(..., dim)`` -> ``(..., dim)``.
    """

    sequence_parallel: bool | None = None

    def __init__(
        self, dim: int, eps: float = 1e-5, *, cast_to_autocast: bool = True, backend: str | None = None
    ) -> None:
        super().__init__(dim, eps)
        self.cast_to_autocast = cast_to_autocast
        self.backend = backend

    @property
    def variance_epsilon(self) -> float:
        """Hugging Face's name for ``eps``."""
        return self.eps

    def forward(self, x: Tensor) -> Tensor:
        out_dtype = autocast_dtype(x.device.type) if self.cast_to_autocast else None
        (x,), weight, wrap = norm_operands((x,), self.weight, self.sequence_parallel)
        return wrap(rms_norm(x, weight, self.eps, out_dtype=out_dtype, backend=self.backend))

    def forward_add(self, x: Tensor, r: Tensor) -> tuple[Tensor, Tensor]:
        """``(h, self(h))`` with ``h = x + r``, in one pass each way (:func:`~lightning_llmopt.kernels.rmsnorm.
        add_rms_norm`): the residual add of a pre-norm block and the norm after it. ``TransformerBlock`` uses it for
        its ``ffn_norm``."""
        out_dtype = autocast_dtype(x.device.type) if self.cast_to_autocast else None
        (x, r), weight, wrap = norm_operands((x, r), self.weight, self.sequence_parallel)
        h, normed = add_rms_norm(x, r, weight, self.eps, out_dtype=out_dtype, backend=self.backend)
        return wrap(h), wrap(normed)

    def forward_residual(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``(x, self(x))`` with ``x`` passed through (:func:`~lightning_llmopt.kernels.rmsnorm.rms_norm_residual`):
        use the returned ``x`` for the residual stream, and its gradient joins the norm's input gradient in the norm's
        backward kernel. ``TransformerBlock`` uses it for its ``attention_norm``."""
        out_dtype = autocast_dtype(x.device.type) if self.cast_to_autocast else None
        (x,), weight, wrap = norm_operands((x,), self.weight, self.sequence_parallel)
        x, normed = rms_norm_residual(x, weight, self.eps, out_dtype=out_dtype, backend=self.backend)
        return wrap(x), wrap(normed)

    @classmethod
    def from_module(cls, module: Any, *, cast_to_autocast: bool = True, backend: str | None = None) -> FusedRMSNorm:
        """A fused norm sharing ``module.weight`` (the same ``Parameter``) and its epsilon (``eps`` or Hugging Face's
        ``variance_epsilon``)."""
        weight = module.weight
        eps: Any = getattr(module, "eps", None)
        eps = getattr(module, "variance_epsilon", 1e-6) if eps is None else eps
        with torch.device("meta"):
            new = cls(weight.shape[0], float(eps), cast_to_autocast=cast_to_autocast, backend=backend)
        new.weight = weight
        return new

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, backend={self.backend or 'auto'}"
