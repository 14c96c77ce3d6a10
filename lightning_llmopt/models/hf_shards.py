"""Loading a Hugging Face folder into a model that a strategy has already sharded: each rank reads its own part.

After tensor parallelism and/or ZeRO-3 (FSDP2) have turned the parameters into DTensors, every parameter's local
shard is a box of the global tensor: :func:`load_sharded` computes that box from the DTensor's mesh and placements
and reads only it from the safetensors file (``safe_open(...).get_slice``: the bytes of that box, memory-mapped), so no
rank ever holds a full copy of a sharded weight. Plain (replicated) parameters are read whole. A placement other
than ``Shard``/``Replicate`` (e.g. FSDP2's strided shard over a tensor-parallel dimension) is read whole once and
distributed with ``distribute_tensor`` (a collective: every rank visits the parameters in the same order).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_llmopt.models.hf_files import SAFETENSORS_INDEX, SAFETENSORS_NAME
from lightning_llmopt.models.hf_weights import key_map

__all__ = ["load_sharded"]

_WRAPPERS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def _files(folder: Path) -> dict[str, Path]:
    """``{HF name: safetensors file}`` of a folder (sharded with an index, or one file)."""
    if (folder / SAFETENSORS_INDEX).is_file():
        weight_map = json.loads((folder / SAFETENSORS_INDEX).read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    if (folder / SAFETENSORS_NAME).is_file():
        from safetensors import safe_open

        with safe_open(str(folder / SAFETENSORS_NAME), framework="pt") as f:
            return dict.fromkeys(f.keys(), folder / SAFETENSORS_NAME)  # noqa: SIM118
    raise FileNotFoundError(f"no safetensors weights in {str(folder)!r} (streaming shards needs safetensors)")


def _box(param: Any) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """``(local shape, global offset)`` of a DTensor's local shard, ``None`` for a plain tensor or a placement that
    is not one box per rank."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(param, DTensor):
        return None
    if not all(type(p) in (Shard, Replicate) for p in param.placements):
        return None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)


@torch.no_grad()
def load_sharded(model: nn.Module, folder: str | os.PathLike[str]) -> int:
    """Copy the weights of a Hugging Face folder into ``model`` (a :class:`~lightning_llmopt.models.Llama`, plain or
    with DTensor parameters), each rank reading only its local part of sharded parameters.

    Returns the number of elements read on this rank (for tests and logs).
    """
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor, distribute_tensor

    config = getattr(model, "config", None)
    if config is None:
        raise TypeError(f"load_sharded expects a lightning_llmopt Llama, got {type(model).__name__}")
    names, files = key_map(config), _files(Path(folder))
    handles: dict[Path, Any] = {}
    read = 0
    try:
        for raw, param in model.named_parameters():
            ours = raw
            for wrapper in _WRAPPERS:
                ours = ours.replace(wrapper, "")
            theirs = names.get(ours)
            if ours == "output.weight" and config.tie_embeddings and theirs not in files:
                theirs = names["tok_embeddings.weight"]  # tied: a head that is its own Parameter gets the embedding
            if theirs is None or theirs not in files:
                raise KeyError(f"{str(folder)!r} has no tensor for parameter {ours!r} (expected {theirs!r})")
            file = files[theirs]
            if file not in handles:
                handles[file] = safe_open(str(file), framework="pt").__enter__()
            stored = tuple(handles[file].get_slice(theirs).get_shape())
            if stored != tuple(param.shape):
                raise ValueError(
                    f"{theirs} in {str(folder)!r} has shape {stored}, the model's {ours} {tuple(param.shape)}"
                )
            box = _box(param)
            local = param.to_local() if isinstance(param, DTensor) else param.data
            if box is not None or not isinstance(param, DTensor):
                shape, offset = box if box is not None else (tuple(param.shape), (0,) * param.dim())
                part = handles[file].get_slice(theirs)[
                    tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))
                ]
                local.copy_(part.to(local.dtype))
                read += part.numel()
            else:
                full = handles[file].get_tensor(theirs).to(local.dtype)
                local.copy_(distribute_tensor(full.to(local.device), param.device_mesh, param.placements).to_local())
                read += full.numel()
    finally:
        for handle in handles.values():
            handle.__exit__(None, None, None)
    return read
