"""One-shot pruning of a whole model: magnitude or SparseGPT, unstructured or N:M, layers stay ``nn.Linear``.

SparseGPT calibrates the way GPTQ does in :mod:`lightning_llmopt.quantization.apply` (same helpers): layers are
grouped by transformer block; for each block in order, forward pre-hooks accumulate the input Hessians of its
linear layers while the calibration batches run through the model, whose earlier blocks are already pruned
(sequential), and a hook on the block stops the pass there. Cost: one partial forward pass per block over the
calibration set, plus one ``K x K`` Cholesky per layer.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from lightning_llmopt.compression.masks import (
    DEFAULT_SKIP,
    apply_masks,
    magnitude_masks,
    parse_pattern,
    prunable_linears,
)
from lightning_llmopt.compression.sparsegpt import sparsegpt_prune
from lightning_llmopt.quantization.apply import calibrate_inputs, default_forward, sequential_groups

METHODS = ("magnitude", "sparsegpt")


@dataclass
class PruneReport:
    """What :func:`prune_model` did: ``masks`` (keep-masks per layer name), ``loss`` (SparseGPT objective per
    layer), ``sparsity`` (fraction of zeros over the pruned layers) and ``seconds``."""

    masks: dict[str, Tensor] = field(default_factory=dict)
    loss: dict[str, float] = field(default_factory=dict)
    sparsity: float = 0.0
    seconds: float = 0.0


def _sparsegpt(
    model: nn.Module,
    layers: dict[str, nn.Linear],
    sparsity: float,
    nm: tuple[int, int],
    batches: list[Any],
    forward: Callable,
    block_size: int,
    damp: float,
    report: PruneReport,
) -> None:
    for block, names in sequential_groups(model, layers, sequential=True):
        stop_at = model.get_submodule(block) if block is not None else None
        group = {n: layers[n] for n in names}
        hessians = calibrate_inputs(model, group, batches, forward, stop_at)
        for name, linear in group.items():
            if hessians[name].n == 0:
                raise RuntimeError(f"SparseGPT: layer {name!r} saw no calibration input (is it used in forward?)")
            res = sparsegpt_prune(linear.weight, hessians[name].H, sparsity, *nm, block_size=block_size, damp=damp)
            del hessians[name]
            with torch.no_grad():
                linear.weight.copy_(res.weight.to(linear.weight.dtype))
            report.masks[name] = res.mask
            report.loss[name] = res.loss


def prune_model(
    model: nn.Module,
    sparsity: float = 0.5,
    method: str = "magnitude",
    pattern: str = "unstructured",
    scope: str = "layer",
    calibration: Iterable[Any] | None = None,
    forward: Callable[[nn.Module, Any], Any] | None = None,
    skip: Iterable[str] = DEFAULT_SKIP,
    block_size: int = 128,
    damp: float = 0.01,
) -> PruneReport:
    """Prune ``model``'s linear layers in place (weights zeroed; the layers stay ``nn.Linear``).

    Arguments:
        model: any ``nn.Module`` (ours or a transformers model).
        sparsity: fraction dropped per layer (``scope="global"``: over all layers); ignored for ``"N:M"``.
        method: ``"magnitude"`` or ``"sparsegpt"`` (needs ``calibration``).
        pattern: ``"unstructured"`` or ``"N:M"`` such as ``"2:4"``.
        scope: magnitude only: ``"layer"`` or ``"global"``.
        calibration: SparseGPT batches (token ids ``(B, T)`` or dicts with ``"input_ids"``), iterated per block.
        forward: ``forward(model, batch)``; default :func:`~lightning_llmopt.quantization.apply.default_forward`.
        skip: ``fnmatch`` patterns of layer names left dense (the output head by default).
        block_size, damp: SparseGPT's lazy block size and dampening.
    """
    if method not in METHODS:
        raise ValueError(f"method ({method!r}) must be one of {METHODS}")
    start = time.perf_counter()
    report = PruneReport()
    nm = (0, 0) if pattern == "unstructured" else parse_pattern(pattern)
    if method == "magnitude":
        report.masks = magnitude_masks(model, sparsity, scope, pattern, skip)
        apply_masks(model, report.masks)
    else:
        if calibration is None:
            raise ValueError("method 'sparsegpt' needs calibration batches")
        if scope != "layer":
            raise ValueError("SparseGPT prunes each layer to the target sparsity (scope 'layer')")
        layers = prunable_linears(model, skip)
        was_training = model.training
        model.eval()
        try:
            _sparsegpt(
                model, layers, sparsity, nm, list(calibration), forward or default_forward, block_size, damp, report
            )
        finally:
            model.train(was_training)
    dropped = sum(int((~m).sum()) for m in report.masks.values())
    report.sparsity = dropped / max(1, sum(m.numel() for m in report.masks.values()))
    report.seconds = time.perf_counter() - start
    return report


__all__ = ["METHODS", "PruneReport", "prune_model"]
