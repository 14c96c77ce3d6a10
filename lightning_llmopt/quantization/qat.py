"""Quantization-aware training: fake quantization with the straight-through estimator, and conversion to real
quantized layers.

- :func:`fake_quantize_ste`: forward ``Q(w) = (clamp(round(w / s) + z, 0, 2**b - 1) - z) * s``; backward passes
  the gradient through unchanged where ``w`` lies inside the clipping range and zeroes it outside (the
  straight-through estimator, Bengio et al. 2013; the scale and zero point are treated as constants).
- :class:`FakeQuantLinear`: an ``nn.Linear`` whose forward uses ``Q(weight)``. It **shares** the original layer's
  ``weight`` and ``bias`` Parameters, so state-dict keys and optimizer state stay valid: QAT can be switched on
  in the middle of a run (:func:`prepare_qat`).
- :func:`convert_qat`: each ``FakeQuantLinear`` becomes a
  :class:`~lightning_llmopt.layers.quantized_linear.QuantizedLinear` with the same grid, so the converted model
  computes what training saw (up to matmul rounding).

Scales come from the observer on the current weights at every step (min/max by default: nothing is clipped and
the STE is the identity; a clipping observer makes the mask matter).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_llmopt.layers.quantized_linear import QuantizedLinear
from lightning_llmopt.quantization.apply import set_module
from lightning_llmopt.quantization.config import QuantConfig
from lightning_llmopt.quantization.observers import get_observer
from lightning_llmopt.quantization.spec import QuantSpec


class _FakeQuantSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w: Tensor, scale: Tensor, zero: Tensor, maxq: int) -> Tensor:  # type: ignore[override]
        n, k = w.shape
        groups = scale.shape[1]
        wf = w.float().reshape(n, groups, k // groups)
        s, z = scale[..., None], zero[..., None]
        raw = torch.round(wf / s) + z
        inside = (raw >= 0) & (raw <= maxq)
        out = (torch.clamp(raw, 0, maxq) - z) * s
        ctx.save_for_backward(inside.reshape(n, k))
        return out.reshape(n, k).to(w.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        (inside,) = ctx.saved_tensors
        return grad * inside.to(grad.dtype), None, None, None


def fake_quantize_ste(weight: Tensor, spec: QuantSpec, observer: str = "minmax") -> Tensor:
    """``Q(weight)`` for an ``(N, K)`` weight with the straight-through gradient (module docstring)."""
    n, k = weight.shape
    with torch.no_grad():
        scale, zero = get_observer(observer, spec)(weight.detach()).grid((n, k))
    return _FakeQuantSTE.apply(weight, scale.contiguous(), zero.contiguous(), spec.maxq)


class FakeQuantLinear(nn.Linear):
    """``F.linear(x, Q(weight), bias)`` sharing ``linear``'s Parameters (see the module docstring).

    Arguments:
        linear: the layer to wrap (its ``weight``/``bias`` Parameters are reused, not copied).
        spec: the grid trained for.
        observer: range selection at each step.
    """

    def __init__(self, linear: nn.Linear, spec: QuantSpec, observer: str = "minmax") -> None:
        nn.Module.__init__(self)
        spec.check_weight(tuple(linear.weight.shape))
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.spec, self.observer = spec, observer

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, fake_quantize_ste(self.weight, self.spec, self.observer), self.bias)

    def to_linear(self) -> nn.Linear:
        """A plain ``nn.Linear`` sharing the Parameters (QAT switched off)."""
        with torch.device("meta"):
            linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None)
        linear.weight = self.weight
        linear.bias = self.bias
        return linear

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fake_quant={self.spec.describe()}, observer={self.observer}"


def prepare_qat(model: nn.Module, config: QuantConfig | None = None) -> list[str]:
    """Wrap every linear layer ``config`` selects in a :class:`FakeQuantLinear` (in place); returns their names.

    ``config.method`` is ignored (QAT is its own method); ``bits``/``group_size``/``symmetric``/``observer``,
    ``skip`` and ``overrides`` apply as for :func:`~lightning_llmopt.quantization.quantize_model`.
    """
    config = config or QuantConfig()
    names = []
    for name, module in list(model.named_modules()):
        if type(module) is not nn.Linear:
            continue
        spec = config.spec_for(name, module.in_features)
        if spec is None:
            continue
        set_module(model, name, FakeQuantLinear(module, spec, config.observer_for(name)))
        names.append(name)
    return names


def remove_qat(model: nn.Module) -> list[str]:
    """Undo :func:`prepare_qat`: back to plain ``nn.Linear`` layers with the same Parameters."""
    names = [n for n, m in model.named_modules() if isinstance(m, FakeQuantLinear)]
    for name in names:
        module = model.get_submodule(name)
        assert isinstance(module, FakeQuantLinear)
        set_module(model, name, module.to_linear())
    return names


@torch.no_grad()
def convert_qat(model: nn.Module, dtype: torch.dtype | None = None) -> list[str]:
    """Replace every :class:`FakeQuantLinear` with a :class:`QuantizedLinear` on the same grid; returns the names.

    ``dtype``: dtype of scales and biases (default: the weight's).
    """
    names = [n for n, m in model.named_modules() if isinstance(m, FakeQuantLinear)]
    for name in names:
        module = model.get_submodule(name)
        assert isinstance(module, FakeQuantLinear)
        q = QuantizedLinear.from_linear(module, module.spec, module.observer, dtype=dtype or module.weight.dtype)
        set_module(model, name, q)
    return names


__all__ = ["FakeQuantLinear", "convert_qat", "fake_quantize_ste", "prepare_qat", "remove_qat"]
