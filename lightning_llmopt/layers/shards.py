"""Local shards for the fused modules under tensor parallelism: DTensors in, plain tensors to the kernels, DTensors
(or the plain tensors the sharding plan expects) out.

The kernels take plain tensors. Under :func:`~lightning_llmopt.parallel.tensor_parallel.apply_tp` a fused module
meets DTensors in three places, each handled here:

- a norm's input and output under the plan's hooks (``SequenceParallel``: ``Shard(1)`` on the sequence; otherwise
  ``Replicate``) and its replicated weight: :func:`norm_operands` returns the local tensors, the weight's local tensor
  whose gradient is ``Partial`` (sequence shards: each rank's sum over its tokens, reduced over ``tp`` later as the
  unfused norm's) or ``Replicate`` (every rank saw every token), and how to wrap the output like the input;
- the head's weight, sharded on the vocabulary (``Shard(0)``), and the final norm's output: :func:`vocab_operands`
  returns the local vocabulary slice, its process group, and the hidden states replicated over ``tp`` (gathered from
  the sequence shards; their gradient, already summed over the group by the vocab-parallel loss, is sliced back).

This module imports ``torch.distributed.tensor`` only when a DTensor is present.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["is_dtensor", "norm_operands", "plain", "vocab_operands"]


def is_dtensor(t: Any) -> bool:
    module = sys.modules.get("torch.distributed.tensor")  # nothing can be a DTensor before this is imported
    cls = getattr(module, "DTensor", None) if module is not None else None
    return cls is not None and isinstance(t, cls)


def _same(t: Tensor) -> Tensor:
    return t


class _Waited(torch.autograd.Function):
    """Identity whose output is the plain tensor an ``AsyncCollectiveTensor`` wraps, once its collective is done."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:  # type: ignore[override]
        return x.trigger_wait()  # type: ignore[attr-defined]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:  # type: ignore[override]
        return grad


def plain(t: Tensor) -> Tensor:
    """``t`` as a plain tensor a kernel can read: the local outputs of a tensor-parallel plan (``RowwiseParallel``'s
    reduce-scatter, for one) are ``AsyncCollectiveTensor`` wrappers, which have no data pointer until waited on; the
    wait keeps the autograd graph."""
    if type(t).__name__ == "AsyncCollectiveTensor":
        return _Waited.apply(t)
    return t


def norm_operands(
    inputs: tuple[Tensor, ...], weight: Tensor, sequence_parallel: bool | None
) -> tuple[list[Tensor], Tensor, Callable[[Tensor], Tensor]]:
    """``(local inputs, local weight, wrap)`` for a norm's kernel (see the module docstring).

    ``sequence_parallel``: whether plain-tensor inputs are sequence shards (set by the kernel step,
    :func:`~lightning_llmopt.parallel.fused.apply_kernels`); a DTensor input tells its own layout.
    """
    if not is_dtensor(weight) and not any(is_dtensor(x) for x in inputs):
        return [plain(x) for x in inputs], weight, _same
    from torch.distributed.tensor import DTensor, Partial, Replicate

    ref = next((x for x in inputs if isinstance(x, DTensor)), None)
    wrap: Callable[[Tensor], Tensor] = _same
    if ref is not None:
        sharded = any(p.is_shard() for p in ref.placements)
        mesh, placements = ref.device_mesh, ref.placements

        def wrap(t: Tensor) -> Tensor:
            return DTensor.from_local(t, mesh, placements, run_check=False)

    elif sequence_parallel is None:
        raise ValueError(
            "a fused RMSNorm with a DTensor weight got plain-tensor input: whether it is the sequence-parallel shard "
            "is unknown; apply lightning_llmopt.parallel.fused.apply_kernels(model, tp_mesh, sequence_parallel) after "
            "tensor parallelism"
        )
    else:
        sharded = sequence_parallel
    local = [plain(x.to_local() if isinstance(x, DTensor) else x) for x in inputs]
    if isinstance(weight, DTensor):
        grad = Partial() if sharded else Replicate()
        weight = weight.to_local(grad_placements=[grad] * weight.device_mesh.ndim)
    return local, weight, wrap


def vocab_operands(hidden: Tensor, weight: Tensor) -> tuple[Tensor, Tensor, dist.ProcessGroup | None]:
    """``(hidden, weight slice, group)`` for the vocab-parallel fused linear + cross-entropy.

    ``weight``: a DTensor sharded on the vocabulary (``Shard(0)``) over a 1-D mesh gives its local rows and the mesh's
    group; a replicated one its local copy and no group; a plain tensor is returned as is (group ``None``).
    ``hidden``: a DTensor is made replicated (an all-gather of sequence shards) and local; its gradient comes back
    replicated, as the loss returns it summed over the group, and is sliced to the shard.
    """
    group = None
    if is_dtensor(weight):
        placements = weight.placements  # type: ignore[attr-defined]
        mesh = weight.device_mesh  # type: ignore[attr-defined]
        if mesh.ndim == 1 and placements[0].is_shard() and placements[0].dim == 0:
            group = mesh.get_group()
        elif not all(p.is_replicate() for p in placements):
            raise ValueError(
                f"the fused linear + cross-entropy takes a head weight sharded on the vocabulary (Shard(0)) over a "
                f"1-D mesh or replicated, got placements {tuple(placements)} over a {mesh.ndim}-D mesh"
            )
        weight = weight.to_local()  # type: ignore[attr-defined]
    if is_dtensor(hidden):
        from torch.distributed.tensor import Replicate

        mesh = hidden.device_mesh  # type: ignore[attr-defined]
        hidden = hidden.redistribute(mesh, [Replicate()] * mesh.ndim).to_local()  # type: ignore[attr-defined]
    return plain(hidden), weight, group
