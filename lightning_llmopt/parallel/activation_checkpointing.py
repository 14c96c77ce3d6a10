"""Activation checkpointing applied to a finished model: trade forward recomputation for activation memory.

A checkpointed block keeps only its inputs during the forward pass and recomputes its internals in the backward
pass (Chen et al., "Training Deep Nets with Sublinear Memory Cost", arXiv 1604.06174). Policies:

- ``"full"``: every block is checkpointed (one extra forward of all blocks, about 1/3 more model FLOPs).
- ``"every_n"``: blocks ``0, n, 2n, ...`` (``ceil(L / n)`` blocks).
- ``"sqrt"``: ``round(sqrt(L))`` blocks evenly spaced (indices ``i * L // k``), the memory/compute budget of Chen et
  al.'s sqrt(L) scheme. Chen et al. group the layers into sqrt(L) segments; with whole transformer blocks as units
  per-block checkpointing ("full") already keeps only the block inputs, so here sqrt(L) is the number of blocks
  recomputed, a middle point between "every_n" and "full".
- ``"selective"``: every block, but through torch's selective checkpointing
  (:func:`torch.utils.checkpoint.create_selective_checkpoint_contexts`): outputs of matmuls (``mm``, ``addmm``,
  ``bmm``, ``baddbmm``, ``_scaled_mm``) and of fused attention kernels are saved (``MUST_SAVE``), every other op
  (norms, RoPE, SiLU, products, views) is recomputed (``PREFER_RECOMPUTE``). Almost no matmul FLOPs are redone.
- ``"none"``: nothing is wrapped.

Wrapping keeps module and parameter names: the block's ``forward`` is replaced by an instance attribute that runs the
class ``forward`` under :func:`torch.utils.checkpoint.checkpoint` (``use_reentrant=False``), so ``state_dict`` keys
are unchanged (unlike ``checkpoint_wrapper``, which inserts ``_checkpoint_wrapped_module.``), and FSDP/``compile``
applied afterwards see the same module tree. Applying twice raises; :func:`remove_activation_checkpointing` undoes.

Order with other parallelisms (docs/architecture.md): TP -> CP -> activation checkpointing -> compile -> ZeRO/FSDP.
"""

from __future__ import annotations

import contextvars
import math
import types
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lightning_llmopt.models.layer_pattern import attended_keys

POLICIES = ("none", "full", "every_n", "sqrt", "selective")
# Where blocks live in common decoders: ours (`layers`), transformers Llama/Mistral/Qwen (`model.layers`), GPT-2
# (`transformer.h`), GPT-NeoX (`gpt_neox.layers`), OPT (`model.decoder.layers`).
BLOCK_PATHS = ("layers", "model.layers", "transformer.h", "gpt_neox.layers", "model.decoder.layers")
_STATE_ATTR = "_llmopt_ac"


def _save_ops() -> frozenset[Any]:
    names = ("mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
             "_scaled_dot_product_flash_attention_for_cpu", "_flash_attention_forward",
             "_efficient_attention_forward")
    return frozenset(getattr(torch.ops.aten, n) for n in names if hasattr(torch.ops.aten, n))


SAVE_OPS = _save_ops()  # op packets whose outputs the "selective" policy saves


def selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Selective-checkpoint policy: save matmul and attention outputs, recompute everything else."""
    packet = getattr(op, "overloadpacket", op)
    return CheckpointPolicy.MUST_SAVE if packet in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


@dataclass
class _BlockState:
    policy: str
    previous_forward: Callable[..., Any] | None  # an instance-level forward that was there before us
    enabled: bool = True


# --------------------------------------------------------------------------- measurement plumbing


class _Recorder:
    """Distinct storages (by device and address) saved for backward, minus the model's parameters and buffers."""

    def __init__(self, exclude: set[tuple[str, int]]) -> None:
        self.exclude = exclude
        self.storages: dict[tuple[str, int], int] = {}
        self.alive: list[Tensor] = []  # keeps counted storages from being freed and their addresses reused

    def add(self, obj: Any) -> None:
        for t in _tensors(obj):
            try:
                storage = t.untyped_storage()
            except (RuntimeError, NotImplementedError):  # sparse or nested tensors: not counted
                continue
            key = (str(t.device), storage.data_ptr())
            if key not in self.exclude and key not in self.storages:
                self.storages[key] = storage.nbytes()
                self.alive.append(t)


_RECORDER: contextvars.ContextVar[_Recorder | None] = contextvars.ContextVar("_llmopt_ac_recorder", default=None)


def _tensors(obj: Any) -> Iterator[Tensor]:
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)


class _RecordSaved(TorchDispatchMode):
    """Records the outputs that the selective policy saves (they bypass saved-tensor hooks)."""

    def __init__(self, recorder: _Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in SAVE_OPS:
            self.recorder.add(out)
        return out


class _Both(AbstractContextManager):
    def __init__(self, outer: AbstractContextManager, inner: AbstractContextManager) -> None:
        self.outer, self.inner = outer, inner

    def __enter__(self) -> None:
        self.outer.__enter__()
        self.inner.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self.inner.__exit__(*exc)
        self.outer.__exit__(*exc)


def _selective_contexts() -> tuple[AbstractContextManager, AbstractContextManager]:
    forward_ctx, recompute_ctx = create_selective_checkpoint_contexts(selective_policy)
    recorder = _RECORDER.get()
    if recorder is None:
        return forward_ctx, recompute_ctx
    return _Both(forward_ctx, _RecordSaved(recorder)), recompute_ctx


# --------------------------------------------------------------------------- wrapping


def _checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    state: _BlockState = self.__dict__[_STATE_ATTR]
    inner = state.previous_forward or types.MethodType(type(self).forward, self)
    if not state.enabled or not torch.is_grad_enabled():
        return inner(*args, **kwargs)
    recorder = _RECORDER.get()
    if recorder is not None:  # the checkpoint keeps the block's inputs alive for recomputation
        recorder.add(list(args) + list(kwargs.values()))
    if state.policy == "selective":
        return checkpoint(inner, *args, use_reentrant=False, context_fn=_selective_contexts, **kwargs)
    return checkpoint(inner, *args, use_reentrant=False, **kwargs)


def find_blocks(model: nn.Module, blocks: str | nn.Module | None = None) -> list[tuple[str, nn.Module]]:
    """The repeated blocks of ``model`` as ``(name, module)`` in order.

    Arguments:
        model: the model.
        blocks: a container (``ModuleDict``/``ModuleList``/``Sequential``) or its dotted path in ``model``; by
            default the first of :data:`BLOCK_PATHS` that exists.
    """
    container: nn.Module | None
    if isinstance(blocks, nn.Module):
        container = blocks
    elif isinstance(blocks, str):
        container = model.get_submodule(blocks)
    else:
        container = next((_get(model, p) for p in BLOCK_PATHS if _get(model, p) is not None), None)
        if container is None:
            raise ValueError(f"no block container found in {type(model).__name__} at any of {BLOCK_PATHS}; "
                             "pass blocks= (a ModuleList/ModuleDict or its dotted path)")
    if not isinstance(container, (nn.ModuleDict, nn.ModuleList, nn.Sequential)):
        raise ValueError(f"blocks must be a ModuleDict, ModuleList or Sequential, got {type(container).__name__}")
    return [(name, m) for name, m in container.named_children() if m is not None]


def _get(model: nn.Module, path: str) -> nn.Module | None:
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def select_blocks(n_blocks: int, policy: str, every_n: int = 2) -> list[int]:
    """Indices of the blocks that ``policy`` checkpoints among ``n_blocks`` (see the module docstring)."""
    if policy not in POLICIES:
        raise ValueError(f"policy ({policy!r}) must be one of {POLICIES}")
    if isinstance(every_n, bool) or not isinstance(every_n, int) or every_n < 1:
        raise ValueError(f"every_n ({every_n!r}) must be a positive integer")
    if policy == "none" or n_blocks == 0:
        return []
    if policy == "every_n":
        return list(range(0, n_blocks, every_n))
    if policy == "sqrt":
        k = max(1, round(math.sqrt(n_blocks)))
        return [i * n_blocks // k for i in range(k)]
    return list(range(n_blocks))


def apply_activation_checkpointing(model: nn.Module, policy: str = "full", every_n: int = 2,
                                   blocks: str | nn.Module | None = None) -> list[str]:
    """Checkpoint blocks of a finished model in place; returns the names of the wrapped blocks.

    Arguments:
        model: the model (any device, including meta); its parameter names and ``state_dict`` keys do not change.
        policy: one of ``"none"``, ``"full"``, ``"every_n"``, ``"sqrt"``, ``"selective"``.
        every_n: the stride of ``"every_n"`` (a positive integer; validated for every policy).
        blocks: the block container or its dotted path (see :func:`find_blocks`).

    Raises ``ValueError`` for a bad policy or ``every_n`` and ``RuntimeError`` if a block is already checkpointed.
    Inputs and outputs keep their shapes and dtypes; blocks run unchanged when gradients are disabled.
    """
    found = find_blocks(model, blocks)
    chosen = select_blocks(len(found), policy, every_n)
    already = [name for name, block in found if _STATE_ATTR in block.__dict__]
    if already:
        raise RuntimeError(f"activation checkpointing is already applied to blocks {already}; "
                           "call remove_activation_checkpointing(model) first")
    names = []
    for i in chosen:
        name, block = found[i]
        state = _BlockState(policy, block.__dict__.get("forward"))
        block.__dict__[_STATE_ATTR] = state
        block.__dict__["forward"] = types.MethodType(_checkpointed_forward, block)
        names.append(name)
    return names


def _wrapped(model: nn.Module) -> Iterator[tuple[str, nn.Module, _BlockState]]:
    for name, module in model.named_modules():
        state = module.__dict__.get(_STATE_ATTR)
        if isinstance(state, _BlockState):
            yield name, module, state


def checkpointed_blocks(model: nn.Module) -> dict[str, str]:
    """``{module name: policy}`` of every checkpointed block in ``model``."""
    return {name: state.policy for name, _, state in _wrapped(model)}


def remove_activation_checkpointing(model: nn.Module) -> int:
    """Undo :func:`apply_activation_checkpointing`; returns the number of blocks unwrapped."""
    found = list(_wrapped(model))
    for _, module, state in found:
        del module.__dict__[_STATE_ATTR]
        if state.previous_forward is not None:
            module.__dict__["forward"] = state.previous_forward
        else:
            del module.__dict__["forward"]
    return len(found)


@contextmanager
def activation_checkpointing_disabled(model: nn.Module) -> Iterator[None]:
    """Run the checkpointed blocks of ``model`` without checkpointing inside this context."""
    states = [state for _, _, state in _wrapped(model)]
    previous = [s.enabled for s in states]
    for s in states:
        s.enabled = False
    try:
        yield
    finally:
        for s, value in zip(states, previous, strict=True):
            s.enabled = value


def activation_memory(model: nn.Module, batch_fn: Callable[[], Any]) -> int:
    """Bytes of activations kept for backward by one forward pass ``batch_fn()`` (e.g. ``lambda: model(x)``).

    Counts distinct storages (a tensor and its views once) saved through autograd's saved-tensor hooks
    (:class:`torch.autograd.graph.saved_tensors_hooks`), plus the inputs that checkpointed blocks keep and the
    outputs the selective policy saves, minus the storages of ``model``'s parameters and buffers. Works on any
    device. Do not backpropagate through ``batch_fn``'s output; the graph is freed before returning.
    """
    exclude = {(str(t.device), t.untyped_storage().data_ptr())
               for t in [*model.parameters(), *model.buffers()] if not t.is_meta}
    recorder = _Recorder(exclude)

    def pack(t: Tensor) -> None:
        # Returning the tensor itself would make saved outputs reference their own graph (a cycle that outlives
        # this call); the recorder keeps them alive instead, and this graph cannot be backpropagated.
        recorder.add(t)

    def unpack(_: None) -> Tensor:
        raise RuntimeError("activation_memory() graphs are for measurement only; do not call backward on them")

    token = _RECORDER.set(recorder)
    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            out = batch_fn()
        del out
    finally:
        _RECORDER.reset(token)
        recorder.alive.clear()
    return sum(recorder.storages.values())


def recompute_overhead(model: nn.Module, seq_len: int) -> float:
    """Extra forward FLOPs of the checkpointed blocks as a fraction of the model's training FLOPs per token.

    Training FLOPs are ``model.flops_per_token(seq_len)`` when the model has it (our ``Llama``: ``6 N`` plus causal
    attention), else ``6 N``. A fully recomputed block costs ``2 N_block`` plus, for models with a ``config``
    holding ``n_heads`` and ``head_dim``, ``2 H D T`` of attention (a windowed block: the keys its window allows; MLA:
    its q.k and p.v widths); "selective" blocks redo no matmuls and count 0.
    "full" on a deep model gives a little under 1/3 (the embedding and head are not recomputed).
    """
    if seq_len < 1:
        raise ValueError(f"seq_len ({seq_len}) must be positive")
    flops_fn = getattr(model, "flops_per_token", None)
    total = float(flops_fn(seq_len)) if callable(flops_fn) else 6.0 * sum(p.numel() for p in model.parameters())
    config = getattr(model, "config", None)
    heads, head_dim = getattr(config, "n_heads", None), getattr(config, "head_dim", None)
    mla = getattr(config, "mla", None)
    width = (mla.qk_head_dim + mla.v_head_dim) / 2 if mla is not None else head_dim  # per head, q.k and p.v
    extra = 0.0
    for _, block, state in _wrapped(model):
        if state.policy != "selective":
            # the block's own window (layer patterns), else the config's
            window = getattr(getattr(block, "attention", None), "window", getattr(config, "sliding_window", None))
            attn = 4.0 * heads * width * attended_keys(seq_len, window) if heads and width else 0.0
            extra += 2.0 * sum(p.numel() for p in block.parameters()) + attn
    return extra / total if total > 0 else 0.0
