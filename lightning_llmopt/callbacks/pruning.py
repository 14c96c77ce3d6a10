"""``Pruning``: gradual magnitude pruning during training, then fine-tuning with the mask fixed.

A thin adapter over :mod:`lightning_llmopt.compression.masks`. From ``start_step`` to ``end_step`` the target
sparsity follows Zhu & Gupta's cubic schedule (:func:`~lightning_llmopt.compression.cubic_sparsity`); every
``frequency`` steps on that interval the masks are recomputed from the current weight magnitudes (per layer or
globally; or 2:4 once, at ``start_step``). The masks are applied in place before every training batch and after
it (so the optimizer step cannot revive a dropped weight, and validation and checkpoints see the sparse weights).
After ``end_step`` the masks stay fixed and training continues: that is the fine-tuning phase.

Layers stay ``nn.Linear`` with their Parameters, so optimizers, ZeRO stages 1/2 (replicated parameters: every
rank computes the same masks) and checkpoints are unaffected. Sharded (DTensor) parameters are refused.
The masks are saved in the callback state, so a resumed run keeps them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn
from typing_extensions import override

from lightning_llmopt.compression.masks import (
    DEFAULT_SKIP,
    apply_masks,
    cubic_sparsity,
    magnitude_masks,
    parse_pattern,
)


class Pruning(L.Callback):
    """Prunes the module's ``model`` by magnitude on a schedule and keeps it sparse while fine-tuning.

    Arguments:
        sparsity: final fraction of dropped weights (``pattern="2:4"``: 50% by construction).
        scope: ``"layer"`` (each layer at the target) or ``"global"`` (one magnitude threshold).
        pattern: ``"unstructured"`` or ``"N:M"`` (``"2:4"``).
        start_step: global step of the first pruning.
        end_step: global step at which ``sparsity`` is reached (default ``start_step``: one shot).
        frequency: steps between mask updates on ``[start_step, end_step]``.
        initial_sparsity: sparsity at ``start_step``.
        skip: ``fnmatch`` patterns of layer names (inside the model) left dense.
    """

    def __init__(
        self,
        sparsity: float = 0.5,
        scope: str = "layer",
        pattern: str = "unstructured",
        start_step: int = 0,
        end_step: int | None = None,
        frequency: int = 10,
        initial_sparsity: float = 0.0,
        skip: Sequence[str] = DEFAULT_SKIP,
    ) -> None:
        end_step = start_step if end_step is None else end_step
        if not 0.0 <= initial_sparsity <= sparsity < 1.0:
            raise ValueError(f"need 0 <= initial_sparsity ({initial_sparsity}) <= sparsity ({sparsity}) < 1")
        if start_step < 0 or end_step < start_step:
            raise ValueError(f"need 0 <= start_step ({start_step}) <= end_step ({end_step})")
        if frequency < 1:
            raise ValueError(f"frequency ({frequency}) must be >= 1")
        if scope not in ("layer", "global"):
            raise ValueError(f"scope ({scope!r}) must be 'layer' or 'global'")
        if pattern != "unstructured":
            parse_pattern(pattern)
        self.sparsity, self.scope, self.pattern = sparsity, scope, pattern
        self.start_step, self.end_step, self.frequency = start_step, end_step, frequency
        self.initial_sparsity, self.skip = initial_sparsity, tuple(skip)
        self.masks: dict[str, Tensor] = {}
        self.current_sparsity = 0.0
        self.last_update: int | None = None

    @staticmethod
    def _target(pl_module: L.LightningModule) -> nn.Module:
        model = getattr(pl_module, "model", None)
        return model if isinstance(model, nn.Module) else pl_module

    def target_sparsity(self, step: int) -> float:
        """The schedule's sparsity at ``step`` (0 before ``start_step``)."""
        if step < self.start_step:
            return 0.0
        return cubic_sparsity(step, self.sparsity, self.start_step, self.end_step, self.initial_sparsity)

    def _due(self, step: int) -> bool:
        if step < self.start_step or (self.last_update is not None and self.last_update >= self.end_step):
            return False
        if self.pattern != "unstructured":
            return self.last_update is None
        return self.last_update is None or step >= self.end_step or (step - self.start_step) % self.frequency == 0

    @torch.no_grad()
    def _update(self, model: nn.Module, step: int) -> None:
        if any(type(p).__name__ == "DTensor" for p in model.parameters()):
            raise NotImplementedError("Pruning supports replicated parameters (DDP, ZeRO 1/2), not DTensor shards")
        target = self.target_sparsity(step)
        self.masks = {k: v for k, v in magnitude_masks(model, target, self.scope, self.pattern, self.skip).items()}
        self.current_sparsity = (
            target
            if self.pattern == "unstructured"
            else 1 - parse_pattern(self.pattern)[0] / parse_pattern(self.pattern)[1]
        )
        self.last_update = step
        if step >= self.end_step:
            rank_zero_info(
                f"Pruning: {len(self.masks)} layers at sparsity {self.current_sparsity:.3f} from step "
                f"{step}; fine-tuning with fixed masks"
            )

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        model = self._target(pl_module)
        if self._due(trainer.global_step):
            self._update(model, trainer.global_step)
        if self.masks:
            apply_masks(model, self.masks)
            pl_module.log("pruning/sparsity", self.current_sparsity)

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.masks:
            apply_masks(self._target(pl_module), self.masks)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "sparsity": self.sparsity,
            "scope": self.scope,
            "pattern": self.pattern,
            "start_step": self.start_step,
            "end_step": self.end_step,
            "current_sparsity": self.current_sparsity,
            "last_update": self.last_update,
            "masks": {k: v.cpu() for k, v in self.masks.items()},
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.masks = dict(state_dict.get("masks", {}))
        self.current_sparsity = float(state_dict.get("current_sparsity", 0.0))
        self.last_update = state_dict.get("last_update")


__all__ = ["Pruning"]
