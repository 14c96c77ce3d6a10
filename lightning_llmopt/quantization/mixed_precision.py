"""Mixed precision: per-layer sensitivity on calibration data and a bit allocation under a size budget.

1. :func:`layer_sensitivity`: for every linear layer and every candidate :class:`QuantSpec`, quantize that layer
   alone (round to nearest, in place on a copy of its weight), measure the calibration loss and record the increase
   over the unquantized model. This is the "change in loss" criterion; it ignores interactions between layers, which
   a final evaluation of the chosen plan measures.
2. :func:`allocate_bits`: a multiple-choice knapsack solved greedily. Every layer starts at the largest option
   (``None`` = keep 16-bit); while the model is over budget, the layer whose next smaller option costs the least
   loss per byte saved steps down. Returns an :class:`Allocation` whose ``plan`` feeds
   :meth:`QuantConfig.with_overrides <lightning_llmopt.quantization.config.QuantConfig.with_overrides>`.

Norms and embeddings are never linear layers here, so they stay in their dtype; the output head is only
considered if it is passed in ``names``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_llmopt.quantization.evaluate import causal_lm_loss
from lightning_llmopt.quantization.spec import QuantSpec
from lightning_llmopt.quantization.weight import rtn_quantize

Option = QuantSpec | None  # None: keep the layer in 16-bit


def option_key(option: Option) -> str:
    return "bf16" if option is None else option.describe()


def option_bytes(option: Option, shape: tuple[int, int]) -> int:
    """Stored bytes of an ``(N, K)`` weight under ``option`` (16-bit when ``None``; fp16 scales)."""
    return shape[0] * shape[1] * 2 if option is None else option.weight_bytes(shape)


@torch.no_grad()
def layer_sensitivity(
    model: nn.Module,
    batches: Sequence[Any],
    options: Sequence[QuantSpec],
    names: Iterable[str] | None = None,
    observer: str = "minmax",
    forward: Callable[[nn.Module, Any], Any] | None = None,
) -> dict[str, dict[str, float]]:
    """``{layer: {option key: loss increase}}`` (nats/token on ``batches``; see the module docstring).

    Arguments:
        model: the float model (restored exactly afterwards).
        batches: calibration batches for :func:`~lightning_llmopt.quantization.evaluate.causal_lm_loss`.
        options: candidate specs (e.g. int8 per-channel, int4 g128, int3 g128).
        names: linear layers to measure (default: every ``nn.Linear`` except ``output``/``lm_head``).
    """
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    if names is None:
        names = [n for n in linears if n.rsplit(".", 1)[-1] not in ("output", "lm_head")]
    base = causal_lm_loss(model, batches, forward)
    out: dict[str, dict[str, float]] = {}
    for name in names:
        layer = linears[name]
        original = layer.weight.data
        out[name] = {"bf16": 0.0}
        for spec in options:
            q = rtn_quantize(original, spec, observer, scale_dtype=torch.float32)
            layer.weight.data = q.dequantize(original.dtype)
            try:
                out[name][spec.describe()] = causal_lm_loss(model, batches, forward) - base
            finally:
                layer.weight.data = original
    return out


@dataclass
class Allocation:
    """A bit allocation: ``plan`` maps each layer to its option (``None`` = 16-bit); ``size_bytes`` is the stored
    size of those layers, ``predicted_increase`` the sum of their measured sensitivities."""

    plan: dict[str, Option]
    size_bytes: int
    budget_bytes: int
    predicted_increase: float

    def bits_per_weight(self, shapes: dict[str, tuple[int, int]]) -> float:
        return 8 * self.size_bytes / sum(n * k for n, k in shapes.values())

    def summary(self) -> dict[str, str]:
        return {name: option_key(opt) for name, opt in self.plan.items()}


def allocate_bits(
    sensitivity: dict[str, dict[str, float]],
    shapes: dict[str, tuple[int, int]],
    options: Sequence[Option],
    budget_bytes: int,
) -> Allocation:
    """Greedy allocation (module docstring) of ``options`` (largest first; ``None`` = 16-bit) to the layers of
    ``sensitivity`` so that their stored size is at most ``budget_bytes``.

    Raises ``ValueError`` when even the smallest option everywhere exceeds the budget.
    """
    opts = sorted(options, key=lambda o: -option_bytes(o, (128, 128)))
    names = list(sensitivity)
    missing = [n for n in names if n not in shapes]
    if missing:
        raise ValueError(f"no shape for layer(s) {missing}")
    cost = {n: [sensitivity[n].get(option_key(o), 0.0 if o is None else float("inf")) for o in opts] for n in names}
    size = {n: [option_bytes(o, shapes[n]) for o in opts] for n in names}
    level = dict.fromkeys(names, 0)
    total = sum(size[n][0] for n in names)
    smallest = sum(size[n][-1] for n in names)
    if smallest > budget_bytes:
        raise ValueError(
            f"budget ({budget_bytes} bytes) is below the smallest allocation ({smallest} bytes, "
            f"every layer at {option_key(opts[-1])})"
        )
    while total > budget_bytes:
        best, best_ratio = None, float("inf")
        for n in names:
            i = level[n]
            if i + 1 >= len(opts):
                continue
            saved = size[n][i] - size[n][i + 1]
            if saved <= 0:
                continue
            ratio = (cost[n][i + 1] - cost[n][i]) / saved
            if ratio < best_ratio:
                best, best_ratio = n, ratio
        if best is None:  # only options that save nothing remain
            break
        total -= size[best][level[best]] - size[best][level[best] + 1]
        level[best] += 1
    plan = {n: opts[level[n]] for n in names}
    predicted = sum(cost[n][level[n]] for n in names)
    return Allocation(plan, total, budget_bytes, predicted)


__all__ = ["Allocation", "allocate_bits", "layer_sensitivity", "option_bytes", "option_key"]
