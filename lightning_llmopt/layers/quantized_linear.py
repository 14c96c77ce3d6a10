"""``QuantizedLinear``: a drop-in ``nn.Linear`` replacement holding weight-only quantized codes.

Used for evaluation of quantized models during and after training, by the exporters
(:mod:`lightning_llmopt.quantization.export_gptq`, :mod:`lightning_llmopt.quantization.export_ct`) and by the
inference engine: ``forward(x)`` takes ``(..., in_features)`` and returns ``(..., out_features)`` like
``nn.Linear``, through the Triton kernel on CUDA (4- and 8-bit codes) and the PyTorch reference elsewhere.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lightning_llmopt.kernels.quant_matmul import quant_matmul
from lightning_llmopt.quantization.observers import Observer
from lightning_llmopt.quantization.packing import packed_words
from lightning_llmopt.quantization.spec import QuantSpec
from lightning_llmopt.quantization.weight import QuantizedWeight, rtn_quantize


class QuantizedLinear(nn.Module):
    """``y = x @ dequant(W)^T + b`` with ``W`` stored as packed integer codes (buffers, not parameters).

    Arguments:
        in_features, out_features: as ``nn.Linear``.
        bias: whether there is a bias (kept in ``dtype``, not quantized).
        bits: code width (2..8; the kernel covers 4 and 8).
        group_size: input columns per scale (``in_features`` for per-channel).
        symmetric: no stored zero points (zero ``2**(bits-1)``).
        act_order: keep a ``perm`` buffer: stored column ``j`` is input column ``perm[j]`` (GPTQ ``act_order``).
        dtype: dtype of the bias and of the scales.
        backend: ``"auto"``, ``"triton"`` or ``"reference"`` (see :func:`lightning_llmopt.kernels.quant_matmul`).

    Buffers: ``qweight`` int32 ``(N, ceil(K * bits / 32))``, ``scales`` ``(N, K / G)``, ``zeros`` uint8
    ``(N, K / G)`` (asymmetric only), ``perm`` int64 ``(K,)`` (act order only). Build one from a float layer with
    :meth:`from_linear` or from a :class:`~lightning_llmopt.quantization.weight.QuantizedWeight` with
    :meth:`from_quantized`.
    """

    qweight: Tensor
    scales: Tensor
    zeros: Tensor | None
    perm: Tensor | None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        bits: int = 4,
        group_size: int | None = 128,
        symmetric: bool = True,
        act_order: bool = False,
        dtype: torch.dtype = torch.float16,
        device: torch.device | str | None = None,
        backend: str | None = None,
    ) -> None:
        super().__init__()
        group = in_features if group_size is None or group_size <= 0 else group_size
        if in_features % group != 0:
            raise ValueError(f"in_features ({in_features}) must be divisible by group_size ({group})")
        if not 2 <= bits <= 8:
            raise ValueError(f"bits ({bits}) must be in [2, 8]")
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.group_size, self.backend = bits, group, backend
        groups = in_features // group
        self.register_buffer(
            "qweight", torch.zeros(out_features, packed_words(in_features, bits), dtype=torch.int32, device=device)
        )
        self.register_buffer("scales", torch.ones(out_features, groups, dtype=dtype, device=device))
        self.register_buffer(
            "zeros", None if symmetric else torch.zeros(out_features, groups, dtype=torch.uint8, device=device)
        )
        self.register_buffer("perm", torch.arange(in_features, device=device) if act_order else None)
        self.bias = (
            nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False) if bias else None
        )

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_quantized(
        cls,
        qw: QuantizedWeight,
        bias: Tensor | None = None,
        dtype: torch.dtype | None = None,
        backend: str | None = None,
    ) -> QuantizedLinear:
        """Wrap a :class:`QuantizedWeight` (tensors are used as they are: no copy unless ``dtype`` casts)."""
        scale_dtype = dtype or qw.scales.dtype
        layer = cls(
            qw.in_features,
            qw.out_features,
            bias=bias is not None,
            bits=qw.bits,
            group_size=qw.group_size,
            symmetric=qw.zeros is None,
            act_order=qw.perm is not None,
            dtype=scale_dtype,
            device="meta",
            backend=backend,
        )
        layer.qweight = qw.packed
        layer.scales = qw.scales.to(scale_dtype)
        layer.zeros = qw.zeros
        layer.perm = qw.perm
        if bias is not None:
            layer.bias = nn.Parameter(bias.detach().to(device=qw.packed.device, dtype=scale_dtype), requires_grad=False)
        return layer

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        spec: QuantSpec,
        observer: str | Observer = "minmax",
        dtype: torch.dtype | None = None,
        backend: str | None = None,
    ) -> QuantizedLinear:
        """Round-to-nearest quantization of ``linear`` (see :func:`~lightning_llmopt.quantization.rtn_quantize`).

        ``dtype`` (default: the layer's weight dtype) is the dtype of scales and bias.
        """
        dtype = dtype or linear.weight.dtype
        qw = rtn_quantize(linear.weight, spec, observer, scale_dtype=dtype)
        return cls.from_quantized(qw, linear.bias, dtype, backend)

    def quantized_weight(self) -> QuantizedWeight:
        """The stored tensors as a :class:`QuantizedWeight` (shared, not copied)."""
        return QuantizedWeight(
            self.qweight, self.scales, self.zeros, self.bits, self.group_size, self.in_features, self.perm
        )

    def dequantize(self, dtype: torch.dtype | None = None) -> Tensor:
        """``(out_features, in_features)`` float weight in the original column order."""
        return self.quantized_weight().dequantize(dtype or self.scales.dtype)

    # ------------------------------------------------------------------ forward
    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)  # (M, K)
        if self.perm is not None:
            x2 = x2.index_select(1, self.perm)
        y = quant_matmul(x2, self.qweight, self.scales, self.zeros, bits=self.bits, backend=self.backend)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*shape[:-1], self.out_features)

    @property
    def symmetric(self) -> bool:
        return self.zeros is None

    @property
    def spec(self) -> QuantSpec:
        """The :class:`QuantSpec` of the stored codes (``granularity`` is ``"channel"`` for one group per row)."""
        if self.group_size == self.in_features:
            return QuantSpec(self.bits, "channel", self.group_size, self.symmetric)
        return QuantSpec(self.bits, "group", self.group_size, self.symmetric)

    def extra_repr(self) -> str:
        group = "channel" if self.group_size == self.in_features else f"g{self.group_size}"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"int{self.bits}-{group}-{'sym' if self.symmetric else 'asym'}"
            f"{', act_order' if self.perm is not None else ''}"
        )


__all__ = ["QuantizedLinear"]
