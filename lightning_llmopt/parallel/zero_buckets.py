"""Flat gradient/parameter buckets and input validation for :mod:`lightning_llmopt.parallel.zero`.

A bucket holds parameters of one optimizer param group, one dtype and one device, in the order their gradients are
expected during backward (reverse registration order, as DDP does). Its flat parameter buffer is padded to a
multiple of the world size; rank ``r`` owns the contiguous shard ``[r * S, (r + 1) * S)`` with
``S = padded_numel / world_size``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

# Optimizers whose update of one element reads only that element's parameter, gradient and state (plus scalars),
# so running them on a contiguous slice of a flattened parameter gives the same numbers as on the whole tensor.
ELEMENTWISE_OPTIMIZERS = ("SGD", "Adam", "AdamW", "Adamax", "Adagrad", "Adadelta", "RMSprop", "NAdam", "RAdam",
                          "ASGD", "Rprop")
# Optimizers known to need whole tensors (factored second moments, matrix orthogonalisation, closures, sparse).
WHOLE_TENSOR_OPTIMIZERS = ("Adafactor", "Muon", "LBFGS", "SparseAdam", "Shampoo", "Lion8bit")


@dataclass
class Bucket:
    """One flat bucket: the parameters it holds and this rank's view of it.

    ``offsets[i]`` is where ``params[i]`` starts in the flat buffer (elements). ``flat_grad`` is the full-size local
    gradient buffer (persistent in stage 1, allocated on the first gradient and freed after the reduce-scatter in
    stage 2); ``master`` is this rank's shard in the master dtype (a view of ``flat_param`` when no copy is needed).
    """

    index: int
    group: int
    params: list[nn.Parameter]
    names: list[str]
    offsets: list[int]
    numel: int
    padded_numel: int
    shard_size: int
    shard_start: int
    flat_param: Tensor
    master: Tensor = field(init=False)
    master_aliased: bool = False
    flat_grad: Tensor | None = None
    grad_shard: Tensor | None = None  # stage 2: accumulated reduced shard, in the master dtype on the master device
    ready: set[int] = field(default_factory=set)
    pending: tuple[Any, Tensor, Tensor] | None = None  # (work or None, communicated buffer, output buffer)

    @property
    def shard_end(self) -> int:
        return self.shard_start + self.shard_size

    def grad_view(self, i: int) -> Tensor:
        """``params[i]``'s slice of ``flat_grad`` shaped like the parameter."""
        assert self.flat_grad is not None
        p = self.params[i]
        return self.flat_grad[self.offsets[i]: self.offsets[i] + p.numel()].view_as(p)

    def param_ranges_in_shard(self) -> list[tuple[int, int, int]]:
        """``(param index, lo, hi)``: element range ``[lo, hi)`` of each parameter (flattened) inside this shard."""
        out = []
        for i, p in enumerate(self.params):
            start, end = self.offsets[i], self.offsets[i] + p.numel()
            lo, hi = max(start, self.shard_start), min(end, self.shard_end)
            if lo < hi:
                out.append((i, lo - start, hi - start))
        return out


def check_elementwise(optimizer: torch.optim.Optimizer, assume_elementwise: bool) -> None:
    """Refuse optimizers whose update needs whole tensors; sharding a flat buffer would change their math."""
    name = type(optimizer).__name__
    known = {getattr(torch.optim, n) for n in ELEMENTWISE_OPTIMIZERS if hasattr(torch.optim, n)}
    if type(optimizer) in known or assume_elementwise and name not in WHOLE_TENSOR_OPTIMIZERS:
        return
    if name in WHOLE_TENSOR_OPTIMIZERS:
        raise ValueError(
            f"optimizer {name} needs whole parameter tensors (factored/matrix statistics, closures or sparse "
            f"gradients), but ZeRO runs the optimizer on flat 1/N shards; use one of {ELEMENTWISE_OPTIMIZERS}"
        )
    raise ValueError(
        f"optimizer {type(optimizer).__module__}.{name} is not known to be elementwise; ZeRO runs it on flat 1/N "
        f"shards of the parameters. Known elementwise: {ELEMENTWISE_OPTIMIZERS}. If every state tensor has the "
        "parameter's shape and each element's update reads only that element, pass assume_elementwise=True"
    )


def check_arguments(stage: int, bucket_size_mb: float, reduce_dtype: torch.dtype | None,
                    master_dtype: torch.dtype | None) -> None:
    if stage not in (1, 2):
        raise ValueError(f"stage ({stage!r}) must be 1 or 2 (stage 3 is FSDP2 fully_shard)")
    if not bucket_size_mb > 0:
        raise ValueError(f"bucket_size_mb ({bucket_size_mb}) must be > 0")
    for what, dt in (("reduce_dtype", reduce_dtype), ("master_dtype", master_dtype)):
        if dt is not None and not (isinstance(dt, torch.dtype) and dt.is_floating_point):
            raise ValueError(f"{what} ({dt!r}) must be a floating-point torch.dtype or None")


def named_groups(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[tuple[list[str], list[nn.Parameter],
                                                                                   dict[str, Any]]]:
    """Per param group of ``optimizer``: parameter names in ``model``, the parameters and the group's options.

    Raises a ``ValueError`` naming the problem for parameters outside the model, repeated parameters, parameters
    on several devices, non-trainable parameters and an optimizer that already has state.
    """
    if len(optimizer.state) > 0:
        raise ValueError(
            f"the optimizer already has state for {len(optimizer.state)} parameter(s); wrap it with ZeRO before the "
            "first step and restore checkpoints through ZeroOptimizer.load_state_dict"
        )
    names = {p: n for n, p in model.named_parameters()}
    seen: set[nn.Parameter] = set()
    groups = []
    for gi, group in enumerate(optimizer.param_groups):
        params = list(group["params"])
        for p in params:
            if p not in names:
                raise ValueError(f"param group {gi} holds a tensor of shape {tuple(p.shape)} that is not a "
                                 "parameter of the model")
            if p in seen:
                raise ValueError(f"parameter {names[p]!r} appears in more than one param group")
            if not p.requires_grad:
                raise ValueError(f"parameter {names[p]!r} is in the optimizer but has requires_grad=False")
            seen.add(p)
        options = {k: v for k, v in group.items() if k != "params"}
        groups.append(([names[p] for p in params], params, options))
    devices = sorted({str(p.device) for _, ps, _ in groups for p in ps})
    if len(devices) > 1:
        raise ValueError(f"parameters are on several devices ({devices}); ZeRO needs them on one device per rank")
    return groups


def plan_buckets(groups: list[tuple[list[str], list[nn.Parameter], dict[str, Any]]], bucket_size_mb: float
                 ) -> list[tuple[int, list[str], list[nn.Parameter]]]:
    """Split each group, in reverse order, into ``(group index, names, params)`` of at most ``bucket_size_mb``.

    Buckets never mix groups or dtypes; a parameter larger than the cap gets a bucket of its own.
    """
    cap = bucket_size_mb * 2**20
    plan: list[tuple[int, list[str], list[nn.Parameter]]] = []
    for gi, (names, params, _) in enumerate(groups):
        cur_names: list[str] = []
        cur: list[nn.Parameter] = []
        size = 0.0
        for name, p in reversed(list(zip(names, params, strict=True))):
            nbytes = p.numel() * p.element_size()
            if cur and (size + nbytes > cap or p.dtype != cur[0].dtype):
                plan.append((gi, cur_names, cur))
                cur_names, cur, size = [], [], 0.0
            cur_names.append(name)
            cur.append(p)
            size += nbytes
        if cur:
            plan.append((gi, cur_names, cur))
    return plan


@torch.no_grad()
def build_bucket(index: int, group: int, names: list[str], params: list[nn.Parameter], world_size: int,
                 rank: int) -> Bucket:
    """Copy ``params`` into one padded flat buffer and make each ``param.data`` a view of it (identity unchanged)."""
    offsets, total = [], 0
    for p in params:
        offsets.append(total)
        total += p.numel()
    padded = max(math.ceil(total / world_size), 1) * world_size
    shard = padded // world_size
    flat = torch.zeros(padded, dtype=params[0].dtype, device=params[0].device)
    for p, off in zip(params, offsets, strict=True):
        flat[off: off + p.numel()].copy_(p.detach().reshape(-1))
        p.data = flat[off: off + p.numel()].view(p.shape)
    return Bucket(index=index, group=group, params=params, names=names, offsets=offsets, numel=total,
                  padded_numel=padded, shard_size=shard, shard_start=rank * shard, flat_param=flat)


@torch.no_grad()
def attach_master(bucket: Bucket, master_dtype: torch.dtype | None, offload: bool) -> None:
    """Give ``bucket`` its master shard: a view of ``flat_param`` when dtype and device allow, else a copy."""
    shard = bucket.flat_param[bucket.shard_start: bucket.shard_end]
    dtype = master_dtype or shard.dtype
    if dtype == shard.dtype and not offload:
        bucket.master, bucket.master_aliased = shard, True
    else:
        device = torch.device("cpu") if offload else shard.device
        bucket.master, bucket.master_aliased = shard.to(device=device, dtype=dtype, copy=True), False
