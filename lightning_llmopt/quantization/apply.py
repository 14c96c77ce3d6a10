"""Quantize the linear layers of a model in place: round to nearest or GPTQ, replacing each ``nn.Linear`` with a
:class:`~lightning_llmopt.layers.quantized_linear.QuantizedLinear`.

Works on any module tree (our :class:`~lightning_llmopt.models.Llama` or a transformers model): layers are found by
type and named as in ``model.named_modules()``. GPTQ needs calibration batches and a ``forward(model, batch)``
(default: ``model(batch)`` for a tensor of token ids, ``model(batch["input_ids"])`` for a dict).

Sequential GPTQ groups the layers by transformer block (the module path up to ``layers.<i>``) and calibrates each
block on the outputs of the already-quantized blocks before it. The block driver
(:mod:`~lightning_llmopt.quantization.gptq_blocks`) captures the first block's inputs once and then runs block by
block: two forwards of each block over the calibration set (Hessians, then its quantized outputs for the next
block), 2L block forwards in all. Where the blocks are not one chain (no ``layers`` container), the prefix driver
runs instead: hooks collect a block's Hessians while the batches run through the whole model, stopped after the
block, L(L+1)/2 block forwards. Layers outside any block form a last group (one full forward).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from lightning_llmopt.layers.quantized_linear import QuantizedLinear
from lightning_llmopt.quantization import gptq_blocks
from lightning_llmopt.quantization.calibration import (
    QuantizationReport,
    calibrate_inputs,
    quantize_group,
    run_batches,
    sequential_groups,
    set_module,
)
from lightning_llmopt.quantization.config import QuantConfig


def default_forward(model: nn.Module, batch: Any) -> Any:
    """``model(ids)`` where ``ids`` is the batch, its ``"input_ids"`` entry, or its first element."""
    if isinstance(batch, Mapping):
        return model(batch["input_ids"])
    if isinstance(batch, (tuple, list)):
        return model(batch[0])
    return model(batch)


def quantizable_linears(model: nn.Module, config: QuantConfig) -> dict[str, nn.Linear]:
    """``{name: layer}`` of the ``nn.Linear`` modules ``config`` quantizes (not yet quantized ones only)."""
    return {
        name: m for name, m in model.named_modules() if isinstance(m, nn.Linear) and config.spec_for(name) is not None
    }


def _replace_rtn(
    model: nn.Module, name: str, linear: nn.Linear, config: QuantConfig, report: QuantizationReport
) -> None:
    spec = config.spec_for(name, linear.in_features)
    assert spec is not None
    spec.check_weight(tuple(linear.weight.shape))
    q = QuantizedLinear.from_linear(linear, spec, config.observer_for(name), dtype=config.scale_dtype)
    set_module(model, name, q)
    report.layers[name] = spec.describe()


def _quantize_gptq(
    model: nn.Module,
    layers: dict[str, nn.Linear],
    config: QuantConfig,
    batches: list[Any],
    forward: Callable,
    report: QuantizationReport,
    progress: Callable[[str], None],
) -> None:
    """The prefix driver: each group's Hessians from full forward passes stopped after the group's block."""
    for block, names in sequential_groups(model, layers, config.sequential):
        stop_at = model.get_submodule(block) if block is not None else None
        group = {n: layers[n] for n in names}
        hessians = calibrate_inputs(model, group, batches, forward, stop_at)
        quantize_group(model, group, hessians, config, report, progress)


def quantize_model(
    model: nn.Module,
    config: QuantConfig | None = None,
    calibration: Iterable[Any] | None = None,
    forward: Callable[[nn.Module, Any], Any] | None = None,
    progress: Callable[[str], None] | None = None,
    device: torch.device | str | None = None,
) -> QuantizationReport:
    """Quantize ``model``'s linear layers in place (see the module docstring).

    Arguments:
        model: any ``nn.Module``; its ``nn.Linear`` layers selected by ``config`` become ``QuantizedLinear``.
        config: a :class:`QuantConfig` (default: int4, group 128, symmetric, round to nearest, head skipped).
        calibration: batches for GPTQ (token ids ``(B, T)``, or dicts with ``"input_ids"``); iterated once per
            transformer block.
        forward: ``forward(model, batch)``; default :func:`default_forward`.
        progress: called with each layer's name once it is quantized (e.g. to advance a progress bar).
        device: GPTQ only: where each transformer block is moved, one at a time, to be calibrated and quantized
            (default: where it is); the other blocks stay where they are (e.g. on the CPU).

    Returns a :class:`QuantizationReport`.
    """
    config = config or QuantConfig()
    start = time.perf_counter()
    report = QuantizationReport()
    layers = quantizable_linears(model, config)
    was_training = model.training
    model.eval()
    done = progress or (lambda name: None)
    try:
        if config.method == "rtn":
            for name, linear in layers.items():
                _replace_rtn(model, name, linear, config, report)
                done(name)
        else:
            if calibration is None:
                raise ValueError("method 'gptq' needs calibration batches")
            batches, fwd = list(calibration), forward or default_forward
            if not (
                config.sequential
                and gptq_blocks.quantize_blockwise(model, layers, config, batches, fwd, report, done, device)
            ):
                _quantize_gptq(model, layers, config, batches, fwd, report, done)
    finally:
        model.train(was_training)
    report.seconds = time.perf_counter() - start
    return report


__all__ = [
    "QuantizationReport",
    "calibrate_inputs",
    "default_forward",
    "quantizable_linears",
    "quantize_model",
    "run_batches",
    "sequential_groups",
    "set_module",
]
