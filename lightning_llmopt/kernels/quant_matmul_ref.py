"""Pure-PyTorch reference of :func:`lightning_llmopt.kernels.quant_matmul`: the CPU fallback and the test oracle.

``y = x @ dequant(W)^T`` for a weight stored as packed integer codes (layout:
:mod:`lightning_llmopt.kernels.quant_packing`), with

    dequant(W)[n, k] = (code[n, k] - zero[n, k // G]) * scale[n, k // G],   G = K / scales.shape[1]

and ``zero = 2**(bits - 1)`` when ``zeros`` is ``None`` (symmetric).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_llmopt.kernels.quant_packing import unpack_bits

__all__ = ["dequantize_packed", "quant_matmul_ref"]


def dequantize_packed(
    qweight: Tensor,
    scales: Tensor,
    zeros: Tensor | None,
    bits: int,
    in_features: int,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """``(N, K)`` weight in ``dtype`` from int32 ``qweight`` ``(N, ceil(K * bits / 32))``, ``scales``/``zeros``
    ``(N, K / G)`` (``zeros`` uint8 codes or ``None``). The arithmetic is fp32 (fp64 if ``dtype`` is fp64)."""
    n, k = qweight.shape[0], in_features
    groups = scales.shape[1]
    if k % groups != 0:
        raise ValueError(f"in_features ({k}) must be a multiple of the number of scale groups ({groups})")
    math_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    codes = unpack_bits(qweight, bits, k).to(math_dtype).reshape(n, groups, k // groups)
    zero = (
        zeros.to(math_dtype)
        if zeros is not None
        else torch.full(scales.shape, float(1 << (bits - 1)), dtype=math_dtype, device=scales.device)
    )
    w = (codes - zero[..., None]) * scales.to(math_dtype)[..., None]
    return w.reshape(n, k).to(dtype)


def quant_matmul_ref(
    x: Tensor, qweight: Tensor, scales: Tensor, zeros: Tensor | None = None, bits: int = 4, upcast: bool = True
) -> Tensor:
    """``x @ dequant(W)^T``; ``x`` ``(M, K)`` -> ``(M, N)`` in ``x.dtype``.

    Arguments:
        upcast: dequantize and multiply in fp32 (fp64 for fp64 inputs); ``False`` dequantizes to ``x.dtype`` and
            multiplies in it: "plain PyTorch in the same dtype", the error the kernel tests allow twice of.
    """
    compute = torch.promote_types(x.dtype, torch.float32) if upcast else x.dtype
    w = dequantize_packed(qweight, scales, zeros, bits, x.shape[-1], dtype=compute)
    return (x.to(compute) @ w.t()).to(x.dtype)
