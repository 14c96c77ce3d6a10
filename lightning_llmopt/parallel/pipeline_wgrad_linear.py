"""Deferred linear weight gradients: the store, the ``autograd.Function`` and its installation on ``nn.Linear``.

The core of the zero-bubble B/W backward split without extra FLOPs, free of ``torch.distributed``
(:mod:`~lightning_llmopt.parallel.pipeline_wgrad` wires it into ``torch.distributed.pipelining`` stages). For a linear
layer ``Y = X W^T + b`` B needs ``dX = dY W``; W needs ``dW = dY^T X`` and ``db = sum(dY)``, computed from the same
``X`` and ``dY``. Steps:

1. :func:`install_deferred_linear` gives every plain ``nn.Linear`` of a stage module an instance ``forward`` that
   calls :class:`DeferredLinearFunction` with the module's own weight and bias (class, ``state_dict`` keys and
   parameter objects unchanged). Outside a defer context it computes the same gradients as ``F.linear``.
2. B: the stage runs its ordinary full backward under :func:`defer_weight_grads` ``(key)``. Every deferred linear
   returns ``dX`` and queues ``(X, dY)`` under ``key`` instead of computing ``dW``/``db``; all other parameters (norms,
   embedding) get their gradients at once, as do linears left on autograd (DTensor/TP weights, shared weights).
3. W: :func:`run_deferred` ``(key)`` computes the queued ``dW``/``db`` and accumulates them into ``.grad`` as
   autograd's ``AccumulateGrad`` does (parameters with gradient hooks go through autograd's engine, so hooks fire);
   :func:`drop_deferred` ``(key)`` forgets them instead.

Under autocast the function computes in the autocast dtype as ``F.linear`` does (inputs cast, bf16/fp16 matmuls,
``dX`` returned in ``X``'s dtype, ``dW``/``db`` accumulated in the parameter's dtype). The low-precision weight copy is
shared by the micro-batches in flight (autocast's own cache is not reachable from an ``autograd.Function``).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

__all__ = [
    "DeferredLinearFunction",
    "defer_weight_grads",
    "deferred_linear",
    "drop_deferred",
    "install_deferred_linear",
    "pending_keys",
    "run_deferred",
    "uninstall_deferred_linear",
]


# ------------------------------------------------------------------ the store
@dataclass
class _Work:
    """One linear's weight-gradient work for one chunk: ``x`` ``(N, in)``, ``grad_out`` ``(N, out)`` in the compute
    dtype; ``weight`` ``(out, in)`` / ``bias`` ``(out,)`` the parameters to accumulate into (``None``: not needed)."""

    x: Tensor
    grad_out: Tensor
    weight: Tensor | None
    bias: Tensor | None
    versions: tuple[int, int]


_ACTIVE: list[Hashable] = []  # defer-context keys, innermost last (a plain list: backward may run on another thread)
_QUEUED: dict[Hashable, list[_Work]] = {}


@contextlib.contextmanager
def defer_weight_grads(key: Hashable) -> Iterator[None]:
    """Within this context, backward through deferred linears queues their weight gradients under ``key``."""
    _ACTIVE.append(key)
    try:
        yield
    finally:
        _ACTIVE.pop()


def pending_keys() -> list[Hashable]:
    """Keys with queued work."""
    return [k for k, v in _QUEUED.items() if v]


def run_deferred(key: Hashable) -> int:
    """Compute and accumulate the weight gradients queued under ``key`` (then forget them); returns the count."""
    work = _QUEUED.pop(key, [])
    for item in work:
        _run(item)
    return len(work)


def drop_deferred(key: Hashable) -> None:
    """Forget the weight gradients queued under ``key`` without computing them (after a failed step)."""
    _QUEUED.pop(key, None)


def _run(item: _Work) -> None:
    if (item.x._version, item.grad_out._version) != item.versions:
        raise RuntimeError(
            "a tensor saved for a deferred weight gradient was modified in place between the B and W passes "
            f"(versions {item.versions} -> {(item.x._version, item.grad_out._version)})"
        )
    grad_w, grad_b = _weight_grads(item.x, item.grad_out, item.weight is not None, item.bias is not None)
    if item.weight is not None and grad_w is not None:
        _accumulate(item.weight, grad_w)
    if item.bias is not None and grad_b is not None:
        _accumulate(item.bias, grad_b)


_NULL = contextlib.nullcontext()


def _no_autocast(device_type: str) -> contextlib.AbstractContextManager[Any]:
    """Autocast off for ``device_type``; the shared null context when it is not on (CUDA backward passes run on
    autograd's device threads, where it never is): entering ``torch.autocast`` costs microseconds of host time."""
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return _NULL


def _weight_grads(x: Tensor, grad_out: Tensor, need_w: bool, need_b: bool) -> tuple[Tensor | None, Tensor | None]:
    """``dW = dY^T X`` ``(out, in)`` and ``db = sum_N dY`` ``(out,)`` in the compute dtype of ``x`` ``(N, in)``,
    ``grad_out`` ``(N, out)`` (the products autograd computes for ``F.linear``)."""
    with torch.no_grad(), _no_autocast(x.device.type):
        grad_w = torch.mm(grad_out.t(), x) if need_w else None
        grad_b = grad_out.sum(0) if need_b else None
    return grad_w, grad_b


_MISSING = object()


def _has_grad_hooks(param: Tensor) -> bool:
    """Whether autograd would run hooks around ``param``'s gradient accumulation (unknown counts as yes)."""
    pre = getattr(param, "_backward_hooks", _MISSING)
    post = getattr(param, "_post_accumulate_grad_hooks", _MISSING)
    return pre is _MISSING or post is _MISSING or bool(pre) or bool(post)


def _accumulate(param: Tensor, grad: Tensor) -> None:
    """``param.grad += grad`` with ``AccumulateGrad``'s semantics: the parameter's dtype and layout, a new ``.grad``
    when it is ``None``; parameters with gradient hooks (e.g. the ZeRO-1/2 engine's) go through autograd itself."""
    grad = grad.to(param.dtype)
    if _has_grad_hooks(param):
        torch.autograd.backward([param], [grad])
        return
    with torch.no_grad():
        if param.grad is None:
            param.grad = grad if grad.stride() == param.stride() else torch.empty_like(param).copy_(grad)
        else:
            param.grad.add_(grad)


# ------------------------------------------------------------------ the function
def _autocast_dtype(x: Tensor) -> torch.dtype | None:
    device_type = x.device.type
    if not torch.amp.is_autocast_available(device_type) or not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def _casts(t: Tensor, dtype: torch.dtype | None) -> bool:
    """Whether autocast to ``dtype`` casts ``t`` for a lower-precision op (floating, not fp64, another dtype)."""
    return dtype is not None and t.is_floating_point() and t.dtype not in (dtype, torch.float64)


class _CastCache:
    """Low-precision copies of parameters, shared while any micro-batch in flight holds one (weak references:
    a copy dies with the last backward that saved it). Checked against the parameter's storage and version."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[Any, int, int, torch.dtype, Any]] = {}

    def get(self, param: Tensor, dtype: torch.dtype | None) -> Tensor:
        if dtype is None or not _casts(param, dtype):
            return param.detach()
        key = id(param)
        entry = self._entries.get(key)
        if entry is not None:
            owner, ptr, version, cast_dtype, ref = entry
            cast = ref()
            same = (ptr, version, cast_dtype) == (param.data_ptr(), param._version, dtype)
            if cast is not None and same and owner() is param:
                return cast
        cast = param.detach().to(dtype)
        ref = weakref.ref(cast, partial(self._drop, key))
        self._entries[key] = (weakref.ref(param), param.data_ptr(), param._version, dtype, ref)
        return cast

    def _drop(self, key: int, ref: Any) -> None:
        entry = self._entries.get(key)
        if entry is not None and entry[4] is ref:
            del self._entries[key]


_CASTS = _CastCache()


class DeferredLinearFunction(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` whose backward computes ``dX`` and either accumulates ``dW``/``db`` through
    autograd (no defer context) or queues them under the innermost :func:`defer_weight_grads` key.

    Shapes: ``x`` ``(..., in)``, ``weight`` ``(out, in)`` (a leaf parameter), ``bias`` ``(out,)`` or ``None``; returns
    ``(..., out)``. Under autocast: computed in the autocast dtype (as ``F.linear``), ``dX`` in ``x``'s dtype.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        dtype = _autocast_dtype(x)
        xc, wc = x.to(dtype) if dtype is not None and _casts(x, dtype) else x, _CASTS.get(weight, dtype)
        bc = None if bias is None else _CASTS.get(bias, dtype)
        # inputs already in autocast's dtype (or ones it leaves alone): F.linear under autocast casts nothing more
        out = F.linear(xc, wc, bc)
        ctx.save_for_backward(xc, wc)
        ctx.targets = (weight, bias)  # the parameters themselves (saved tensors may come back as detached aliases)
        ctx.x_dtype = x.dtype
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        xc, wc = ctx.saved_tensors
        weight, bias = ctx.targets
        grad_x = grad_w = grad_b = None
        grad_out = grad_out.to(wc.dtype)
        if ctx.needs_input_grad[0]:
            with _no_autocast(grad_out.device.type):
                grad_x = torch.matmul(grad_out, wc).to(ctx.x_dtype)  # (..., in)
        need_w, need_b = ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2]
        if need_w or need_b:
            x2 = xc.reshape(-1, xc.shape[-1])  # (N, in)
            g2 = grad_out.reshape(-1, grad_out.shape[-1])  # (N, out)
            if _ACTIVE:
                work = _Work(x2, g2, weight if need_w else None, bias if need_b else None, (x2._version, g2._version))
                _QUEUED.setdefault(_ACTIVE[-1], []).append(work)
            else:
                grad_w, grad_b = _weight_grads(x2, g2, need_w, need_b)
        return grad_x, grad_w, grad_b


def _plain(t: Tensor | None) -> bool:
    """A plain tensor or parameter (not a DTensor or another subclass: those stay on autograd)."""
    return t is None or type(t) in (Tensor, nn.Parameter)


def _deferrable(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    return (
        torch.is_grad_enabled()
        and weight.requires_grad
        and weight.is_leaf
        and (bias is None or bias.is_leaf)
        and weight.is_floating_point()
        and _plain(x)
        and _plain(weight)
        and _plain(bias)
        and not torch.compiler.is_compiling()
    )


def deferred_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear`` with deferrable weight gradients where that is safe (grad mode, a leaf plain-tensor weight, not
    being compiled), else ``F.linear`` itself. ``x`` ``(..., in)``, ``weight`` ``(out, in)`` -> ``(..., out)``."""
    if _deferrable(x, weight, bias):
        out: Tensor = DeferredLinearFunction.apply(x, weight, bias)
        return out
    return F.linear(x, weight, bias)


# ------------------------------------------------------------------ installing on modules
class _DeferredForward:
    """The instance ``forward`` of a deferred ``nn.Linear`` (reads the module's current weight and bias)."""

    def __init__(self, module: nn.Linear) -> None:
        self.module = module

    def __call__(self, input: Tensor) -> Tensor:
        return deferred_linear(input, self.module.weight, self.module.bias)


def install_deferred_linear(module: nn.Module) -> list[str]:
    """Give every plain ``nn.Linear`` in ``module`` the deferred forward, in place; returns the names deferred.

    Skipped (left on autograd): subclasses overriding ``forward``, modules with an instance ``forward`` of their own,
    DTensor (TP/FSDP) or other tensor-subclass weights, and weights registered more than once in ``module`` (tied).
    Module classes, ``state_dict`` keys and parameter objects are unchanged; :func:`uninstall_deferred_linear` undoes.
    """
    counts: dict[int, int] = {}
    for _, p in module.named_parameters(remove_duplicate=False):
        counts[id(p)] = counts.get(id(p), 0) + 1
    names = []
    for name, m in module.named_modules():
        if not isinstance(m, nn.Linear) or type(m).forward is not nn.Linear.forward:
            continue
        current = m.__dict__.get("forward")
        if isinstance(current, _DeferredForward):
            names.append(name)
            continue
        params = [p for p in (m.weight, m.bias) if p is not None]
        if current is not None or not all(_plain(p) for p in params) or any(counts.get(id(p), 0) > 1 for p in params):
            continue
        m.forward = _DeferredForward(m)  # type: ignore[method-assign]
        names.append(name)
    return names


def uninstall_deferred_linear(module: nn.Module) -> None:
    """Remove what :func:`install_deferred_linear` installed."""
    for m in module.modules():
        if isinstance(m.__dict__.get("forward"), _DeferredForward):
            del m.forward
