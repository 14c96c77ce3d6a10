"""Collective wrappers for ZeRO that work on torch 2.11-2.13, gloo and NCCL.

Collectives are looked up on :mod:`torch.distributed` at call time (tests count them by patching that module).

gloo and ``reduce_scatter_tensor``: torch 2.13's gloo backend implements it; older builds may raise
"not supported". :func:`gloo_supports_reduce_scatter` probes once with a tiny tensor of the reduce dtype; when the
probe fails ZeRO-2 falls back to ``all_reduce`` of the bucket followed by a local slice (same result, twice the
receive volume). NCCL always uses ``reduce_scatter_tensor``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

ProcessGroup = Any  # torch.distributed.ProcessGroup; Any keeps mypy quiet across torch versions


def all_gather_flat(output: Tensor, shard: Tensor, group: ProcessGroup, async_op: bool) -> Any:
    """Gather every rank's ``shard`` into ``output`` (``world_size * shard.numel()`` elements), in rank order."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
    return fn(output, shard, group=group, async_op=async_op)


def reduce_scatter_flat(output: Tensor, full: Tensor, group: ProcessGroup, async_op: bool) -> Any:
    """Sum ``full`` over ranks and keep this rank's contiguous ``output.numel()`` slice in ``output``."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # renamed in torch 2.13
    return fn(output, full, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def backend_name(group: ProcessGroup) -> str:
    return str(dist.get_backend(group)).lower()


def gloo_supports_reduce_scatter(group: ProcessGroup, dtype: torch.dtype, device: torch.device) -> bool:
    """Run one tiny ``reduce_scatter_tensor`` (a collective: every rank must call this) and report success."""
    n = dist.get_world_size(group)
    try:
        out = torch.zeros(1, dtype=dtype, device=device)
        reduce_scatter_flat(out, torch.ones(n, dtype=dtype, device=device), group, async_op=False)
        return bool(out.item() == n)
    except (RuntimeError, NotImplementedError, ValueError):
        return False
