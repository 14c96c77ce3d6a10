"""Calibration shared by the GPTQ drivers of :func:`~lightning_llmopt.quantization.apply.quantize_model` (the prefix
driver in ``apply.py``, the block driver in ``gptq_blocks.py``) and by SparseGPT pruning: Hessian capture, block
grouping, per-layer GPTQ replacement, and the report they fill.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from lightning_llmopt.layers.quantized_linear import QuantizedLinear
from lightning_llmopt.quantization.config import QuantConfig
from lightning_llmopt.quantization.gptq import HessianAccumulator, gptq_quantize

_BLOCK = re.compile(r"^(.*?\blayers\.\d+)\.")


class _StopForward(Exception):
    """Raised by a hook once the layers being calibrated have seen their inputs."""


@dataclass
class QuantizationReport:
    """What :func:`~lightning_llmopt.quantization.apply.quantize_model` did: ``layers`` maps each quantized module
    name to its spec (``int4-g128-sym``), ``gptq_loss`` holds GPTQ's per-layer objective, ``seconds`` the wall
    time."""

    layers: dict[str, str] = field(default_factory=dict)
    gptq_loss: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0


def _to(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return {k: _to(v, device) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_to(v, device) for v in batch)
    return batch


def set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    """Replace the submodule ``name`` (dotted path) of ``model``."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def _model_device(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    if p is None:
        b = next(model.buffers(), None)
        return b.device if b is not None else torch.device("cpu")
    return p.device


@torch.no_grad()
def calibrate_inputs(
    model: nn.Module, layers: dict[str, nn.Linear], batches: list[Any], forward: Callable, stop_at: nn.Module | None
) -> dict[str, HessianAccumulator]:
    """Run the batches, accumulating each layer's input Hessian; stop after ``stop_at`` ran (if given)."""
    acc = {name: HessianAccumulator(m.in_features, m.weight.device) for name, m in layers.items()}
    handles = [m.register_forward_pre_hook(lambda mod, args, n=name: acc[n].add(args[0])) for name, m in layers.items()]
    if stop_at is not None:

        def stop(*_: Any) -> None:
            raise _StopForward

        handles.append(stop_at.register_forward_hook(stop))
    try:
        run_batches(model, batches, forward)
    finally:
        for h in handles:
            h.remove()
    return acc


@torch.no_grad()
def run_batches(model: nn.Module, batches: Iterable[Any], forward: Callable[[nn.Module, Any], Any]) -> None:
    """``forward(model, batch)`` for each batch moved to the model's device; a hook raising ``_StopForward`` ends
    that batch's forward early (calibration needs the model only up to the block it hooks)."""
    device = _model_device(model)
    for batch in batches:
        try:
            forward(model, _to(batch, device))
        except _StopForward:
            pass


def sequential_groups(
    model: nn.Module, layers: dict[str, nn.Linear], sequential: bool
) -> list[tuple[str | None, list]]:
    """``(block name, layer names)`` in execution order: one group per block when ``sequential`` (each block is
    calibrated on the outputs of the already-quantized blocks before it), else one group of every layer."""
    if not sequential:
        return [(None, list(layers))]
    groups: dict[str | None, list[str]] = {}
    for name in layers:  # named_modules order: blocks in execution order
        match = _BLOCK.match(name)
        groups.setdefault(match.group(1) if match else None, []).append(name)
    tail = groups.pop(None, [])
    return [*groups.items(), *([(None, tail)] if tail else [])]


def quantize_group(
    model: nn.Module,
    group: dict[str, nn.Linear],
    hessians: dict[str, HessianAccumulator],
    config: QuantConfig,
    report: QuantizationReport,
    progress: Callable[[str], None],
) -> None:
    """GPTQ on each layer of ``group`` from its accumulated Hessian; the layer becomes a ``QuantizedLinear``."""
    for name, linear in group.items():
        spec = config.spec_for(name, linear.in_features)
        assert spec is not None
        spec.check_weight(tuple(linear.weight.shape))
        if hessians[name].n == 0:
            raise RuntimeError(f"GPTQ: layer {name!r} saw no calibration input (is it used in forward?)")
        dtype = config.scale_dtype or linear.weight.dtype
        result = gptq_quantize(
            linear.weight,
            hessians[name].H,
            spec,
            config.observer_for(name),
            config.block_size,
            config.damp,
            config.act_order,
            scale_dtype=dtype,
        )
        del hessians[name]
        set_module(model, name, QuantizedLinear.from_quantized(result.weight, linear.bias, dtype))
        report.layers[name] = spec.describe()
        report.gptq_loss[name] = result.loss
        progress(name)


__all__ = [
    "QuantizationReport",
    "calibrate_inputs",
    "quantize_group",
    "run_batches",
    "sequential_groups",
    "set_module",
]
