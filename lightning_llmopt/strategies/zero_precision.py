"""Precision plugin of :class:`~lightning_llmopt.strategies.ZeroStrategy`: autocast, dynamic loss scaling, stepping.

Lightning's own ``MixedPrecision`` unscales ``param.grad`` through ``torch.amp.GradScaler``; under ZeRO-2 the reduced
gradients live in shards, not in ``param.grad``. This plugin keeps parameters and master weights in fp32, runs the
forward under ``torch.autocast`` (``bf16-mixed``, ``16-mixed``) and, for ``16-mixed``, uses the framework-free
:class:`~lightning_llmopt.parallel.loss_scaler.DynamicLossScaler`: one all-reduce decides whether any shard on any
rank is non-finite (:meth:`ZeroOptimizer.grads_finite`); such steps are skipped on every rank, the scale backs off,
and ``zero/skipped_steps`` and ``zero/loss_scale`` are logged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import Precision
from torch import Tensor
from typing_extensions import override

from lightning_llmopt.parallel.loss_scaler import DynamicLossScaler
from lightning_llmopt.parallel.zero import ZeroOptimizer

SUPPORTED_PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")
_AUTOCAST_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


class ZeroPrecision(Precision):
    """fp32 parameters and master weights, autocast compute, dynamic loss scaling for fp16.

    Arguments:
        precision: ``"32-true"``, ``"bf16-mixed"`` or ``"16-mixed"``.
        device: ``torch.autocast`` device type (``"cuda"`` or ``"cpu"``); fp16 autocast works on the CPU too.
        scaler: the loss scaler for ``16-mixed`` (default: ``DynamicLossScaler()``); must be ``None`` otherwise.
    """

    def __init__(self, precision: str = "32-true", device: str = "cuda",
                 scaler: DynamicLossScaler | None = None) -> None:
        if precision not in SUPPORTED_PRECISIONS:
            raise ValueError(f"ZeroStrategy supports precision {SUPPORTED_PRECISIONS}, got {precision!r}")
        if scaler is not None and precision != "16-mixed":
            raise ValueError(f"a loss scaler is only used with precision '16-mixed', got {precision!r}")
        self.precision = precision  # type: ignore[assignment]
        self.device = device
        self.scaler = scaler if scaler is not None or precision != "16-mixed" else DynamicLossScaler()

    @contextlib.contextmanager
    @override
    def forward_context(self) -> Generator[None, None, None]:
        dtype = _AUTOCAST_DTYPES.get(self.precision)
        if dtype is None:
            yield
            return
        with torch.autocast(self.device, dtype=dtype):
            yield

    @override
    def pre_backward(self, tensor: Tensor, module: pl.LightningModule) -> Tensor:  # type: ignore[override]
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        return super().pre_backward(tensor, module)

    @override
    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any],  # type: ignore[override]
                       **kwargs: Any) -> Any:
        """Run the closure (forward + backward), unscale/check, hooks and clipping, then step unless non-finite."""
        closure_result = closure()
        if isinstance(optimizer, ZeroOptimizer):
            optimizer.synchronize()  # hooks and clipping see the reduced gradients
        found_inf = False
        if self.scaler is not None:
            found_inf = self.scaler.unscale_and_check(optimizer if isinstance(optimizer, ZeroOptimizer)
                                                      else _local_grads(optimizer))
        if isinstance(model, pl.LightningModule):
            self._after_closure(model, optimizer)
        skipped_backward = closure_result is None and isinstance(model, pl.LightningModule) \
            and model.automatic_optimization
        if not found_inf and not skipped_backward:
            optimizer.step(**kwargs)
        if self.scaler is not None and not skipped_backward:
            self.scaler.update(found_inf)  # raises LossScaleError after max_consecutive_skips skips in a row
            if isinstance(model, pl.LightningModule) and model._trainer is not None:
                model.log("zero/skipped_steps", float(self.scaler.skipped_steps), on_step=True, on_epoch=False)
                model.log("zero/loss_scale", float(self.scaler.scale_value), on_step=True, on_epoch=False)
        return closure_result

    @override
    def clip_grad_by_norm(self, optimizer: Any, clip_val: int | float) -> None:
        if isinstance(optimizer, ZeroOptimizer):
            optimizer.clip_grad_norm_(float(clip_val))  # global norm over all shards, one all-reduce
            return
        super().clip_grad_by_norm(optimizer, clip_val)

    @override
    def clip_grad_by_value(self, optimizer: Any, clip_val: int | float) -> None:
        if isinstance(optimizer, ZeroOptimizer):
            optimizer.synchronize()
            for group in optimizer.param_groups:
                for shard in group["params"]:
                    if shard.grad is not None:
                        shard.grad.clamp_(-clip_val, clip_val)
            for b in optimizer.buckets:  # stage 1 keeps the full averaged gradient in param.grad too
                if b.flat_grad is not None and optimizer.stage == 1:
                    b.flat_grad.clamp_(-clip_val, clip_val)
            return
        super().clip_grad_by_value(optimizer, clip_val)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {}  # the strategy saves the scaler as the checkpoint's "loss_scaler" entry


def _local_grads(optimizer: torch.optim.Optimizer) -> list[Tensor | None]:
    from lightning_llmopt.parallel.zero_fsdp import local

    return [local(p.grad) if p.grad is not None else None for g in optimizer.param_groups for p in g["params"]]
