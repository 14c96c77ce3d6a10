"""Expert parallelism: the experts of every MoE layer sharded over a process group, tokens moved by all-to-all.

:func:`apply_expert_parallel` is applied to a finished model (CONVENTIONS.md rule 1): rank ``r`` of the EP group
keeps experts ``[r * E/ep, (r+1) * E/ep)`` of every :class:`~lightning_llmopt.models.moe.MoEFeedForward` and gets an
:class:`AllToAllDispatcher`. Router, shared experts and every other parameter stay replicated.

Per MoE layer and step (GShard's dispatch/combine, with uneven splits instead of a fixed capacity buffer):

1. route locally; sort the kept assignments by global expert id, which groups them by destination rank;
2. exchange per-expert counts (one all-to-all of ``E`` integers), then the token rows (uneven all-to-all);
3. order the received rows by local expert and run the grouped SwiGLU;
4. all-to-all the outputs back, weight and sum them per token.

Both all-to-alls are differentiable (:class:`_AllToAll`: backward is the reverse exchange). The split sizes are
read on the host (one synchronisation per layer), as any uneven all-to-all needs.

Gradients: a rank's loss is the mean over its own tokens; the all-to-all backward sums the EP group's contributions
to each expert, and ``GroupedExperts.grad_scale = 1/ep`` turns that sum into the mean, so :func:`reduce_gradients`
averages the replicated parameters over the whole data-parallel world and each expert over the ranks holding a copy
of it (the expert-data-parallel group); FSDP2 over those ranks does the same. The EP group is borrowed from the
data-parallel ranks: with ``dp`` data-parallel ranks and ``ep`` dividing it, ranks ``{j*ep .. j*ep+ep-1}`` form an
EP group and ranks ``{i, i+ep, ...}`` hold the same experts.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_llmopt.models.moe import MoEFeedForward, moe_layers
from lightning_llmopt.models.moe_routing import Routing, kept_assignments

__all__ = [
    "AllToAllDispatcher",
    "apply_expert_parallel",
    "expert_groups",
    "expert_param_ids",
    "is_expert_param",
    "reduce_gradients",
]


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> Tensor:  # type: ignore[override]
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None]:  # type: ignore[override]
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


class AllToAllDispatcher:
    """Dispatcher of an expert-parallel MoE layer (see the module docstring for the steps)."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.size = dist.get_world_size(group)

    def __call__(self, x: Tensor, routing: Routing, layer: MoEFeedForward) -> Tensor:
        n, k = x.shape[0], routing.experts.shape[-1]
        num_experts, ep = layer.config.num_experts, self.size
        local = num_experts // ep
        experts = routing.experts.reshape(n * k)
        tokens = torch.arange(n, device=x.device).repeat_interleave(k)
        idx = kept_assignments(routing.keep.reshape(n * k), routing.dropless)
        order = idx[torch.argsort(experts[idx], stable=True)]  # by global expert = by destination rank
        counts = torch.bincount(experts[order], minlength=num_experts)  # (E,)
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.group)  # (ep * local,): [source][local expert]
        recv_by_src = recv_counts.view(ep, local)
        send, recv = torch.stack((counts.view(ep, local).sum(1), recv_by_src.sum(1))).tolist()  # one host read
        rows = _AllToAll.apply(x[tokens[order]], recv, send, self.group)  # (R, D) ordered by (source, expert)
        local_ids = torch.arange(local, device=x.device).repeat(ep)
        row_expert = torch.repeat_interleave(local_ids, recv_by_src.reshape(-1))
        perm = torch.argsort(row_expert, stable=True)  # (source, expert) -> (expert, source)
        y_sorted = layer.experts(rows[perm], recv_by_src.sum(0))
        y = torch.empty_like(y_sorted).index_copy(0, perm, y_sorted)  # back to (source, expert) order
        back = _AllToAll.apply(y, send, recv, self.group)  # (M, D) in this rank's sorted order
        weights = routing.weights.reshape(n * k)[order, None]
        out = torch.zeros(n, x.shape[1], device=x.device, dtype=weights.dtype)
        return out.index_add(0, tokens[order], back.to(weights.dtype) * weights)


def _local(t: Tensor) -> Tensor:
    """The local shard of a DTensor expert weight (differentiable), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def expert_groups(world_size: int, ep: int) -> tuple[list[list[int]], list[list[int]]]:
    """``(ep_groups, expert_dp_groups)`` rank lists for ``ep`` dividing ``world_size`` (see the module docstring)."""
    if ep < 1 or world_size % ep != 0:
        raise ValueError(f"expert_parallel ({ep}) must divide the data-parallel world size ({world_size})")
    ep_groups = [list(range(j * ep, (j + 1) * ep)) for j in range(world_size // ep)]
    dp_groups = [list(range(i, world_size, ep)) for i in range(ep)]
    return ep_groups, dp_groups


def is_expert_param(p: Tensor) -> bool:
    """Whether ``p`` was made an expert shard by :func:`apply_expert_parallel` (a marker on the parameter object;
    code that may see re-created parameters, e.g. after materialising a meta model, uses :func:`expert_param_ids`)."""
    return bool(getattr(p, "_expert_parallel", False))


def expert_param_ids(model: nn.Module) -> set[int]:
    """``id`` of every expert weight sharded by expert parallelism: the experts of MoE layers whose dispatcher is
    an :class:`AllToAllDispatcher`. Structural, so it holds for whatever parameter objects the layers hold now."""
    return {
        id(p)
        for layer in moe_layers(model)
        if isinstance(layer.dispatcher, AllToAllDispatcher)
        for p in layer.experts.parameters()
    }


@torch.no_grad()
def apply_expert_parallel(model: nn.Module, group: Any) -> list[MoEFeedForward]:
    """Keep this rank's experts in every MoE layer of ``model`` and route through ``group`` (in place).

    ``group``: a process group, or a 1-D ``DeviceMesh`` (e.g. ``mesh["ep"]``). With a mesh the expert weights become
    ``DTensor``s sharded on dim 0 over it, so distributed checkpoints save whole experts and load into any expert
    layout (and ``set_model_state_dict`` can scatter full weights); with a process group they are plain local
    tensors. Works on meta-device models. Raises ``ValueError`` (before any collective) if a layer's
    ``num_experts`` is not divisible by the group size.
    """
    mesh = group if hasattr(group, "get_group") else None
    pg = mesh.get_group() if mesh is not None else group
    ep, rank = dist.get_world_size(pg), dist.get_rank(pg)
    layers = moe_layers(model)
    for layer in layers:
        if layer.config.num_experts % ep != 0:
            raise ValueError(f"num_experts ({layer.config.num_experts}) must be divisible by expert_parallel ({ep})")
    for layer in layers:
        local = layer.config.num_experts // ep
        sl = slice(rank * local, (rank + 1) * local)
        for name in ("w1", "w2", "w3"):
            full = getattr(layer.experts, name)
            data = full[sl].clone()
            if mesh is not None:
                from torch.distributed.tensor import DTensor, Shard

                data = DTensor.from_local(
                    data, mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride()
                )
            shard = nn.Parameter(data, requires_grad=full.requires_grad)
            shard._expert_parallel = True  # type: ignore[attr-defined]
            setattr(layer.experts, name, shard)
        layer.expert_offset = rank * local
        layer.experts.grad_scale = 1.0 / ep
        layer.dispatcher = AllToAllDispatcher(pg)
    return layers


@torch.no_grad()
def reduce_gradients(model: nn.Module, world_group: Any = None, expert_dp_group: Any = None) -> None:
    """Average gradients for an EP(×DP) step: replicated parameters over ``world_group`` (``None``: the default
    group), expert parameters over
    ``expert_dp_group`` (the ranks with the same experts; ``None``: no copies). Expert gradients arrive already
    divided by the EP size (``GroupedExperts.grad_scale``), so both averages give the global-batch mean."""
    experts = expert_param_ids(model)
    for p in model.parameters():
        if p.grad is None:
            continue
        grad = _local(p.grad)
        if id(p) in experts or is_expert_param(p):
            if expert_dp_group is None:
                continue  # one copy of these experts: nothing to average
            group = expert_dp_group
        else:
            group = world_group  # None: the default group
        size = dist.get_world_size(group)
        if size > 1:
            dist.all_reduce(grad, group=group)
            grad.div_(size)
