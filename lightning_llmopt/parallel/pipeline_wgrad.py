"""Deferred weight gradients: the B/W backward split of the zero-bubble pipeline schedules without extra FLOPs.

Zero-bubble schedules (Qi et al., arXiv 2401.10241; DualPipe/DualPipeV, DeepSeek-V3, arXiv 2412.19437) split a
stage's backward into B (the gradient of the stage input, on the critical path) and W (weight gradients, placed in
the bubbles). For a linear layer ``Y = X W^T + b`` B needs ``dX = dY W``; W needs ``dW = dY^T X`` and
``db = sum(dY)``, computed from the same ``X`` and ``dY``. Steps:

1. :func:`install_deferred_linear` routes every plain ``nn.Linear`` of a stage module through
   :class:`DeferredLinearFunction` (both in :mod:`~lightning_llmopt.parallel.pipeline_wgrad_linear`, like the
   functions of steps 2-3; re-exported here).
2. B: the stage runs its ordinary full backward under :func:`defer_weight_grads` ``(key)``: every deferred linear
   returns ``dX`` and queues ``(X, dY)`` under ``key``; all other parameters get their gradients at once.
3. W: :func:`run_deferred` ``(key)`` computes the queued ``dW``/``db`` and accumulates them into ``.grad`` as
   autograd's ``AccumulateGrad`` does.
4. :class:`DeferredWeightGradStage` wires 2-3 into ``torch.distributed.pipelining`` through ``PipelineStage``'s
   ``dw_builder``: its ``backward_one_chunk(full_backward=False)`` (action B/I) runs the full backward under the defer
   context of ``(stage, chunk)`` and torch stores the runner that ``backward_weight_one_chunk`` (action W) calls.
   :func:`build_stages` picks it for the zero-bubble schedules and :func:`settle_deferred` runs, with a warning,
   any work the schedule left without a W action, so gradients are never silently incomplete.
"""

from __future__ import annotations

import inspect
import itertools
import warnings
from collections.abc import Hashable
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage

from lightning_llmopt.parallel.pipeline_wgrad_linear import (
    DeferredLinearFunction,
    defer_weight_grads,
    deferred_linear,
    drop_deferred,
    install_deferred_linear,
    pending_keys,
    run_deferred,
    uninstall_deferred_linear,
)

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
                drop_deferred(key)
    if done:
        warnings.warn(
            f"{done} deferred weight-gradient work items had no W action in the schedule; they ran after the step",
            RuntimeWarning,
            stacklevel=2,
        )
    return done
