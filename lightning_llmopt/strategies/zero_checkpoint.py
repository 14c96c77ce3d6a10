"""Stage-independent, reshardable checkpoint state for :class:`~lightning_llmopt.strategies.ZeroStrategy`.

Saved DCP state (every rank passes its own pieces; DCP writes each replicated piece once)::

    {"model":       {fqn: Tensor (stages 1/2, replicated) or DTensor (stage 3)},  # FQNs of module.state_dict()
     "optimizer":   {"state": {fqn: {"exp_avg": <full logical tensor>, "step": Tensor(), ...}},
                     "param_groups": bytes},   # torch.save of [{**options, "params": [fqn, ...]}, ...]
     "lightning":   {key: bytes},              # torch.save of each top-level entry of Lightning's checkpoint dict
     "rng":         {"rank<r>": bytes},        # torch/numpy/python (and CUDA) generator states of rank r
     "loss_scaler": {"scale": float, ...}}     # only with 16-mixed

Per-element optimizer state is one logical tensor per parameter, shaped like the parameter. Stage 3 stores it as the
DTensor FSDP2's optimizer holds. Stages 1/2 hold contiguous slices of *flattened* parameters; each slice is cut into
at most ``2 * ndim - 1`` row-major rectangles (a partial first row, whole rows, a partial last row, recursively) and
saved as a ``ShardedTensor`` whose shards are those rectangles, so DCP records ordinary chunks with offsets and can
read any layout back: a ZeRO rank loads the whole parameters that overlap its shard and keeps its slice, FSDP2 loads
its ``Shard(0)`` rows. Loading therefore works across world sizes and stages.
"""

from __future__ import annotations

import io
import math
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_llmopt.parallel.zero import ZeroOptimizer
from lightning_llmopt.parallel.zero_state import FORMAT

Rect = tuple[tuple[int, ...], tuple[int, ...]]


def to_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def from_bytes(blob: bytes) -> Any:
    return torch.load(io.BytesIO(blob), weights_only=False)


def flat_range_rects(lo: int, hi: int, shape: tuple[int, ...]) -> list[Rect]:
    """Row-major rectangles ``(offsets, sizes)`` covering flat elements ``[lo, hi)`` of a tensor of ``shape``.

    The rectangles are in flat order and each covers a contiguous flat range, so a flat slice splits into them by
    consecutive ``numel`` counts.
    """
    if hi <= lo:
        return []
    if len(shape) <= 1:
        return [((lo,), (hi - lo,))] if shape else [((), ())]
    inner = math.prod(shape[1:])
    first, last = lo // inner, (hi - 1) // inner
    if first == last:
        return [((first, *o), (1, *s)) for o, s in flat_range_rects(lo - first * inner, hi - first * inner,
                                                                     shape[1:])]
    out: list[Rect] = []
    start_row = first
    if lo % inner:
        out += [((first, *o), (1, *s)) for o, s in flat_range_rects(lo % inner, inner, shape[1:])]
        start_row = first + 1
    end_row = hi // inner
    if end_row > start_row:
        out.append(((start_row,) + (0,) * (len(shape) - 1), (end_row - start_row, *shape[1:])))
    if hi % inner:
        out += [((end_row, *o), (1, *s)) for o, s in flat_range_rects(0, hi % inner, shape[1:])]
    return out


def _param_ranges(opt: ZeroOptimizer) -> dict[str, tuple[tuple[int, ...], list[tuple[int, int]]]]:
    """``{fqn: (shape, [(lo, hi) per rank])}``: the flat element range of each parameter held by every rank."""
    out = {}
    for b in opt.buckets:
        for i, p in enumerate(b.params):
            start, end = b.offsets[i], b.offsets[i] + p.numel()
            ranges = [(max(start, r * b.shard_size) - start, min(end, (r + 1) * b.shard_size) - start)
                      for r in range(opt.world_size)]
            out[b.names[i]] = (tuple(p.shape), ranges)
    return out


def _sharded_tensor(local_flat: Tensor, lo: int, shape: tuple[int, ...], ranges: list[tuple[int, int]],
                    rank: int, global_ranks: list[int]) -> Any:
    """A ShardedTensor of logical ``shape`` whose local shards hold ``local_flat`` (flat elements from ``lo``).

    ``ranges`` and ``rank`` are indexed by the ZeRO group's ranks; ``global_ranks[r]`` is group rank ``r``'s global
    rank, which a shard's placement names (the group is not the whole world under pipeline parallelism)."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

    metas, local = [], []
    for r, (a, b) in enumerate(ranges):
        pos = 0
        for offsets, sizes in flat_range_rects(a, b, shape):
            meta = ShardMetadata(list(offsets), list(sizes), f"rank:{global_ranks[r]}/cpu")
            metas.append(meta)
            if r == rank:
                n = math.prod(sizes)
                local.append(Shard(local_flat[pos: pos + n].reshape(sizes), meta))
                pos += n
    props = TensorProperties.create_from_tensor(local_flat)
    global_meta = ShardedTensorMetadata(metas, torch.Size(shape), props)
    return ShardedTensor._init_from_local_shards_and_global_metadata(local, global_meta)


def zero_optimizer_state(opt: ZeroOptimizer) -> dict[str, Any]:
    """The stage-independent optimizer entry for a ZeRO-1/2 optimizer (see the module docstring)."""
    sd = opt.state_dict()
    ranges = _param_ranges(opt)
    group = opt.process_group
    global_ranks = [dist.get_global_rank(group, r) if group is not None else r for r in range(opt.world_size)]
    state: dict[str, dict[str, Any]] = {}
    for fqn, entry in sd["params"].items():
        shape, per_rank = ranges[fqn]
        lo = entry["offset"]
        state[fqn] = {k: v if v.dim() == 0 else _sharded_tensor(v, lo, shape, per_rank, opt.rank, global_ranks)
                      for k, v in entry["state"].items()}
    groups = [{**{k: v for k, v in g.items() if k != "param_names"}, "params": list(g["param_names"])}
              for g in sd["param_groups"]]
    return {"state": state, "param_groups": to_bytes(groups)}


def _saved_optimizer_keys(metadata: Any) -> dict[str, dict[str, Any]]:
    """``{fqn: {state key: TensorStorageMetadata}}`` of the optimizer state recorded in a DCP checkpoint."""
    out: dict[str, dict[str, Any]] = {}
    for key, meta in metadata.state_dict_metadata.items():
        if key.startswith("optimizer.state.") and hasattr(meta, "size"):
            fqn, _, name = key[len("optimizer.state."):].rpartition(".")
            out.setdefault(fqn, {})[name] = meta
    return out


def zero_optimizer_template(opt: ZeroOptimizer, metadata: Any) -> dict[str, Any]:
    """What a ZeRO rank reads: whole parameters' state where its shard overlaps them, every parameter's scalars."""
    saved = _saved_optimizer_keys(metadata)
    ranges = _param_ranges(opt)
    state: dict[str, dict[str, Any]] = {}
    for fqn, (_shape, per_rank) in ranges.items():
        lo, hi = per_rank[opt.rank]
        keys = saved.get(fqn, {})
        entry = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in keys.items()
                 if len(m.size) == 0 or hi > lo}
        if entry:
            state[fqn] = entry
    return {"state": state, "param_groups": b""}


def load_zero_optimizer(opt: ZeroOptimizer, loaded: Mapping[str, Any], module: nn.Module,
                        pipeline_stage: bool = False) -> None:
    """Load the optimizer entry read by :func:`zero_optimizer_template` (masters are the loaded parameters).

    ``pipeline_stage``: ``module`` is one pipeline stage, whose optimizer holds part of each saved param group."""
    groups = from_bytes(loaded["param_groups"])
    params = dict(module.named_parameters())
    entries: dict[str, Any] = {}
    for fqn, (shape, per_rank) in _param_ranges(opt).items():
        lo, hi = per_rank[opt.rank]
        saved = loaded["state"].get(fqn, {})
        master = params[fqn].detach().reshape(-1).cpu() if hi > lo else torch.empty(0)
        st = {k: (v.reshape(-1) if v.dim() > 0 else v) for k, v in saved.items()}
        entries[fqn] = {"shape": shape, "offset": 0, "master": master, "state": st}
    full = {"format": FORMAT, "world_size": 1, "rank": 0, "params": entries,
            "param_groups": _own_groups(groups, opt.group_names, pipeline_stage)}
    opt.load_state_dict(full)


def _own_groups(groups: list[dict[str, Any]], own: list[list[str]], pipeline_stage: bool) -> list[dict[str, Any]]:
    """The saved groups' options and names, for ``ZeroOptimizer.load_state_dict`` (which checks the names). A
    pipeline stage holds part of each saved group (saved with every stage's names): there this stage's names, where
    each lies within the saved group of the same index."""
    if not pipeline_stage or len(groups) != len(own) or any(
        not set(names) <= set(g["params"]) for g, names in zip(groups, own, strict=True)
    ):
        return [{**{k: v for k, v in g.items() if k != "params"}, "param_names": list(g["params"])} for g in groups]
    return [{**{k: v for k, v in g.items() if k != "params"}, "param_names": list(names)}
            for g, names in zip(groups, own, strict=True)]


# ---------------------------------------------------------------------------------------------- RNG and plain values
def rng_state() -> bytes:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:  # pragma: no cover - numpy is optional
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return to_bytes(state)


def set_rng_state(blob: bytes) -> None:
    state = from_bytes(blob)
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def read_metadata(folder: str | Path) -> Any:
    import torch.distributed.checkpoint as dcp

    return dcp.FileSystemReader(str(folder)).read_metadata()


def saved_top_keys(metadata: Any, prefix: str) -> list[str]:
    """Keys under ``prefix.`` (one level, the rest of the flattened name) recorded in a DCP checkpoint."""
    head = prefix + "."
    return sorted({k[len(head):] for k in metadata.state_dict_metadata if k.startswith(head)})


def broadcast_object(obj: Any, group: Any = None) -> Any:
    if not (dist.is_available() and dist.is_initialized()):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


__all__ = ["flat_range_rects", "from_bytes", "load_zero_optimizer", "rng_state", "set_rng_state", "to_bytes",
           "zero_optimizer_state", "zero_optimizer_template"]
