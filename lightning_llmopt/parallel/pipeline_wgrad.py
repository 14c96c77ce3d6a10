"""Deferred weight gradients: the B/W backward split of the zero-bubble pipeline schedules without extra FLOPs.

Zero-bubble schedules (Qi et al., arXiv 2401.10241; DualPipe/DualPipeV, DeepSeek-V3, arXiv 2412.19437) split a
stage's backward into B (the gradient of the stage input, on the critical path) and W (weight gradients, placed in
the bubbles). For a linear layer ``Y = X W^T + b`` B needs ``dX = dY W``; W needs ``dW = dY^T X`` and
``db = sum(dY)``, computed from the same ``X`` and ``dY``. Steps:

1. :func:`install_deferred_linear` gives every plain ``nn.Linear`` of a stage module an instance ``forward`` that
   calls :class:`DeferredLinearFunction` with the module's own weight and bias (class, ``state_dict`` keys and
   parameter objects unchanged). Outside a defer context it computes the same gradients as ``F.linear``.
2. B: the stage runs its ordinary full backward under :func:`defer_weight_grads` ``(key)``. Every deferred linear
   returns ``dX`` and queues ``(X, dY)`` under ``key`` instead of computing ``dW``/``db``; all other parameters (norms,
   embedding) get their gradients at once, as do linears left on autograd (DTensor/TP weights, shared weights).
3. W: :func:`run_deferred` ``(key)`` computes the queued ``dW``/``db`` and accumulates them into ``.grad`` as
   autograd's ``AccumulateGrad`` does (parameters with gradient hooks go through autograd's engine, so hooks fire).
4. :class:`DeferredWeightGradStage` wires 2-3 into ``torch.distributed.pipelining`` through ``PipelineStage``'s
   ``dw_builder``: its ``backward_one_chunk(full_backward=False)`` (action B/I) runs the full backward under the defer
   context of ``(stage, chunk)`` and torch stores the runner that ``backward_weight_one_chunk`` (action W) calls.
   :func:`build_stages` picks it for the zero-bubble schedules and :func:`settle_deferred` runs, with a warning,
   any work the schedule left without a W action, so gradients are never silently incomplete.

Under autocast the function computes in the autocast dtype as ``F.linear`` does (inputs cast, bf16/fp16 matmuls,
``dX`` returned in ``X``'s dtype, ``dW``/``db`` accumulated in the parameter's dtype). The low-precision weight copy is
shared by the micro-batches in flight (autocast's own cache is not reachable from an ``autograd.Function``).
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import warnings
import weakref
from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable
from torch.distributed.pipelining import PipelineStage

__all__ = [
    "ZERO_BUBBLE",
    "DeferredLinearFunction",
    "DeferredWeightGradStage",
    "build_stages",
    "defer_weight_grads",
    "deferred_linear",
    "deferred_split_support",
    "install_deferred_linear",
    "pending_keys",
    "run_deferred",
    "settle_deferred",
    "uninstall_deferred_linear",
]

ZERO_BUBBLE = ("zero_bubble", "zbv", "dualpipev")  # schedules with separate B (input) and W (weight) actions


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


def _no_autocast(device_type: str) -> contextlib.AbstractContextManager[Any]:
    if torch.amp.is_autocast_available(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


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
        with _no_autocast(x.device.type):
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


# ------------------------------------------------------------------ pipeline stages
def deferred_split_support() -> str | None:
    """``None`` where this torch's ``PipelineStage`` can run the deferred split (a ``dw_builder`` argument, and
    ``backward_one_chunk(bwd_chunk_id, ..., full_backward)`` / ``backward_weight_one_chunk``), else the reason."""
    init = inspect.signature(PipelineStage.__init__).parameters
    if "dw_builder" not in init:
        return f"PipelineStage of torch {torch.__version__} takes no dw_builder"
    backward = getattr(PipelineStage, "backward_one_chunk", None)
    if backward is None or not {"bwd_chunk_id", "full_backward"} <= set(inspect.signature(backward).parameters):
        return f"PipelineStage.backward_one_chunk of torch {torch.__version__} has no bwd_chunk_id/full_backward"
    if not callable(getattr(PipelineStage, "backward_weight_one_chunk", None)):
        return f"PipelineStage of torch {torch.__version__} has no backward_weight_one_chunk"
    return None


_TOKENS = itertools.count()


class DeferredWeightGradStage(PipelineStage):
    """A ``PipelineStage`` whose B action (``backward_one_chunk(..., full_backward=False)``) runs the ordinary full
    backward with the deferred linears' weight gradients queued under ``(stage, chunk)``, and whose W action
    (``backward_weight_one_chunk``) computes them. Full backwards (``full_backward=True``: 1F1B-style actions and
    DualPipeV's overlapped F+B) compute every gradient at once.

    Arguments are those of ``PipelineStage`` except ``dw_builder``, which this class supplies: torch calls it right
    after the B backward of a chunk and keeps the runner it returns for that chunk's W (or runs it at once after a
    full backward, where there is nothing queued).
    """

    def __init__(self, submodule: nn.Module, stage_index: int, num_stages: int, device: torch.device, **kwargs: Any):
        reason = deferred_split_support()
        if reason is not None:
            raise NotImplementedError(f"deferred weight gradients: {reason}")
        if "dw_builder" in kwargs:
            raise TypeError("DeferredWeightGradStage supplies dw_builder itself")
        self._token = next(_TOKENS)
        self._chunk: int | None = None
        self.deferred_items = 0  # weight-gradient work items run by W actions (a statistic)
        super().__init__(submodule, stage_index, num_stages, device, dw_builder=self._dw_runner, **kwargs)
        self._backward_signature = inspect.signature(super().backward_one_chunk)

    def _key(self, chunk: int | None) -> tuple[str, int, int | None]:
        return ("pipeline-stage", self._token, chunk)

    def _dw_runner(self) -> Any:
        return partial(self._run_chunk, self._key(self._chunk))

    def _run_chunk(self, key: Hashable) -> None:
        self.deferred_items += run_deferred(key)

    def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        call = self._backward_signature.bind(*args, **kwargs)
        call.apply_defaults()
        self._chunk = int(call.arguments["bwd_chunk_id"])
        try:
            if call.arguments["full_backward"]:
                return super().backward_one_chunk(*args, **kwargs)
            with defer_weight_grads(self._key(self._chunk)):
                return super().backward_one_chunk(*args, **kwargs)
        finally:
            self._chunk = None

    def owned_keys(self) -> list[Hashable]:
        """Keys of this stage's queued work (chunks whose W has not run)."""
        return [k for k in pending_keys() if isinstance(k, tuple) and k[:2] == ("pipeline-stage", self._token)]


def _unsupported_wrapper(module: nn.Module) -> str | None:
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    for m in module.modules():
        if isinstance(m, (FSDPModule, DistributedDataParallel)):
            return f"the stage module holds {type(m).__name__} (FSDP2/DDP synchronise gradients in autograd hooks)"
    return None


def build_stages(
    modules: dict[int, nn.Module], num_stages: int, device: torch.device, group: Any, schedule: str, split: str
) -> list[PipelineStage]:
    """This rank's stages (by index) for ``schedule``: :class:`DeferredWeightGradStage` for the zero-bubble schedules
    with ``split == "deferred"`` (deferred linears installed), else torch's ``PipelineStage`` (its own split,
    ``stage_backward_input`` + ``stage_backward_weight``); the fallback where deferral is unavailable warns."""
    cls: type[PipelineStage] = PipelineStage
    if schedule in ZERO_BUBBLE and split == "deferred":
        reason = deferred_split_support() or next(filter(None, map(_unsupported_wrapper, modules.values())), None)
        if reason is not None:
            warnings.warn(
                f"{schedule}: torch's B/W split (slow) instead of deferred weight gradients: {reason}", stacklevel=3
            )
        else:
            cls = DeferredWeightGradStage
            if not any([install_deferred_linear(m) for m in modules.values()]):
                warnings.warn(
                    f"{schedule}: no nn.Linear of this rank's stages can defer its weight gradient (DTensor/TP or "
                    "tied weights); B computes every gradient and W does nothing",
                    stacklevel=3,
                )
    return [cls(mod, s, num_stages, device, group=group) for s, mod in sorted(modules.items())]


def settle_deferred(stages: list[Any], run: bool = True) -> int:
    """After a schedule step: run (``run=True``, with a warning) or drop (a failed step) weight-gradient work that no
    W action ran, so gradients are complete; returns the number of work items run."""
    done = 0
    for stage in stages:
        if not isinstance(stage, DeferredWeightGradStage):
            continue
        for key in stage.owned_keys():
            if run:
                done += run_deferred(key)
            else:
                _QUEUED.pop(key, None)
    if done:
        warnings.warn(
            f"{done} deferred weight-gradient work items had no W action in the schedule; they ran after the step",
            RuntimeWarning,
            stacklevel=2,
        )
    return done
