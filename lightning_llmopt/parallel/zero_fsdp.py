"""FSDP2 ``fully_shard`` from a meta-device model: stage 3 of :class:`~lightning_llmopt.strategies.ZeroStrategy`
and the data-parallel sharding of :func:`~lightning_llmopt.parallel.parallelize`.

1. ``configure_model`` builds the model on the meta device (the strategy's ``tensor_init_context``).
2. :func:`shard_module` applies ``fully_shard`` to the token embedding, to every transformer block (the values of
   each ``layers`` ``ModuleList``/``ModuleDict``: our ``Llama.layers``, transformers' ``model.layers``) and to the
   final norm + output head as one unit, then to every top-level child of the LightningModule that holds parameters
   (the roots whose ``forward`` the module calls), and sets forward and backward prefetching along that chain.
3. :func:`materialize` allocates only the local shards (``to_empty``) and initialises them, the same way in every
   layout: our models by ``init_weights`` (each parameter from a generator seeded by its name), other modules by
   replaying their eager initialisation (:mod:`lightning_llmopt.parallel.init`); a full tensor exists one parameter
   at a time, no rank ever holds a full copy of the model.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn


def transformer_blocks(module: nn.Module) -> list[nn.Module]:
    """The blocks of every ``layers`` container (``nn.ModuleList`` or ``nn.ModuleDict``) in ``module``, in order."""
    blocks: list[nn.Module] = []
    for name, child in module.named_modules():
        if name.rsplit(".", 1)[-1] == "layers" and isinstance(child, nn.ModuleList | nn.ModuleDict):
            blocks.extend(child.values() if isinstance(child, nn.ModuleDict) else list(child))
    return blocks


_EMBEDDING_NAMES = ("tok_embeddings", "embed_tokens")
_HEAD_NAMES = ("output", "lm_head")
_FINAL_NORM_NAMES = ("norm",)


def edge_modules(module: nn.Module) -> tuple[nn.Module | None, list[nn.Module]]:
    """``(embedding, [final norm, head])`` of the first decoder found in ``module`` (ours or transformers').

    The embedding is the ``tok_embeddings``/``embed_tokens`` module that sits beside a ``layers`` container; the head
    group is that decoder's (or its parent's) final ``norm`` and ``output``/``lm_head``. Tied embedding and head
    weights return ``(None, [])``: one parameter cannot belong to two FSDP units.
    """
    named = dict(module.named_modules())
    for name, child in named.items():
        if name.rsplit(".", 1)[-1] != "layers" or not isinstance(child, nn.ModuleList | nn.ModuleDict):
            continue
        decoder_name = name.rsplit(".", 1)[0] if "." in name else ""
        parents = [decoder_name]
        if "." in decoder_name:
            parents.append(decoder_name.rsplit(".", 1)[0])  # transformers: lm_head sits on the *ForCausalLM
        elif decoder_name:
            parents.append("")

        def find(names: tuple[str, ...], parents: list[str] = parents) -> nn.Module | None:
            for parent in parents:
                for n in names:
                    sub = named.get(f"{parent}.{n}" if parent else n)
                    if sub is not None and any(True for _ in sub.parameters()):
                        return sub
            return None

        embedding, head, norm = find(_EMBEDDING_NAMES), find(_HEAD_NAMES), find(_FINAL_NORM_NAMES)
        if embedding is not None and head is not None:
            shared = {id(p) for p in embedding.parameters()} & {id(p) for p in head.parameters()}
            if shared:
                return None, []
        return embedding, [m for m in (norm, head) if m is not None]
    return None, []


def shard_module(
    module: nn.Module,
    mesh: Any,
    *,
    offload_parameters: bool = False,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    reshard_after_forward: bool = True,
    prefetch: bool = True,
    split_edges: bool = True,
) -> list[nn.Module]:
    """Apply FSDP2 to ``module``'s units, then to its top-level children with parameters; returns the sharded units.

    Units, in forward order: the token embedding, every transformer block, and the final norm with the output head
    (``split_edges``; otherwise these stay in the root unit). Each unit's gather and reduce-scatter then overlaps
    with its neighbours' compute: the head's gradients are reduced while the blocks run backward, and the first
    forward gather is the embedding alone rather than embedding plus head. The last block and the head group keep
    their gathered parameters from forward into backward (``reshard_after_forward=False``), since backward needs
    them first. A plain ``nn.Embedding`` unit is not gathered again for backward, which reads only the token ids.
    Forward and backward prefetch run along the whole chain.

    Raises ``ValueError`` (before any collective) if parameters sit directly on ``module``: they belong to no root
    whose forward FSDP2 can hook.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    direct = [n for n, _ in module.named_parameters(recurse=False)]
    if direct:
        raise ValueError(
            f"stage 3 shards the LightningModule's children; parameters {direct} are attached directly "
            f"to {type(module).__name__}: move them into a submodule"
        )
    offload: Any = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload_parameters else OffloadPolicy()
    kwargs: dict[str, Any] = {
        "mesh": mesh,
        "offload_policy": offload,
        "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
    }
    blocks = transformer_blocks(module)
    embedding, head = edge_modules(module) if split_edges else (None, [])
    chain: list[nn.Module] = []
    if embedding is not None:
        fully_shard(embedding, reshard_after_forward=reshard_after_forward, **kwargs)
        chain.append(embedding)
    for i, block in enumerate(blocks):
        last = i == len(blocks) - 1 and bool(head)
        fully_shard(block, reshard_after_forward=reshard_after_forward and not last, **kwargs)
        chain.append(block)
    if head:
        fully_shard(head, reshard_after_forward=False, **kwargs)  # type: ignore[arg-type]  # list: one unit
        chain.append(head[-1])
    roots = [child for child in module.children() if any(True for _ in child.parameters())]
    for root in roots:
        fully_shard(root, reshard_after_forward=reshard_after_forward, **kwargs)
    register_forward_methods(roots)
    skip_backward = embedding is not None and _gather_free_backward(embedding)
    if skip_backward:  # its backward reads only the token ids: no gather (FSDP1's root likewise keeps it gathered)
        embedding.set_unshard_in_backward(False)  # type: ignore[union-attr, operator]
    if prefetch and len(chain) > 1:
        for i, unit in enumerate(chain):
            if i + 1 < len(chain):
                unit.set_modules_to_forward_prefetch([chain[i + 1]])  # type: ignore[operator]
            if i > 1 or (i == 1 and not skip_backward):
                unit.set_modules_to_backward_prefetch([chain[i - 1]])  # type: ignore[operator]
    return [*chain, *roots]


def register_forward_methods(units: list[nn.Module]) -> list[str]:
    """Make FSDP2 run its forward hooks around every method a unit declares in ``forward_methods`` (``Llama.loss``,
    ``Llama.hidden_states``), as around ``forward``; returns the qualified names registered.

    FSDP2 gathers a unit's parameters and, on the root, sets up its communication state (lazy init, streams,
    prefetch) in hooks on ``forward`` only. A training step that enters the model through another method (the fused
    loss goes through ``Llama.loss``) would otherwise reach the first block's or the embedding's hooks before the
    root's: FSDP2 then fails with ``'FSDPCommContext' object has no attribute 'all_gather_copy_in_stream'``.
    """
    from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

    done = []
    for unit in units:
        if not isinstance(unit, FSDPModule):
            continue
        for name in getattr(unit, "forward_methods", ()):
            if callable(getattr(unit, name, None)) and name not in vars(unit):
                register_fsdp_forward_method(unit, name)
                done.append(f"{type(unit).__name__}.{name}")
    return done


def _gather_free_backward(module: nn.Module) -> bool:
    """Whether ``module``'s backward needs none of its parameters' values: a plain ``nn.Embedding`` (its weight
    gradient is a scatter of the output gradient by token id). ``max_norm`` renormalises the weight in place and
    sparse gradients take another path, so those keep the gather; so does a torch without FSDP2's switch."""
    plain = isinstance(module, nn.Embedding) and type(module).forward is nn.Embedding.forward  # FSDP subclasses it
    return plain and module.max_norm is None and not module.sparse and hasattr(module, "set_unshard_in_backward")


@torch.no_grad()
def materialize(module: nn.Module, device: torch.device, buffer_device: torch.device | None = None) -> None:
    """Allocate meta parameters/buffers on ``device`` (local shards only) and initialise them in place.

    Only the top-level children that hold meta tensors are allocated: ``to_empty`` on the whole LightningModule
    would also replace the states of its torchmetrics metrics (real tensors) with uninitialised memory. The other
    children move to ``buffer_device`` (default ``device``), where the module computes.

    ``buffer_device``: where buffers end up (default ``device``). With parameter offload the parameters stay on the
    CPU and FSDP2 moves them for compute, but it does not manage buffers (RoPE tables): those go to the GPU.
    """
    if not _has_meta(module):
        _move_buffers(module, buffer_device)
        return
    own = any(t.is_meta for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)])
    targets = [module] if own else [c for c in module.children() if _has_meta(c)]
    for target in targets:
        target.to_empty(device=device)
        _initialise(target, skip_self=target is module, device=buffer_device or device)
    if not own:
        for child in module.children():
            if all(child is not t for t in targets):
                child.to(buffer_device or device)
    _move_buffers(module, buffer_device)


def _has_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in [*module.parameters(), *module.buffers()])


def _initialise(module: nn.Module, skip_self: bool, device: torch.device | None = None) -> None:
    """Our models through their ``init_weights(buffer_device)`` (each parameter seeded by its name), everything else
    (transformers models, plain heads) by replaying its eager initialisation on full tensors
    (:func:`~lightning_llmopt.parallel.init.replay_init`); either way the values do not depend on the sharding.
    ``device``: where the model computes, where full tensors are generated (default: the parameters' device)."""
    from lightning_llmopt.parallel.init import replay_init

    done: set[int] = set()
    for sub in module.modules():
        if id(sub) in done:
            continue
        init = getattr(sub, "init_weights", None)
        if callable(init) and hasattr(sub, "init_seed") and not (skip_self and sub is module):
            init(buffer_device=device)
            done.update(id(m) for m in sub.modules())
    where = device or next((local(p).device for p in module.parameters()), torch.device("cpu"))
    replay_init(module, where, skip=done)


def _move_buffers(module: nn.Module, device: torch.device | None) -> None:
    if device is None:
        return
    for sub in module.modules():
        for name, buf in sub._buffers.items():
            if buf is not None and buf.device != device:
                sub._buffers[name] = buf.to(device)


def fsdp_units(module: nn.Module) -> list[nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in module.modules() if isinstance(m, FSDPModule)]


@contextmanager
def no_gradient_sync(module: nn.Module) -> Iterator[None]:
    """Accumulate unsharded gradients locally (no reduce-scatter) within the context."""
    units = fsdp_units(module)
    for unit in units:
        unit.set_requires_gradient_sync(False, recurse=False)  # type: ignore[operator]
    try:
        yield
    finally:
        for unit in units:
            unit.set_requires_gradient_sync(True, recurse=False)  # type: ignore[operator]


def local(t: Tensor) -> Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def memory_bytes(module: nn.Module, optimizers: list[Any]) -> dict[str, int]:
    """Per-rank bytes of (local shards of) parameters, gradients and optimizer state, from tensor sizes."""

    def nbytes(t: Tensor) -> int:
        x = local(t)
        return x.numel() * x.element_size()

    params = list(module.parameters())
    state = 0
    for opt in optimizers:
        for s in opt.state.values():
            state += sum(nbytes(v) for v in s.values() if isinstance(v, Tensor))
    return {
        "parameters": sum(nbytes(p) for p in params),
        "gradients": sum(nbytes(p.grad) for p in params if p.grad is not None),
        "optimizer_state": state,
        "master_weights": 0,
    }


__all__ = [
    "edge_modules",
    "fsdp_units",
    "local",
    "materialize",
    "memory_bytes",
    "no_gradient_sync",
    "register_forward_methods",
    "shard_module",
    "transformer_blocks",
]
