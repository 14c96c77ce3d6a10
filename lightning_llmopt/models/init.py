"""Layout-independent initialisation: every parameter from its own generator, full tensor first, then the shard.

Convention 16 (same seed, same run, in every layout): how a model is sharded must not change its initial weights.

1. :func:`draw_base_seed` draws one integer from the CPU default generator (``torch.default_generator``) when a
   model is constructed, before its submodules, so ``seed_everything(s)`` fixes it in every layout: the draw is on
   the CPU even inside a ``torch.device("meta")`` context, and every rank makes the same one draw.
2. Each parameter gets a generator seeded with :func:`param_seed` ``(base seed, fully qualified name)``: the name is
   the parameter's path in the model (``layers.3.attention.wq.weight``), unchanged by tensor, context, pipeline and
   expert parallelism, ZeRO and activation checkpointing (wrapper segments are dropped by :func:`canonical_name`).
3. :func:`init_param_` generates the parameter's FULL (global) tensor on the device with that generator and copies
   in only the local part: a ``DTensor``'s shard as its placements say (``distribute_tensor(full, mesh, placements,
   src_data_rank=None)``, no communication), or rows ``[offset, offset + n)`` of a plain tensor holding a slice of
   the experts (expert parallelism over a process group).

The values depend on the seed, the name, the shape, the dtype and the device type (CUDA and CPU generators differ),
never on the layout. One parameter's full tensor exists at a time (a 128k x 4096 embedding transiently).
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable
from typing import TypeVar

import torch
from torch import Tensor, nn

__all__ = ["canonical_name", "copy_shard_", "draw_base_seed", "init_param_", "local_tensor", "param_seed", "to_empty"]

# Segments that wrappers insert into parameter names (activation checkpointing, torch.compile, FSDP1).
_WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")

Fill = Callable[[Tensor, torch.Generator], object]
ModuleT = TypeVar("ModuleT", bound=nn.Module)


def to_empty(module: ModuleT, device: torch.device | str) -> ModuleT:
    """``module.to_empty(device=device)`` without torch's Python ``empty_like`` for meta tensors, which imports sympy
    (about a second, once per process) on its first use: each parameter and buffer is replaced by an uninitialised
    ``torch.empty_strided`` of its size, stride and dtype on ``device`` (parameters keep ``requires_grad``). As with
    ``to_empty``, a parameter shared by two modules becomes two tensors: ``init_weights`` ties them again."""
    for mod in module.modules():
        for name, p in list(mod.named_parameters(recurse=False)):
            empty = torch.empty_strided(p.size(), p.stride(), dtype=p.dtype, device=device)
            setattr(mod, name, nn.Parameter(empty, requires_grad=p.requires_grad))
        for name, b in list(mod.named_buffers(recurse=False)):
            setattr(mod, name, torch.empty_strided(b.size(), b.stride(), dtype=b.dtype, device=device))
    return module


def draw_base_seed() -> int:
    """One draw from the CPU default generator (63-bit), on the CPU whatever the default device (meta included)."""
    return int(torch.randint(0, 2**62, (), generator=torch.default_generator, device="cpu"))


def canonical_name(name: str) -> str:
    """``name`` without the segments wrappers insert (``_checkpoint_wrapped_module``, ``_orig_mod``)."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_SEGMENTS)


def param_seed(base: int, name: str) -> int:
    """The generator seed of parameter ``name``: a hash of ``(base, canonical_name(name))`` (stable across processes,
    unlike Python's ``hash``), in ``[0, 2**63)``."""
    digest = hashlib.blake2b(f"{base}:{canonical_name(name)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def local_tensor(t: Tensor) -> Tensor:
    """The local part of ``t``: ``t.to_local()`` for a ``DTensor``, else ``t``."""
    return t.to_local() if hasattr(t, "to_local") else t


def _distribute(full: Tensor, mesh: object, placements: tuple) -> Tensor:
    """This rank's part of ``full`` under ``placements`` on ``mesh``, without communication."""
    from torch.distributed.tensor import distribute_tensor

    if "src_data_rank" in inspect.signature(distribute_tensor).parameters:
        return distribute_tensor(full, mesh, placements, src_data_rank=None).to_local()  # type: ignore[arg-type]
    # torch < 2.6: slice by hand (Shard and Replicate placements, torch.chunk semantics as DTensor's).
    from torch.distributed.tensor import Replicate, Shard

    local = full
    for dim, placement in enumerate(placements):
        if type(placement) is Shard:
            n, rank = mesh.size(dim), mesh.get_local_rank(dim)  # type: ignore[attr-defined]
            chunks = list(torch.chunk(local, n, dim=placement.dim))
            local = chunks[rank] if rank < len(chunks) else local.narrow(placement.dim, 0, 0)
        elif not isinstance(placement, Replicate):
            raise NotImplementedError(f"placement {placement} needs torch >= 2.6 to initialise a shard in place")
    return local


def copy_shard_(param: Tensor, full: Tensor, offset: int = 0) -> None:
    """Copy this rank's part of ``full`` (the global tensor) into ``param``.

    ``param``: a ``DTensor`` (its shard under its placements), or a plain tensor of ``full``'s shape, or a plain
    tensor holding rows ``[offset, offset + param.shape[0])`` of ``full`` (expert parallelism over a process group).
    """
    local = local_tensor(param)
    if hasattr(param, "device_mesh") and hasattr(param, "placements"):
        part = _distribute(full, param.device_mesh, tuple(param.placements))
    elif local.shape == full.shape:
        part = full
    else:
        part = full.narrow(0, offset, local.shape[0])
    if part.shape != local.shape:
        raise RuntimeError(
            f"initialisation: a shard of shape {tuple(part.shape)} for a local tensor of shape {tuple(local.shape)}"
        )
    local.copy_(part)


@torch.no_grad()
def init_param_(
    param: Tensor,
    name: str,
    base_seed: int,
    fill: Fill,
    *,
    shape: torch.Size | tuple[int, ...] | None = None,
    offset: int = 0,
    device: torch.device | str | None = None,
) -> None:
    """Initialise ``param`` (plain or ``DTensor``) as if ``fill(full, generator)`` had run on its full tensor.

    Arguments:
        param: the parameter (its storage already allocated: not on the meta device).
        name: its fully qualified name in the model (the generator's seed depends on it).
        base_seed: the model's seed (:func:`draw_base_seed`).
        fill: writes the full tensor in place from the generator, e.g.
            ``lambda t, g: t.normal_(0.0, std, generator=g)``.
        shape: the global shape, if ``param`` is a plain tensor holding a slice of it (default ``param.shape``:
            a ``DTensor``'s global shape).
        offset: first row of that slice.
        device: where to generate (default: the local tensor's device); generating on the compute device keeps
            values equal when parameters are offloaded to the CPU.
    """
    local = local_tensor(param)
    where = torch.device(device) if device is not None else local.device
    if where.type == "meta":
        return
    full = torch.empty(shape if shape is not None else param.shape, dtype=local.dtype, device=where)
    generator = torch.Generator(device=where)
    generator.manual_seed(param_seed(base_seed, name))
    fill(full, generator)
    copy_shard_(param, full.to(local.device), offset)
