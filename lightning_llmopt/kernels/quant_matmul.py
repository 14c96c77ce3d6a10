"""Weight-only quantized matmul: the public function, its autograd function and its ``torch.library`` custom op.

Layers (CONVENTIONS.md, "three layers per kernel"):

- the Triton kernels and launcher, :mod:`~lightning_llmopt.kernels.quant_matmul_fwd` (the tensor-core kernel and
  the launcher; the batch-1 kernels in ``quant_matmul_gemv``, shared pieces in ``quant_matmul_tiles``, the
  configuration choice and ``qmm_fwd`` (launch with the chosen configuration) in ``quant_matmul_tune``; imported on
  first use, so importing this module imports no Triton);
- the custom op ``lightning_llmopt::quant_matmul`` with a fake (meta) implementation, so ``torch.compile`` traces
  through it;
- :class:`QuantMatmulFunction` (``torch.autograd.Function``): the input gradient ``dy @ dequant(W)`` (weights are
  frozen buffers; quantization-aware training uses fake quantization instead,
  :mod:`lightning_llmopt.quantization.qat`);
- :func:`quant_matmul`, which validates the inputs and picks the Triton path or the reference
  (:func:`~lightning_llmopt.kernels.quant_matmul_ref.quant_matmul_ref`); in eager inference (no gradient needed,
  not compiling) it calls the launcher directly, skipping the op and autograd layers' dispatch cost;
- the module: :class:`lightning_llmopt.layers.quantized_linear.QuantizedLinear`.

Backend switch: the ``backend`` argument, else ``$LLMOPT_QUANT_BACKEND``, else ``"auto"``: ``"triton"`` forces the
kernel (on CPU only under ``TRITON_INTERPRET=1``), ``"reference"`` forces PyTorch, ``"auto"`` takes Triton for CUDA
tensors in formats the kernel has (4 or 8 bits; per-channel or groups that are multiples of 16, 32 for 4 bits) and
the reference otherwise.
"""

from __future__ import annotations

import functools
import os

import torch
from torch import Tensor

from lightning_llmopt._triton_env import triton_available, triton_interpreter_enabled
from lightning_llmopt.kernels.quant_matmul_ref import dequantize_packed, quant_matmul_ref
from lightning_llmopt.kernels.quant_packing import as_kernel_bytes

__all__ = ["QuantMatmulFunction", "kernel_supports", "quant_matmul", "resolve_quant_backend"]

_ENV = "LLMOPT_QUANT_BACKEND"
_BACKENDS = ("auto", "triton", "reference")
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@torch.library.custom_op("lightning_llmopt::quant_matmul", mutates_args=())
def quant_matmul_op(
    x: Tensor, qweight: Tensor, scales: Tensor, zeros: Tensor | None, bits: int, split_k: int
) -> Tensor:
    """Triton kernel: ``x`` ``(M, K)`` -> ``(M, N)``; ``split_k <= 0`` lets the launcher choose."""
    from lightning_llmopt.kernels.quant_matmul_tune import qmm_fwd  # imports Triton (optional dependency)

    codes = as_kernel_bytes(qweight, bits, x.shape[1])
    return qmm_fwd(x, codes, scales, zeros, bits, split_k=split_k if split_k > 0 else None)


@quant_matmul_op.register_fake
def _(x: Tensor, qweight: Tensor, scales: Tensor, zeros: Tensor | None, bits: int, split_k: int) -> Tensor:
    return x.new_empty((x.shape[0], qweight.shape[0]))


class QuantMatmulFunction(torch.autograd.Function):
    """Autograd over the custom op: gradient for ``x`` only."""

    @staticmethod
    def forward(
        ctx,
        x: Tensor,
        qweight: Tensor,
        scales: Tensor,
        zeros: Tensor | None,
        bits: int,  # type: ignore
        split_k: int,
    ) -> Tensor:
        ctx.save_for_backward(qweight, scales, zeros)
        ctx.bits = bits
        ctx.in_features = x.shape[1]
        return torch.ops.lightning_llmopt.quant_matmul(x, qweight, scales, zeros, bits, split_k)

    @staticmethod
    def backward(ctx, dy: Tensor):  # type: ignore[override]
        qweight, scales, zeros = ctx.saved_tensors
        w = dequantize_packed(qweight, scales, zeros, ctx.bits, ctx.in_features, dtype=dy.dtype)
        return dy @ w, None, None, None, None, None


def kernel_supports(bits: int, in_features: int, groups: int) -> bool:
    """Whether the Triton kernel handles this format: 4 or 8 bits, per-channel or groups of a multiple of 16
    columns (32 for 4 bits: the tensor-core kernel's K tile lies in one group and holds two 16-column halves), an
    even number of input columns for 4 bits."""
    if bits not in (4, 8) or in_features % groups != 0:
        return False
    group = in_features // groups
    if bits == 4 and in_features % 2:
        return False
    return groups == 1 or group % (32 if bits == 4 else 16) == 0


def resolve_quant_backend(backend: str | None, device: torch.device, supported: bool = True) -> str:
    """``"triton"`` or ``"reference"`` for a call on ``device`` (see the module docstring for the rule)."""
    name = (backend or os.environ.get(_ENV) or "auto").lower()
    if name not in _BACKENDS:
        raise ValueError(f"quant matmul backend ({name!r}) must be one of {_BACKENDS} (argument or ${_ENV})")
    if name == "auto":
        return "triton" if device.type == "cuda" and triton_available() and supported else "reference"
    if name == "triton":
        if not supported:
            raise ValueError(
                "backend 'triton' needs 4- or 8-bit codes, per-channel scales or groups of a multiple "
                "of 16 columns (32 for 4 bits), and an even in_features for 4 bits"
            )
        if not triton_available():
            raise RuntimeError("quant matmul backend 'triton' needs the triton package (pip install triton)")
        if device.type != "cuda" and not triton_interpreter_enabled():
            raise RuntimeError(
                f"quant matmul backend 'triton' on {device.type} tensors needs TRITON_INTERPRET=1 "
                "set before the kernels are first imported"
            )
    return name


def _validate(x: Tensor, qweight: Tensor, scales: Tensor, zeros: Tensor | None, bits: int) -> None:
    if x.ndim != 2:
        raise ValueError(f"x must be (M, K), got shape {tuple(x.shape)}")
    if qweight.dtype != torch.int32 or qweight.ndim != 2:
        raise ValueError(f"qweight must be 2-D int32 (N, K * bits / 32), got {qweight.dtype} {tuple(qweight.shape)}")
    k, n = x.shape[1], qweight.shape[0]
    if qweight.shape[1] * 32 < k * bits:
        raise ValueError(f"qweight has {qweight.shape[1]} words per row: too few for K={k} codes of {bits} bits")
    if scales.ndim != 2 or scales.shape[0] != n or k % scales.shape[1] != 0:
        raise ValueError(f"scales must be (N={n}, K/G) with K={k} divisible by K/G, got {tuple(scales.shape)}")
    if zeros is not None and (zeros.shape != scales.shape or zeros.dtype != torch.uint8):
        raise ValueError(
            f"zeros must be uint8 of the scales' shape {tuple(scales.shape)}, got {zeros.dtype} {tuple(zeros.shape)}"
        )


def quant_matmul(
    x: Tensor,
    qweight: Tensor,
    scales: Tensor,
    zeros: Tensor | None = None,
    *,
    bits: int = 4,
    split_k: int | None = None,
    backend: str | None = None,
) -> Tensor:
    """``x @ dequant(W)^T`` for a weight stored as packed integer codes.

    Arguments:
        x: ``(M, K)`` fp16/bf16/fp32 activations.
        qweight: int32 ``(N, ceil(K * bits / 32))``, codes packed along ``K``
            (:mod:`lightning_llmopt.kernels.quant_packing`).
        scales: ``(N, K / G)`` (any float dtype; ``K / G = 1`` is per-channel).
        zeros: uint8 ``(N, K / G)`` zero-point codes, or ``None`` for symmetric (zero ``2**(bits-1)``).
        bits: code width (the kernel: 4 or 8; other widths run the reference).
        split_k: force the number of K slices (tests); default: autotuned on GPU.
        backend: ``"auto"``, ``"triton"`` or ``"reference"`` (default ``$LLMOPT_QUANT_BACKEND`` or ``"auto"``).

    Returns ``(M, N)`` in ``x.dtype`` (fp32 accumulation).
    """
    _validate(x, qweight, scales, zeros, bits)
    supported = kernel_supports(bits, x.shape[1], scales.shape[1]) and x.dtype in _DTYPES
    if resolve_quant_backend(backend, x.device, supported) == "reference":
        return quant_matmul_ref(x, qweight, scales, zeros, bits)
    x = x if x.stride(-1) == 1 else x.contiguous()
    scales = scales.contiguous()
    zeros = zeros.contiguous() if zeros is not None else None
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and x.requires_grad):
        return QuantMatmulFunction.apply(x, qweight.contiguous(), scales, zeros, bits, split_k or 0)
    # Eager inference: call the launcher directly; the custom op and autograd layers cost more than a decode-sized
    # kernel runs (tens of microseconds of Python per call).
    return _launcher()(x, as_kernel_bytes(qweight.contiguous(), bits, x.shape[1]), scales, zeros, bits, split_k)


@functools.cache
def _launcher():  # type: ignore[no-untyped-def]
    from lightning_llmopt.kernels.quant_matmul_tune import qmm_fwd  # imports Triton (optional dependency)

    return qmm_fwd
