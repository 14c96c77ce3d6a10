"""What a quantized tensor is: :class:`QuantSpec` (bits, granularity, symmetry) and the integer grid it implies.

Convention used everywhere in :mod:`lightning_llmopt.quantization` and in the kernels:

- a value ``x`` is stored as an unsigned **code** ``q = clamp(round(x / scale) + zero, 0, 2**bits - 1)`` and read
  back as ``(q - zero) * scale``;
- **symmetric**: ``zero = 2**(bits - 1)`` for every group (not stored) and ``scale = 2 * absmax / (2**bits - 1)``,
  so the grid is ``[-2**(bits-1), 2**(bits-1) - 1] * scale`` (the convention of GPTQ and ``torch.ao``: all
  ``2**bits`` levels are used, the largest positive value loses half a step);
- **asymmetric**: ``scale = (hi - lo) / (2**bits - 1)`` and ``zero = round(-lo / scale)``, with the range widened to
  contain 0 so that 0 is exactly representable (padding, ReLU outputs);
- **granularity** of a 2-D weight ``(N, K)`` (output, input): ``"tensor"`` one (scale, zero) for all, ``"channel"``
  one per output row, ``"group"`` one per row and per ``group_size`` consecutive input columns (scales then have
  shape ``(N, K // group_size)``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

GRANULARITIES = ("tensor", "channel", "group")


@dataclass(frozen=True)
class QuantSpec:
    """How one tensor is quantized.

    Arguments:
        bits: code width, 2 to 8.
        granularity: ``"tensor"``, ``"channel"`` (one scale per output row) or ``"group"``.
        group_size: input columns per scale when ``granularity="group"`` (32, 64, 128 have Triton kernels).
        symmetric: zero point fixed at ``2**(bits-1)`` (not stored) instead of one per group.
    """

    bits: int = 4
    granularity: str = "group"
    group_size: int = 128
    symmetric: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.bits, int) or not 2 <= self.bits <= 8:
            raise ValueError(f"bits ({self.bits!r}) must be an integer in [2, 8]")
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"granularity ({self.granularity!r}) must be one of {GRANULARITIES}")
        if self.granularity == "group" and (not isinstance(self.group_size, int) or self.group_size <= 0):
            raise ValueError(f"group_size ({self.group_size!r}) must be a positive integer for granularity 'group'")

    @property
    def maxq(self) -> int:
        """Largest code, ``2**bits - 1``."""
        return (1 << self.bits) - 1

    @property
    def sym_zero(self) -> int:
        """The zero point of the symmetric grid, ``2**(bits - 1)``."""
        return 1 << (self.bits - 1)

    def groups_per_row(self, in_features: int) -> int:
        """Scales per output row of an ``(N, in_features)`` weight."""
        if self.granularity != "group":
            return 1
        return in_features // self.group_size

    def effective_group_size(self, in_features: int) -> int:
        """Input columns sharing one scale: ``group_size`` or the whole row."""
        return self.group_size if self.granularity == "group" else in_features

    def check_weight(self, shape: tuple[int, ...]) -> None:
        """Raise a clear error if a weight of ``shape`` cannot be quantized with this spec."""
        if len(shape) != 2:
            raise ValueError(f"weights must be 2-D (out_features, in_features), got shape {tuple(shape)}")
        if self.granularity == "group" and shape[1] % self.group_size != 0:
            raise ValueError(f"in_features ({shape[1]}) must be divisible by group_size ({self.group_size})")

    def weight_bytes(self, shape: tuple[int, int], scale_bytes: int = 2) -> int:
        """Stored size of an ``(N, K)`` weight: packed codes, scales and (asymmetric) zero points."""
        n, k = shape
        groups = n * self.groups_per_row(k) if self.granularity != "tensor" else 1
        codes = (n * k * self.bits + 7) // 8
        zeros = 0 if self.symmetric else groups  # one uint8 per group
        return codes + groups * scale_bytes + zeros

    def describe(self) -> str:
        gran = f"g{self.group_size}" if self.granularity == "group" else self.granularity
        return f"int{self.bits}-{gran}-{'sym' if self.symmetric else 'asym'}"


@dataclass
class QParams:
    """Scales and zero points of one tensor, shaped for :func:`fake_quantize` on its 2-D row view.

    ``scale`` and ``zero`` are float tensors of shape ``(rows, 1)`` where ``rows`` is 1 (tensor), ``N`` (channel)
    or ``N * K // group_size`` (group); :meth:`grid` reshapes them to ``(N, groups_per_row)``.
    """

    scale: Tensor
    zero: Tensor
    spec: QuantSpec

    def grid(self, shape: tuple[int, int]) -> tuple[Tensor, Tensor]:
        """``(scale, zero)`` as ``(N, groups)`` for an ``(N, K)`` weight (tensor granularity repeats the scalar)."""
        n, k = shape
        g = self.spec.groups_per_row(k)
        if self.spec.granularity == "tensor":
            return self.scale.reshape(1, 1).expand(n, 1), self.zero.reshape(1, 1).expand(n, 1)
        return self.scale.reshape(n, g), self.zero.reshape(n, g)


def qparams_from_range(lo: Tensor, hi: Tensor, spec: QuantSpec) -> tuple[Tensor, Tensor]:
    """``(scale, zero)`` (fp32, same shape as ``lo``) of the grid covering ``[lo, hi]`` (see the module docstring).

    An all-zero range gets scale 1 so that it quantizes to exact zeros without dividing by zero.
    """
    lo, hi = lo.float(), hi.float()
    if spec.symmetric:
        amax = torch.maximum(lo.abs(), hi.abs())
        scale = 2 * amax / spec.maxq
        zero = torch.full_like(scale, float(spec.sym_zero))
    else:
        lo, hi = torch.clamp(lo, max=0.0), torch.clamp(hi, min=0.0)
        scale = (hi - lo) / spec.maxq
        zero = torch.zeros_like(scale)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    if not spec.symmetric:
        zero = torch.clamp(torch.round(-lo / scale), 0, spec.maxq)
    return scale, zero


def quantize_codes(x: Tensor, scale: Tensor, zero: Tensor, maxq: int) -> Tensor:
    """Integer codes ``clamp(round(x / scale) + zero, 0, maxq)`` as a float tensor (broadcasting)."""
    return torch.clamp(torch.round(x / scale) + zero, 0, maxq)


def fake_quantize(x: Tensor, scale: Tensor, zero: Tensor, maxq: int) -> Tensor:
    """``(codes - zero) * scale``: ``x`` rounded to the grid (fp32 math, returned in ``x.dtype``)."""
    xf = x.float()
    return ((quantize_codes(xf, scale, zero, maxq) - zero) * scale).to(x.dtype)


def rows_view(x: Tensor, spec: QuantSpec) -> Tensor:
    """The 2-D view whose rows share one (scale, zero): ``(1, numel)``, ``(N, -1)`` or ``(N * K / G, G)``."""
    if spec.granularity == "tensor":
        return x.reshape(1, -1)
    if spec.granularity == "channel":
        return x.reshape(x.shape[0], -1)
    if x.shape[-1] % spec.group_size != 0:
        raise ValueError(f"last dimension ({x.shape[-1]}) must be divisible by group_size ({spec.group_size})")
    return x.reshape(-1, spec.group_size)


__all__ = [
    "GRANULARITIES",
    "QParams",
    "QuantSpec",
    "fake_quantize",
    "qparams_from_range",
    "quantize_codes",
    "rows_view",
]
