"""GPTQ block by block: each transformer block's inputs are captured once, its outputs feed the next block.

Sequential GPTQ (Frantar et al., arXiv 2210.17323, section 4: "we quantize the model block by block, feeding the
quantized outputs of one block as inputs to the next") over a decoder whose blocks form one chain
(``model.layers``: ``h = block(h, ...)`` in order, every other argument shared by all blocks, as in our
:class:`~lightning_llmopt.models.Llama` and transformers' decoders):

1. run the calibration batches through the model up to the first block once, keeping the block's arguments per
   batch (hidden states ``(B, T, dim)``, RoPE, positions, masks) and stopping there;
2. for each block in order: move it to ``device``; if it holds layers to quantize, run it on every batch's
   arguments with hooks accumulating those layers' Hessians, and quantize them (GPTQ per layer);
3. run the (now quantized) block on every batch: its outputs replace the hidden states of the arguments for the
   next block; move the block back.

That is two forwards per quantized block (one per block without quantized layers), 2L block forwards in all,
against L(L+1)/2 for re-running the model prefix of every block, and only one block needs to be on ``device``.
Layers outside the blocks (e.g. a quantized head) are calibrated afterwards with one full forward pass.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from lightning_llmopt.quantization.calibration import (
    QuantizationReport,
    _model_device,
    _StopForward,
    _to,
    calibrate_inputs,
    quantize_group,
    run_batches,
    sequential_groups,
)
from lightning_llmopt.quantization.config import QuantConfig
from lightning_llmopt.quantization.gptq import HessianAccumulator

__all__ = ["capture_block_inputs", "quantize_blockwise"]

Call = tuple[tuple[Any, ...], dict[str, Any]]


def _hidden(call: Call) -> Tensor:
    args, kwargs = call
    return args[0] if args else kwargs["hidden_states"]


def _with_hidden(call: Call, hidden: Tensor) -> Call:
    args, kwargs = call
    if args:
        return (hidden, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": hidden}


def _output(out: Any) -> Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


@torch.no_grad()
def capture_block_inputs(
    model: nn.Module, first: nn.Module, batches: list[Any], forward: Callable, device: torch.device
) -> list[Call]:
    """The ``(args, kwargs)`` of ``first``'s call for each batch (moved to ``device``); the forward stops there."""
    calls: list[Call] = []

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        calls.append((_to(tuple(args), device), _to(dict(kwargs), device)))
        raise _StopForward

    handle = first.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        run_batches(model, batches, forward)
    finally:
        handle.remove()
    if len(calls) != len(batches):
        raise RuntimeError(f"the first block ran for {len(calls)} of {len(batches)} calibration batches")
    return calls


def _chain(model: nn.Module, blocks: list[str]) -> tuple[list[str], nn.Module] | None:
    """Every block of the container holding ``blocks`` (``layers.0``, ``layers.1``, ...) in order, or ``None``."""
    parent = {b.rpartition(".")[0] for b in blocks}
    if len(parent) != 1:
        return None
    prefix = parent.pop()
    container = model.get_submodule(prefix) if prefix else model
    if not isinstance(container, (nn.ModuleDict, nn.ModuleList)):
        return None
    names = [f"{prefix}.{n}" if prefix else n for n, _ in container.named_children()]
    return (names, container) if set(blocks) <= set(names) else None


@torch.no_grad()
def _run_block(block: nn.Module, calls: list[Call]) -> None:
    for args, kwargs in calls:
        block(*args, **kwargs)


def quantize_blockwise(
    model: nn.Module,
    layers: dict[str, nn.Linear],
    config: QuantConfig,
    batches: list[Any],
    forward: Callable,
    report: QuantizationReport,
    progress: Callable[[str], None],
    device: torch.device | str | None = None,
) -> bool:
    """Sequential GPTQ block by block (module docstring). Returns ``False``, doing nothing, when the blocks are not
    one chain (the caller then runs the prefix driver)."""
    groups = sequential_groups(model, layers, True)
    by_block = {b: names for b, names in groups if b is not None}
    tail = [n for b, names in groups if b is None for n in names]
    chain = _chain(model, list(by_block)) if by_block else None
    if chain is None:
        return False
    order, _ = chain
    target = torch.device(device) if device is not None else _model_device(model)
    calls = capture_block_inputs(model, model.get_submodule(order[0]), batches, forward, target)
    for name in order:
        block = model.get_submodule(name)
        home = _model_device(block)
        block.to(target)
        group = {n: layers[n] for n in by_block.get(name, [])}
        if group:
            hessians = {n: HessianAccumulator(m.in_features, target) for n, m in group.items()}
            handles = [
                m.register_forward_pre_hook(lambda mod, args, acc=hessians[n]: acc.add(args[0]))
                for n, m in group.items()
            ]
            try:
                _run_block(block, calls)
            finally:
                for h in handles:
                    h.remove()
            quantize_group(model, group, hessians, config, report, progress)
        with torch.no_grad():
            calls = [_with_hidden(call, _output(block(*call[0], **call[1]))) for call in calls]
        block.to(home)
    del calls
    if tail:
        group = {n: layers[n] for n in tail}
        quantize_group(model, group, calibrate_inputs(model, group, batches, forward, None), config, report, progress)
    return True
