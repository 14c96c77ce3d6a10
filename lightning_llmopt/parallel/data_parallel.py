"""Gradient averaging, replica broadcasts and the global gradient norm over an N-D mesh of local shards.

Parameters are plain tensors or DTensors (tensor-parallel shards, FSDP2 shards, or both); everything here works on
their local tensors, so it is the same code for every layout:

- :func:`all_reduce_gradients`: average gradients over the data-parallel x context-parallel group when no ZeRO
  engine does it (``zero_stage=0``: plain data parallelism with replicated optimizer state), in flat buckets.
- :func:`broadcast_parameters`: make replicas equal after a random initialisation, along one mesh dimension
  (parameters replicated over ``"tp"`` from tp rank 0; everything over ``"dp_cp"`` without ZeRO-3).
- :func:`grad_norm` / :func:`clip_grad_norm_`: the norm of the full gradient. Each rank adds the squares of its
  local gradient divided by the number of ranks holding the same elements (the world size over the product of the
  mesh dimensions the tensor is sharded on; a plain tensor is replicated everywhere), then one all-reduce.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = ["all_reduce_gradients", "broadcast_parameters", "clip_grad_norm_", "grad_norm", "is_shard", "local_tensor"]

_BUCKET_BYTES = 32 * 2**20


def local_tensor(t: Tensor) -> Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _buckets(tensors: list[Tensor], cap: int = _BUCKET_BYTES) -> list[list[Tensor]]:
    """Consecutive runs of tensors sharing dtype and device, each at most ``cap`` bytes (or one tensor)."""
    out: list[list[Tensor]] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if out and out[-1][0].dtype == t.dtype and out[-1][0].device == t.device and size + nbytes <= cap:
            out[-1].append(t)
            size += nbytes
        else:
            out.append([t])
            size = nbytes
    return out


@torch.no_grad()
def all_reduce_gradients(params: Iterable[nn.Parameter], group: Any) -> None:
    """Average the (local) gradients of ``params`` over ``group`` in place, in flat buckets of one dtype."""
    if group is None or dist.get_world_size(group) == 1:
        return
    n = dist.get_world_size(group)
    grads = [local_tensor(p.grad) for p in params if p.grad is not None]
    for bucket in _buckets(grads):
        all_reduce_flat(bucket, group, divide_by=n)


@torch.no_grad()
def all_reduce_flat(tensors: list[Tensor], group: Any, divide_by: int | None = None) -> None:
    """Sum ``tensors`` (one dtype and device) over ``group`` in place with ONE all-reduce of their concatenation
    (then divide by ``divide_by``): many small tensors cost one collective instead of one each."""
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    if divide_by is not None:
        flat.div_(divide_by)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


def _placement_on(t: Tensor, dim_name: str) -> Any:
    """The placement of DTensor ``t`` on mesh dimension ``dim_name`` (None: not a DTensor or not on that dim)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return None
    names = t.device_mesh.mesh_dim_names or ()
    return t.placements[names.index(dim_name)] if dim_name in names else None


@torch.no_grad()
def broadcast_parameters(module: nn.Module, mesh: Any, dim_name: str, *, skip_sharded: bool = True,
                         exclude: set[int] | None = None, only: set[int] | None = None) -> int:
    """Broadcast local parameter tensors from index 0 of mesh dimension ``dim_name`` to the rest of that dimension.

    ``skip_sharded``: leave DTensors sharded on ``dim_name`` alone (their pieces differ by design). ``exclude`` /
    ``only``: ids of parameters to leave out / to restrict to (expert shards). Returns the number of tensors
    broadcast.
    """
    if mesh[dim_name].size() == 1:
        return 0
    group = mesh[dim_name].get_group()
    src = dist.get_global_rank(group, 0)
    n = 0
    for p in module.parameters():
        if (exclude is not None and id(p) in exclude) or (only is not None and id(p) not in only):
            continue
        placement = _placement_on(p, dim_name)
        if skip_sharded and placement is not None and is_shard(placement):
            continue
        t = local_tensor(p.data)
        if t.numel():
            dist.broadcast(t, src=src, group=group)
            n += 1
    return n


def _replicas(t: Tensor, world: int) -> int:
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return world
    mesh = t.device_mesh
    sharded = math.prod(mesh.size(i) for i, p in enumerate(t.placements) if is_shard(p))
    return max(world // sharded, 1)


def is_shard(placement: Any) -> bool:
    """``Shard`` or torch's ``_StridedShard`` (FSDP2 gives the data-parallel dimension of a tensor-parallel weight
    that placement; its ``is_shard()`` is False in torch 2.13, so counting it as replicated halved those terms of
    the global norm under ZeRO-3 x TP)."""
    return placement.is_shard() or hasattr(placement, "split_factor")


def grad_norm(params: Iterable[nn.Parameter], norm_type: float = 2.0) -> Tensor:
    """Norm of the full gradient over all ranks (collective over the default group). Gradients must already be
    reduced (no ``Partial`` DTensors; see :func:`~lightning_llmopt.parallel.tensor_parallel.reduce_partial_grads`).
    """
    if norm_type != 2.0:
        raise ValueError(f"norm_type ({norm_type}) must be 2.0 for the N-D gradient norm")
    world = dist.get_world_size() if dist.is_initialized() else 1
    params = list(params)
    device = local_tensor(params[0].data).device if params else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float32, device=device)
    for p in params:
        if p.grad is not None:
            total = total + local_tensor(p.grad).float().pow(2).sum() / _replicas(p.grad, world)
    if dist.is_initialized() and world > 1:
        dist.all_reduce(total)
    return total.sqrt()


@torch.no_grad()
def clip_grad_norm_(params: Iterable[nn.Parameter], max_norm: float) -> Tensor:
    """Scale gradients so their global norm is at most ``max_norm`` (as ``torch.nn.utils.clip_grad_norm_``);
    returns the norm before clipping."""
    params = [p for p in params if p.grad is not None]
    norm = grad_norm(params)
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for p in params:
        assert p.grad is not None
        g = local_tensor(p.grad)
        g.mul_(coef.to(g.device, g.dtype))
    return norm
