"""Initialising meta-built modules that are not our models, the same way in every layout (convention 16).

Our models (:class:`~lightning_llmopt.models.llama.Llama`) seed every parameter from its name
(:mod:`lightning_llmopt.models.init`). Any other module (a transformers ``PreTrainedModel``, a plain ``nn.Linear``
head) is initialised, when built eagerly, by its constructors (``reset_parameters``, in construction order) and, for
transformers, once more by ``post_init`` (``_init_weights`` of every module, children before parents), all from the
default generator. On the meta device neither runs. :func:`replay_init` replays both on the allocated, possibly
sharded module, from the same generator:

1. every module with parameters and ``reset_parameters``, in registration order: swap in full-size plain tensors
   on the compute device, run ``reset_parameters``, copy this rank's shard into each parameter;
2. at the end of every transformers model's subtree (where its constructor calls ``post_init``): ``_init_weights``
   of each of its modules not initialised yet, children first, on full-size tensors likewise (what
   ``_init_weights`` does not write keeps step 1's values); then ``tie_weights``.

The generator draws exactly what the eager build draws, so with the same RNG state (``seed_everything(s)`` before
``configure_model``) the weights equal the one-process eager build's, whatever the sharding, and the generator ends
where the eager build leaves it. Assumptions, true of transformers models: modules are constructed in registration
order, and an initialisation writes only its module's own parameters. A pipeline stage (blocks pruned away) would
skip the pruned blocks' draws: stages of such models are not covered.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from lightning_llmopt.models.init import copy_shard_, local_tensor

__all__ = ["is_hf_model", "replay_init"]


def is_hf_model(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers ``PreTrainedModel`` (duck-typed: ``_init_weights`` and ``post_init``)."""
    return callable(getattr(module, "_init_weights", None)) and callable(getattr(module, "post_init", None))


@contextmanager
def _full_params(module: nn.Module, device: torch.device, sentinel: bool) -> Iterator[dict[str, Tensor]]:
    """Replace ``module``'s own floating-point parameters by full-size plain ones on ``device`` (NaN-filled with
    ``sentinel``) for the duration; yields them by name."""
    originals = {n: p for n, p in module._parameters.items() if p is not None and p.is_floating_point()}
    full = {}
    for name, p in originals.items():
        t = torch.empty(p.shape, dtype=local_tensor(p).dtype, device=device)
        if sentinel:
            t.fill_(float("nan"))
        full[name] = t
        module._parameters[name] = nn.Parameter(t, requires_grad=p.requires_grad)
    try:
        yield full
    finally:
        for name, p in originals.items():
            module._parameters[name] = p


def _copy_back(
    module: nn.Module, originals: Mapping[str, Tensor], full: Mapping[str, Tensor], partial_ok: bool
) -> None:
    for name, t in full.items():
        if partial_ok:  # a sentinel run: copy only what the initialisation wrote
            unset = torch.isnan(t)
            if bool(unset.all()):
                continue
            if bool(unset.any()):
                raise RuntimeError(
                    f"{type(module).__name__}.{name}: its initialisation wrote part of the tensor (or NaN); "
                    "it cannot be replayed shard by shard"
                )
        copy_shard_(originals[name], t.to(local_tensor(originals[name]).device))


def _run_on_full(module: nn.Module, fn: object, device: torch.device, sentinel: bool) -> None:
    originals = {n: p for n, p in module._parameters.items() if p is not None and p.is_floating_point()}
    if not originals:
        fn(module)  # type: ignore[operator]  # e.g. transformers' rotary buffers
        return
    with _full_params(module, device, sentinel) as full:
        fn(module)  # type: ignore[operator]
    _copy_back(module, originals, full, partial_ok=sentinel)


def _hf_order(module: nn.Module, owner: nn.Module | None) -> Iterator[tuple[nn.Module, nn.Module]]:
    """``(module, owning transformers model)`` in ``post_init``'s order: children first, each module initialised by
    its nearest enclosing ``PreTrainedModel`` (transformers' ``smart_apply``)."""
    for child in module.children():
        yield from _hf_order(child, child if is_hf_model(child) else owner)
    if owner is not None:
        yield module, owner


@torch.no_grad()
def replay_init(module: nn.Module, device: torch.device | str, skip: set[int] | None = None) -> None:
    """Initialise ``module``'s (allocated, possibly sharded) parameters as its eager construction would have, from
    the default generator of ``device`` (the compute device; see the module docstring). Modules whose ``id`` is in
    ``skip`` (initialised otherwise, e.g. our models and their submodules) are left alone."""
    _replay(module, torch.device(device), skip or set(), set())


def _replay(module: nn.Module, device: torch.device, skip: set[int], seen: set[int]) -> None:
    """Construction order: a module's own ``reset_parameters``, then its children's; a transformers model's
    ``post_init`` at the end of its own construction (so a nested model, e.g. ``LlamaModel`` inside
    ``LlamaForCausalLM``, is initialised before its parent's remaining children are even built)."""
    if id(module) in skip or id(module) in seen:
        return
    seen.add(id(module))
    reset = getattr(module, "reset_parameters", None)
    if callable(reset) and any(p is not None for p in module._parameters.values()):
        _run_on_full(module, lambda m: m.reset_parameters(), device, sentinel=False)
    for child in module.children():
        _replay(child, device, skip, seen)
    if is_hf_model(module):
        _post_init(module, device, skip)


def _post_init(model: nn.Module, device: torch.device, skip: set[int]) -> None:
    """transformers' ``init_weights``: ``_init_weights`` of every module not yet initialised, children first, on
    full tensors; then ``tie_weights``."""
    for sub, owner in _hf_order(model, model):
        if id(sub) in skip or getattr(sub, "_is_hf_initialized", False):
            continue
        _run_on_full(sub, owner._init_weights, device, sentinel=True)
        setattr(sub, "_is_hf_initialized", True)  # noqa: B010 - transformers' flag, as its post_init sets it
    tie = getattr(model, "tie_weights", None)
    if callable(tie):
        tie()
