"""Dynamic loss scaling for fp16 training, framework-free and shard-aware.

Mixed-precision training (Micikevicius et al., arXiv 1710.03740, section 3.2) multiplies the loss by a scale S so
small fp16 gradients do not flush to zero, then divides the gradients by S before the update. The dynamic rule:

1. ``scale(loss)`` returns ``loss * S``; backward gives ``S * g``.
2. ``unscale_and_check(...)`` multiplies every gradient (or every ZeRO shard) by ``1 / S`` and decides, with one
   all-reduce across all shards, whether any gradient is inf/NaN.
3. If one is, the optimizer step is skipped on every rank and ``S *= backoff_factor``; otherwise the step runs and
   after ``growth_interval`` consecutive clean steps ``S *= growth_factor``.
4. ``max_consecutive_skips`` skips in a row raise :class:`LossScaleError` (the run diverged; scaling cannot help).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_llmopt.parallel.zero import ZeroOptimizer

__all__ = ["DynamicLossScaler", "LossScaleError"]


class LossScaleError(RuntimeError):
    """Too many consecutive steps had non-finite gradients."""


class DynamicLossScaler:
    """Dynamic loss scaler.

    Arguments:
        init_scale: initial scale S.
        growth_factor: multiplier (> 1) applied after ``growth_interval`` clean steps in a row.
        backoff_factor: multiplier in (0, 1) applied after a step with non-finite gradients.
        growth_interval: clean steps between growths (>= 1).
        max_consecutive_skips: raise :class:`LossScaleError` after this many skipped steps in a row
            (``None``: never).
        min_scale: the scale never drops below this.
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, max_consecutive_skips: int | None = 20, min_scale: float = 1.0) -> None:
        if not init_scale > 0:
            raise ValueError(f"init_scale ({init_scale}) must be > 0")
        if not growth_factor > 1:
            raise ValueError(f"growth_factor ({growth_factor}) must be > 1")
        if not 0 < backoff_factor < 1:
            raise ValueError(f"backoff_factor ({backoff_factor}) must be in (0, 1)")
        if growth_interval < 1:
            raise ValueError(f"growth_interval ({growth_interval}) must be >= 1")
        if max_consecutive_skips is not None and max_consecutive_skips < 1:
            raise ValueError(f"max_consecutive_skips ({max_consecutive_skips}) must be >= 1 or None")
        self.scale_value = float(init_scale)
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval, self.max_consecutive_skips = growth_interval, max_consecutive_skips
        self.min_scale = float(min_scale)
        self.skipped_steps = 0
        self.consecutive_skips = 0
        self.clean_steps = 0  # clean steps since the last growth or skip

    def scale(self, loss: Tensor) -> Tensor:
        """``loss * S`` (backward of this gives scaled gradients)."""
        return loss * self.scale_value

    @torch.no_grad()
    def unscale_and_check(self, grads: ZeroOptimizer | Sequence[Tensor | None], process_group: Any = None) -> bool:
        """Divide the gradients by S; return ``found_inf``: whether any gradient on any rank is non-finite.

        Arguments:
            grads: a :class:`ZeroOptimizer` (its reduced shards are unscaled and checked, one all-reduce over its
                group), or a list of gradient tensors (``None`` entries skipped), checked across ``process_group``
                (default group when ``torch.distributed`` is initialised; one all-reduce).
            process_group: group for the list form; ignored for a ``ZeroOptimizer``.
        """
        inv = 1.0 / self.scale_value
        if isinstance(grads, ZeroOptimizer):
            grads.scale_grads_(inv)
            return not grads.grads_finite()
        tensors = [g for g in grads if g is not None]
        bad = torch.zeros((), dtype=torch.float32, device=tensors[0].device if tensors else "cpu")
        for g in tensors:
            g.mul_(inv)
            bad += (~torch.isfinite(g)).any().float()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(bad, op=dist.ReduceOp.SUM, group=process_group)
        return bool(bad.item() > 0)

    def update(self, found_inf: bool) -> None:
        """Back off and count a skip after non-finite gradients, else count a clean step and maybe grow."""
        if found_inf:
            self.skipped_steps += 1
            self.consecutive_skips += 1
            self.clean_steps = 0
            self.scale_value = max(self.scale_value * self.backoff_factor, self.min_scale)
            if self.max_consecutive_skips is not None and self.consecutive_skips >= self.max_consecutive_skips:
                raise LossScaleError(
                    f"{self.consecutive_skips} consecutive steps had non-finite gradients (max_consecutive_skips="
                    f"{self.max_consecutive_skips}); loss scale is now {self.scale_value:g}: the run has diverged"
                )
            return
        self.consecutive_skips = 0
        self.clean_steps += 1
        if self.clean_steps >= self.growth_interval:
            self.scale_value *= self.growth_factor
            self.clean_steps = 0

    def step(self, optimizer: ZeroOptimizer) -> bool:
        """Unscale and check ``optimizer``'s gradients, step it if they are finite, update the scale.

        Returns whether the step ran. Gradients are left for the caller's ``zero_grad()``.
        """
        found_inf = self.unscale_and_check(optimizer)
        if not found_inf:
            optimizer.step()
        self.update(found_inf)
        return not found_inf

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale_value, "skipped_steps": self.skipped_steps,
                "consecutive_skips": self.consecutive_skips, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale_value = float(state["scale"])
        self.skipped_steps = int(state["skipped_steps"])
        self.consecutive_skips = int(state["consecutive_skips"])
        self.clean_steps = int(state["clean_steps"])
