"""Gradient reductions that tensor parallelism leaves to the strategy, run after backward.

- :func:`reduce_partial_grads`: replicated weights applied to sequence-sharded activations (norms under sequence
  parallelism) get ``Partial`` DTensor gradients; they are summed over the tensor-parallel group, in one flat
  all-reduce per mesh and dtype where the layout allows.
- :func:`sum_moe_grads`: under tensor parallelism each rank routes its own slice of the sequence through the MoE
  layers, so their weights' gradients are summed over the group (one flat all-reduce per layer and dtype).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_llmopt.parallel.data_parallel import all_reduce_flat, local_tensor

__all__ = ["reduce_partial_grads", "sum_moe_grads"]


@torch.no_grad()
def sum_moe_grads(module: nn.Module) -> int:
    """After backward: sum the gradients of every tensor-parallel MoE layer's weights over its group (each rank
    routed its own slice of the sequence). Sums are linear, so this also holds after FSDP2's reduce-scatter (every
    tensor-parallel rank holds the same data-parallel shard). A weight no token reached has a zero gradient here, so
    every rank runs the same collectives. Returns the number of tensors summed."""
    from lightning_llmopt.models.moe import moe_layers

    n = 0
    for layer in moe_layers(module):
        if layer.tp_group is None:
            continue
        grads = []
        for p in layer.parameters():
            if p.requires_grad:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grads.append(local_tensor(p.grad))
        for dtype in sorted({g.dtype for g in grads}, key=str):  # one collective per layer and dtype
            all_reduce_flat([g for g in grads if g.dtype == dtype], layer.tp_group)
        n += len(grads)
    return n


@torch.no_grad()
def reduce_partial_grads(module: nn.Module) -> int:
    """All-reduce DTensor gradients left ``Partial`` (replicated weights applied to sharded activations, e.g. norms
    under sequence parallelism) into the parameter's placements; returns how many were reduced.

    The common case, ``Partial("sum")`` gradients of ``Replicate`` weights on a 1-D mesh, is summed in one flat
    all-reduce per mesh and dtype (two norms per block would otherwise cost two small collectives each); any other
    layout is redistributed one gradient at a time."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    flat_groups: dict[tuple[Any, torch.dtype], list[Any]] = {}  # DTensor parameters with Partial gradients
    n = 0
    for p in module.parameters():
        g = p.grad
        if not (isinstance(g, DTensor) and isinstance(p, DTensor) and any(pl.is_partial() for pl in g.placements)):
            continue
        n += 1
        if g.placements == (Partial("sum"),) and p.placements == (Replicate(),) and g.device_mesh == p.device_mesh:
            flat_groups.setdefault((g.device_mesh, g.dtype), []).append(p)
        else:
            p.grad = g.redistribute(g.device_mesh, p.placements)
    for (mesh, _), params in flat_groups.items():
        grads = [p.grad for p in params]
        locals_ = [g.to_local() for g in grads]
        all_reduce_flat(locals_, mesh.get_group())  # in place: each local tensor now holds the sum
        for p, g, local in zip(params, grads, locals_, strict=True):
            p.grad = DTensor.from_local(local, mesh, p.placements, run_check=False, shape=g.shape, stride=g.stride())
    return n
