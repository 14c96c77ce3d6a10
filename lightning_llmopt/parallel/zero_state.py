"""Reshardable checkpoints of :class:`~lightning_llmopt.parallel.zero.ZeroOptimizer`.

The functions take the optimizer as a :class:`ShardedOptimizer` (the attributes they read), so this module sits
below ``zero.py``, which calls them.

Format (``"format": "llmopt-zero/1"``), plain dicts of CPU tensors::

    {"format": ..., "world_size": N, "rank": r,
     "param_groups": [{**options (lr, betas, weight_decay, ...), "param_names": [fqn, ...]}, ...],
     "params": {fqn: {"shape": (...), "offset": o,            # slice start in the flattened parameter
                      "master": Tensor (n,),                   # master weights of elements [o, o + n)
                      "state": {"exp_avg": Tensor (n,), "step": Tensor (), ...}}}}

A rank's :func:`sharded_state_dict` holds the slices its shards own; a full state dict (``full_state_dict``, or
:func:`consolidate_state_dicts` of all ranks' dicts) holds one slice per parameter with offset 0. Loading takes a full
dict or any complete list of sharded dicts, so a checkpoint written with N ranks loads with M ranks, and
:func:`to_torch_optimizer_state` turns it into a plain ``torch.optim`` ``state_dict()`` for the unsharded model.
Per-element state is sliced; 0-dim state (Adam's ``step``) is the same for every element and is copied.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn

if TYPE_CHECKING:
    from lightning_llmopt.parallel.zero_buckets import Bucket

FORMAT = "llmopt-zero/1"


class ShardedOptimizer(Protocol):
    """What these functions use of a :class:`~lightning_llmopt.parallel.zero.ZeroOptimizer`."""

    @property
    def optimizer(self) -> torch.optim.Optimizer: ...
    @property
    def buckets(self) -> list[Bucket]: ...
    @property
    def group_names(self) -> list[list[str]]: ...
    @property
    def group_options(self) -> list[dict[str, Any]]: ...
    @property
    def process_group(self) -> Any: ...
    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def device(self) -> torch.device: ...
    def _push_params(self) -> None: ...


def _groups(opt: ShardedOptimizer) -> list[dict[str, Any]]:
    live = iter(opt.optimizer.param_groups)
    out = []
    for gi, names in enumerate(opt.group_names):
        options = dict(opt.group_options[gi])
        if any(b.group == gi for b in opt.buckets):
            options = {k: v for k, v in next(live).items() if k != "params"}
        out.append({**options, "param_names": list(names)})
    return out


def _slice(value: Any, start: int, n: int, shard_size: int) -> Any:
    if not isinstance(value, Tensor) or value.dim() == 0:
        return value.detach().cpu().clone() if isinstance(value, Tensor) else value
    if value.numel() != shard_size:
        raise ValueError(f"optimizer state of shape {tuple(value.shape)} is not per-element (shard has {shard_size})")
    return value.detach().reshape(-1)[start: start + n].cpu().clone()


def sharded_state_dict(opt: ShardedOptimizer) -> dict[str, Any]:
    params: dict[str, Any] = {}
    for b in opt.buckets:
        state = opt.optimizer.state.get(b.master, {})
        for i, lo, hi in b.param_ranges_in_shard():
            a, n = b.offsets[i] + lo - b.shard_start, hi - lo
            params[b.names[i]] = {"shape": tuple(b.params[i].shape), "offset": lo,
                                  "master": _slice(b.master, a, n, b.shard_size),
                                  "state": {k: _slice(v, a, n, b.shard_size) for k, v in state.items()}}
    return {"format": FORMAT, "world_size": opt.world_size, "rank": opt.rank, "param_groups": _groups(opt),
            "params": params}


def _gather_to_rank0(opt: ShardedOptimizer, shard: Tensor) -> Tensor | None:
    x = shard.detach().reshape(-1).to(opt.device)
    if opt.world_size == 1:
        return x.cpu().clone()
    group: Any = opt.process_group
    dst = dist.get_global_rank(group, 0)
    parts = [torch.empty_like(x) for _ in range(opt.world_size)] if opt.rank == 0 else None
    dist.gather(x, parts, dst=dst, group=opt.process_group)
    return torch.cat(parts).cpu() if parts is not None else None


def full_state_dict(opt: ShardedOptimizer) -> dict[str, Any]:
    """Gather, bucket by bucket, every shard's master weights and per-element state to rank 0."""
    params: dict[str, Any] = {}
    for b in opt.buckets:
        state = opt.optimizer.state.get(b.master, {})
        full_master = _gather_to_rank0(opt, b.master)
        full_state: dict[str, Any] = {}
        for k, v in sorted(state.items()):  # same key order on every rank: the gathers must match
            full_state[k] = _gather_to_rank0(opt, v) if isinstance(v, Tensor) and v.dim() > 0 else _slice(v, 0, 0, 0)
        if full_master is None:
            continue
        for i, p in enumerate(b.params):
            o, n = b.offsets[i], p.numel()
            params[b.names[i]] = {"shape": tuple(p.shape), "offset": 0, "master": full_master[o: o + n].clone(),
                                  "state": {k: v[o: o + n].clone() if v.dim() > 0 else v
                                            for k, v in full_state.items()}}
    if opt.rank != 0:
        return {}
    return {"format": FORMAT, "world_size": 1, "rank": 0, "param_groups": _groups(opt), "params": params}


def _as_list(state: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    shards = [state] if isinstance(state, Mapping) else list(state)
    if not shards or any(s.get("format") != FORMAT for s in shards):
        raise ValueError(f"expected a ZeRO state dict (format {FORMAT!r}) or a non-empty list of them")
    return shards


def _pieces(shards: list[Mapping[str, Any]]) -> dict[str, list[Mapping[str, Any]]]:
    out: dict[str, list[Mapping[str, Any]]] = {}
    for s in shards:
        for name, entry in s["params"].items():
            out.setdefault(name, []).append(entry)
    return out


def _fill(dst: Tensor, key: str | None, pieces: list[Mapping[str, Any]], lo: int, hi: int, name: str) -> None:
    """Copy elements ``[lo, hi)`` of parameter ``name`` (master if ``key`` is None, else state ``key``) into dst."""
    covered = 0
    for e in pieces:
        src = e["master"] if key is None else e["state"].get(key)
        if src is None:
            continue
        start = e["offset"]
        x, y = max(lo, start), min(hi, start + src.numel())
        if x < y:
            dst[x - lo: y - lo].copy_(src[x - start: y - start])
            covered += y - x
    if covered != hi - lo:
        what = "master weights" if key is None else f"state {key!r}"
        raise ValueError(f"the checkpoint covers {covered} of the {hi - lo} elements [{lo}, {hi}) of {what} of "
                         f"{name!r}; pass the state dicts of every rank")


def _bucket_state(b: Bucket, pieces: dict[str, list[Mapping[str, Any]]], master: Tensor) -> dict[str, Any]:
    entries = [e for name in b.names for e in pieces[name]]
    keys = {k: v for e in entries for k, v in e["state"].items()}
    # Scalars are cloned: torch optimizers update "step" in place and must not write into the checkpoint.
    state: dict[str, Any] = {k: _slice(v, 0, 0, 0) for k, v in keys.items()
                             if not (isinstance(v, Tensor) and v.dim() > 0)}
    sliced = {k: torch.zeros(b.shard_size, dtype=v.dtype) for k, v in keys.items() if k not in state}
    state.update(sliced)
    for i, lo, hi in b.param_ranges_in_shard():
        a = b.offsets[i] + lo - b.shard_start
        _fill(master[a: a + hi - lo], None, pieces[b.names[i]], lo, hi, b.names[i])
        for k, t in sliced.items():
            _fill(t[a: a + hi - lo], k, pieces[b.names[i]], lo, hi, b.names[i])
    return state


@torch.no_grad()
def load_state_dict(opt: ShardedOptimizer, state: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> None:
    shards = _as_list(state)
    saved = [list(g["param_names"]) for g in shards[0]["param_groups"]]
    if saved != opt.group_names:
        raise ValueError(f"checkpoint param groups {[len(g) for g in saved]} (parameter names "
                         f"{sorted(set(sum(saved, [])) ^ set(sum(opt.group_names, [])))[:5]} differ) do not match "
                         f"this optimizer's {[len(g) for g in opt.group_names]}")
    pieces = _pieces(shards)
    index = {id(p): k for k, p in enumerate(p for g in opt.optimizer.param_groups for p in g["params"])}
    inner_state, masters = {}, []
    for b in opt.buckets:
        master = b.master.detach().cpu().clone()
        st = _bucket_state(b, pieces, master)
        if st:
            inner_state[index[id(b.master)]] = st
        masters.append(master)
    groups = opt.optimizer.state_dict()["param_groups"]
    live = [gi for gi in range(len(opt.group_names)) if any(b.group == gi for b in opt.buckets)]
    for g, gi in zip(groups, live, strict=True):
        g.update({k: v for k, v in shards[0]["param_groups"][gi].items() if k not in ("param_names", "params")})
    opt.optimizer.load_state_dict({"state": inner_state, "param_groups": groups})
    for b, master in zip(opt.buckets, masters, strict=True):
        b.master.copy_(master)
    opt._push_params()


def consolidate_state_dicts(shards: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Merge every rank's sharded state dict into a full one (offset 0, whole flattened tensors); no collectives."""
    shards = _as_list(shards)
    params: dict[str, Any] = {}
    for name, pieces in _pieces(shards).items():
        shape = tuple(pieces[0]["shape"])
        n = math.prod(shape)
        master = torch.empty(n, dtype=pieces[0]["master"].dtype)
        _fill(master, None, pieces, 0, n, name)
        state: dict[str, Any] = {}
        for k, v in pieces[0]["state"].items():
            if isinstance(v, Tensor) and v.dim() > 0:
                state[k] = torch.empty(n, dtype=v.dtype)
                _fill(state[k], k, pieces, 0, n, name)
            else:
                state[k] = _slice(v, 0, 0, 0)  # a copy: optimizers update "step" in place
        params[name] = {"shape": shape, "offset": 0, "master": master, "state": state}
    return {"format": FORMAT, "world_size": 1, "rank": 0, "param_groups": shards[0]["param_groups"],
            "params": params}


def master_weights(state: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> dict[str, Tensor]:
    """``{fqn: master weight shaped like the parameter}`` from a full or a complete list of sharded dicts."""
    full = consolidate_state_dicts(_as_list(state))
    return {name: e["master"].view(e["shape"]) for name, e in full["params"].items()}


def to_torch_optimizer_state(state: Mapping[str, Any] | Sequence[Mapping[str, Any]], model: nn.Module,
                             optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """A ``state_dict()`` that ``optimizer`` (same class, over ``model``'s unsharded parameters, param groups in the
    checkpoint's order) loads with ``load_state_dict``; state tensors are reshaped to the parameter shapes."""
    full = consolidate_state_dicts(_as_list(state))
    by_name = dict(model.named_parameters())
    index = {id(p): k for k, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    if len(full["param_groups"]) != len(optimizer.param_groups):
        raise ValueError(f"checkpoint has {len(full['param_groups'])} param groups, optimizer "
                         f"{len(optimizer.param_groups)}")
    out_state = {}
    for name, e in full["params"].items():
        if name not in by_name or id(by_name[name]) not in index:
            raise ValueError(f"checkpoint parameter {name!r} is not a parameter of the model's optimizer")
        if e["state"]:
            out_state[index[id(by_name[name])]] = {
                k: v.view(e["shape"]) if isinstance(v, Tensor) and v.dim() > 0 else v for k, v in e["state"].items()}
    groups = [{**{k: v for k, v in saved.items() if k != "param_names"},
               "params": [index[id(by_name[n])] for n in saved["param_names"]]}
              for saved in full["param_groups"]]
    return {"state": out_state, "param_groups": groups}
