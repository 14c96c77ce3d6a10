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

import re
import time
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
    """What :func:`quantize_model` did: ``layers`` maps each quantized module name to its spec (``int4-g128-sym``),
    ``gptq_loss`` holds GPTQ's per-layer objective, ``seconds`` the wall time."""

    layers: dict[str, str] = field(default_factory=dict)
    gptq_loss: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0


def default_forward(model: nn.Module, batch: Any) -> Any:
    """``model(ids)`` where ``ids`` is the batch, its ``"input_ids"`` entry, or its first element."""
    if isinstance(batch, Mapping):
        return model(batch["input_ids"])
    if isinstance(batch, (tuple, list)):
        return model(batch[0])
    return model(batch)


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


def quantizable_linears(model: nn.Module, config: QuantConfig) -> dict[str, nn.Linear]:
    """``{name: layer}`` of the ``nn.Linear`` modules ``config`` quantizes (not yet quantized ones only)."""
    return {
        name: m for name, m in model.named_modules() if isinstance(m, nn.Linear) and config.spec_for(name) is not None
    }


def _model_device(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    if p is None:
        b = next(model.buffers(), None)
        return b.device if b is not None else torch.device("cpu")
    return p.device


def _replace_rtn(
    model: nn.Module, name: str, linear: nn.Linear, config: QuantConfig, report: QuantizationReport
) -> None:
    spec = config.spec_for(name, linear.in_features)
    assert spec is not None
    spec.check_weight(tuple(linear.weight.shape))
    q = QuantizedLinear.from_linear(linear, spec, config.observer_for(name), dtype=config.scale_dtype)
    set_module(model, name, q)
    report.layers[name] = spec.describe()


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
            from lightning_llmopt.quantization.gptq_blocks import quantize_blockwise

            if not (
                config.sequential and quantize_blockwise(model, layers, config, batches, fwd, report, done, device)
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
