"""A quantized weight matrix (:class:`QuantizedWeight`) and round-to-nearest quantization (:func:`rtn_quantize`).

Storage of an ``(N, K)`` weight (``N`` output features, ``K`` input features), ``G`` columns per scale:

- ``packed``: int32 ``(N, ceil(K * bits / 32))``, the codes packed along ``K``
  (:mod:`~lightning_llmopt.quantization.packing`);
- ``scales``: ``(N, K / G)`` in ``scale_dtype`` (fp16 by default, as GPTQ checkpoints and the fast int4 kernels of
  other tools); codes are computed with the already rounded scales, so the stored pair reproduces exactly what the
  error of the quantizer saw;
- ``zeros``: uint8 ``(N, K / G)`` codes of the zero point, or ``None`` for a symmetric grid (zero ``2**(bits-1)``);
- ``perm``: ``None``, or int64 ``(K,)`` for activation order (GPTQ ``act_order``): stored column ``j`` holds input
  column ``perm[j]``, groups are consecutive in stored order, and a matmul reads ``x[..., perm]``.

Dequantized weight: ``W[:, perm[j]] = (code[:, j] - zero[:, j // G]) * scale[:, j // G]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_llmopt.quantization.observers import Observer, get_observer
from lightning_llmopt.quantization.packing import pack_bits, unpack_bits
from lightning_llmopt.quantization.spec import QuantSpec, quantize_codes


def round_scale(scale: Tensor, dtype: torch.dtype) -> Tensor:
    """``scale`` rounded to ``dtype`` and back to fp32, never 0 (an underflow becomes the dtype's tiniest value)."""
    rounded = scale.to(dtype)
    tiny = torch.finfo(dtype).tiny
    return torch.where(rounded > 0, rounded, torch.full_like(rounded, tiny)).float()


@dataclass
class QuantizedWeight:
    """Codes, scales and zero points of one ``(N, K)`` weight (layout in the module docstring).

    Arguments:
        packed: int32 ``(N, ceil(K * bits / 32))``.
        scales: ``(N, K // group_size)``.
        zeros: uint8 ``(N, K // group_size)`` or ``None`` (symmetric).
        bits: code width.
        group_size: input columns per scale (``K`` for per-channel or per-tensor).
        in_features: ``K``.
        perm: ``None`` or int64 ``(K,)`` (activation order).
    """

    packed: Tensor
    scales: Tensor
    zeros: Tensor | None
    bits: int
    group_size: int
    in_features: int
    perm: Tensor | None = None

    def __post_init__(self) -> None:
        n, k = self.packed.shape[0], self.in_features
        if k % self.group_size != 0:
            raise ValueError(f"in_features ({k}) must be divisible by group_size ({self.group_size})")
        if tuple(self.scales.shape) != (n, k // self.group_size):
            raise ValueError(f"scales shape {tuple(self.scales.shape)} != ({n}, {k // self.group_size})")
        if self.zeros is not None and self.zeros.shape != self.scales.shape:
            raise ValueError(f"zeros shape {tuple(self.zeros.shape)} != scales shape {tuple(self.scales.shape)}")
        if self.perm is not None and tuple(self.perm.shape) != (k,):
            raise ValueError(f"perm shape {tuple(self.perm.shape)} != ({k},)")

    @property
    def out_features(self) -> int:
        return self.packed.shape[0]

    @property
    def symmetric(self) -> bool:
        return self.zeros is None

    @classmethod
    def from_codes(
        cls, codes: Tensor, scales: Tensor, zeros: Tensor | None, bits: int, group_size: int, perm: Tensor | None = None
    ) -> QuantizedWeight:
        """Pack integer ``codes`` ``(N, K)`` (stored column order) into a :class:`QuantizedWeight`."""
        zeros_u8 = None if zeros is None else zeros.round().to(torch.uint8)
        return cls(pack_bits(codes, bits), scales, zeros_u8, bits, group_size, codes.shape[1], perm)

    def codes(self) -> Tensor:
        """uint8 ``(N, K)`` codes in stored column order."""
        return unpack_bits(self.packed, self.bits, self.in_features)

    def zero_points(self) -> Tensor:
        """float ``(N, K // group_size)`` zero points (the constant ``2**(bits-1)`` when symmetric)."""
        if self.zeros is None:
            return torch.full(self.scales.shape, float(1 << (self.bits - 1)), device=self.scales.device)
        return self.zeros.float()

    def dequantize(self, dtype: torch.dtype = torch.float32, stored_order: bool = False) -> Tensor:
        """``(N, K)`` weight in ``dtype``; input columns in the original order unless ``stored_order``."""
        n, k, g = self.out_features, self.in_features, self.group_size
        codes = self.codes().float().reshape(n, k // g, g)  # (N, groups, G)
        w = (codes - self.zero_points()[..., None]) * self.scales.float()[..., None]
        w = w.reshape(n, k)
        if self.perm is not None and not stored_order:
            w = torch.empty_like(w).index_copy_(1, self.perm.to(w.device), w)
        return w.to(dtype)

    def to(self, device: torch.device | str) -> QuantizedWeight:
        def move(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.to(device)

        return QuantizedWeight(
            self.packed.to(device),
            self.scales.to(device),
            move(self.zeros),
            self.bits,
            self.group_size,
            self.in_features,
            move(self.perm),
        )

    def nbytes(self) -> int:
        """Bytes of the stored tensors."""
        tensors = [self.packed, self.scales, self.zeros, self.perm]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def rtn_quantize(
    weight: Tensor, spec: QuantSpec, observer: str | Observer = "minmax", scale_dtype: torch.dtype = torch.float16
) -> QuantizedWeight:
    """Round-to-nearest quantization of an ``(N, K)`` weight with the range chosen by ``observer``.

    Arguments:
        weight: ``(N, K)`` float tensor (any float dtype; the math is fp32).
        spec: bits, granularity, group size, symmetry.
        observer: ``"minmax"``, ``"mse"``, ``"percentile"`` or an :class:`Observer` built for ``spec``.
        scale_dtype: dtype the scales are stored in.
    """
    spec.check_weight(tuple(weight.shape))
    n, k = weight.shape
    w = weight.detach().float()
    qp = get_observer(observer, spec)(w)
    scale, zero = qp.grid((n, k))  # (N, groups)
    scale = round_scale(scale, scale_dtype)
    g = spec.effective_group_size(k)
    groups = k // g
    codes = quantize_codes(w.reshape(n, groups, g), scale[..., None], zero[..., None], spec.maxq).reshape(n, k)
    zeros = None if spec.symmetric else zero
    return QuantizedWeight.from_codes(
        codes.to(torch.uint8),
        scale.contiguous().to(scale_dtype),
        None if zeros is None else zeros.contiguous(),
        spec.bits,
        g,
    )


__all__ = ["QuantizedWeight", "round_scale", "rtn_quantize"]
