"""``ActivationCheckpointing``: applies :mod:`lightning_llmopt.parallel.activation_checkpointing` inside a Trainer.

When it is applied. ``Trainer._run`` calls, in order: ``setup`` (callbacks, then the module), ``configure_model``
(where :class:`~lightning_llmopt.CausalLMModule` builds its model, on the meta device for sharded strategies),
the checkpoint restore of modules and callbacks, ``strategy.setup`` (DDP/FSDP wrapping, device move, optimizers)
and only then ``on_fit_start``. ``on_fit_start`` is therefore too late (the convention is AC before FSDP/compile),
and ``setup`` is too early when the model is built in ``configure_model``. So in ``setup`` the callback applies AC
at once if the module's model already exists, and otherwise replaces the module's ``configure_model`` for this run
by one that calls the original and then applies AC, i.e. right after the model exists and before the strategy wraps
it. With ``ModelParallelStrategy``, where the user's ``configure_model`` itself applies FSDP2/TP, call
:func:`~lightning_llmopt.parallel.activation_checkpointing.apply_activation_checkpointing` there instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning as L
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn
from typing_extensions import override

from lightning_llmopt.parallel.activation_checkpointing import (
    activation_checkpointing_disabled,
    activation_memory,
    apply_activation_checkpointing,
    checkpointed_blocks,
    find_blocks,
    recompute_overhead,
    select_blocks,
)


def default_forward(pl_module: L.LightningModule, batch: Any) -> Any:
    """Forward of the module on a batch: ``input_ids`` (+ ``positions``/``doc_ids``) of a dict, else ``batch[0]``."""
    if isinstance(batch, dict):
        extra = {k: batch[k] for k in ("positions", "doc_ids") if k in batch}
        return pl_module(batch["input_ids"], **extra)
    return pl_module(batch[0] if isinstance(batch, (list, tuple)) else batch)


def _first_row(batch: Any) -> Any:
    if isinstance(batch, Tensor):
        return batch[:1]
    if isinstance(batch, dict):
        return {k: _first_row(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_first_row(v) for v in batch)
    return batch


def _batch_shape(batch: Any) -> tuple[int, int]:
    ids = batch["input_ids"] if isinstance(batch, dict) else batch[0] if isinstance(batch, (list, tuple)) else batch
    return int(ids.shape[0]), int(ids.shape[-1])


class ActivationCheckpointing(L.Callback):
    """Checkpoints the transformer blocks of the module's model before the strategy wraps it.

    Metrics logged once, at the first training batch (``report=True``): ``ac/recompute_overhead`` (extra forward
    FLOPs over training FLOPs, see :func:`recompute_overhead`) and, on single-device and DDP strategies,
    ``ac/saved_activation_bytes`` and ``ac/saved_activation_bytes_no_ac``: bytes kept for backward by one forward
    with and without checkpointing, measured on the first row of the batch and multiplied by the micro-batch size
    (activations are linear in it), so the extra forward costs little memory.

    Arguments:
        policy: ``"full"``, ``"every_n"``, ``"sqrt"``, ``"selective"`` or ``"none"``.
        every_n: stride of ``"every_n"``.
        report: whether to measure and log the metrics above.
        blocks: the block container or its dotted path inside the model (default: found, e.g. ``layers``).
        forward_fn: ``(pl_module, batch) -> output`` used for the measurement (default :func:`default_forward`).
    """

    def __init__(self, policy: str = "full", every_n: int = 2, report: bool = True,
                 blocks: str | None = None, forward_fn: Callable[[L.LightningModule, Any], Any] | None = None) -> None:
        select_blocks(1, policy, every_n)  # validates both
        self.policy = policy
        self.every_n = every_n
        self.report = report
        self.blocks = blocks
        self.forward_fn = forward_fn or default_forward
        self.applied: list[str] = []
        self.metrics: dict[str, float] = {}
        self._reported = False

    # ------------------------------------------------------------------ applying
    @staticmethod
    def _target(pl_module: L.LightningModule) -> nn.Module | None:
        model = getattr(pl_module, "model", None)
        return model if isinstance(model, nn.Module) else pl_module

    def _has_blocks(self, model: nn.Module | None) -> bool:
        if model is None:
            return False
        try:
            return len(find_blocks(model, self.blocks)) > 0
        except (ValueError, AttributeError):
            return False

    def _apply(self, pl_module: L.LightningModule) -> None:
        model = self._target(pl_module)
        assert model is not None
        existing = checkpointed_blocks(model)
        if existing:  # a second fit with the same module: already wrapped
            if set(existing.values()) != {self.policy}:
                rank_zero_warn(f"the model is already checkpointed with policy {sorted(set(existing.values()))}; "
                               f"keeping it instead of policy={self.policy!r}")
        else:
            apply_activation_checkpointing(model, self.policy, self.every_n, self.blocks)
        self.applied = list(checkpointed_blocks(model))  # module names inside the model, e.g. "layers.0"

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._reported = False
        if self._has_blocks(self._target(pl_module)):
            self._apply(pl_module)
            return
        original = pl_module.configure_model

        def configure_model_then_checkpoint() -> None:
            original()
            pl_module.__dict__.pop("configure_model", None)
            if not self._has_blocks(self._target(pl_module)):
                raise ValueError(f"ActivationCheckpointing found no blocks in {type(pl_module).__name__} after "
                                 f"configure_model (blocks={self.blocks!r}); pass blocks= with their path")
            self._apply(pl_module)

        pl_module.__dict__["configure_model"] = configure_model_then_checkpoint

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        pl_module.__dict__.pop("configure_model", None)  # if the run stopped before configure_model

    # ------------------------------------------------------------------ reporting
    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if not self.report or self._reported:
            return
        self._reported = True
        model = self._target(pl_module)
        assert model is not None
        rows, seq_len = _batch_shape(batch)
        metrics = {"ac/recompute_overhead": recompute_overhead(model, seq_len)}
        if isinstance(trainer.strategy, (SingleDeviceStrategy, DDPStrategy)):
            one = _first_row(batch)
            with trainer.precision_plugin.forward_context():
                with_ac = activation_memory(model, lambda: self.forward_fn(pl_module, one))
                with activation_checkpointing_disabled(model):
                    without = activation_memory(model, lambda: self.forward_fn(pl_module, one))
            metrics["ac/saved_activation_bytes"] = float(with_ac * rows)
            metrics["ac/saved_activation_bytes_no_ac"] = float(without * rows)
        self.metrics = metrics
        pl_module.log_dict(metrics, rank_zero_only=True)

    # ------------------------------------------------------------------ state
    @override
    def state_dict(self) -> dict[str, Any]:
        return {"policy": self.policy, "every_n": self.every_n, "applied": list(self.applied)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = (state_dict.get("policy"), state_dict.get("every_n"))
        if saved != (self.policy, self.every_n):
            rank_zero_warn(f"the checkpoint was trained with activation checkpointing policy={saved[0]!r}, "
                           f"every_n={saved[1]!r}; resuming with policy={self.policy!r}, every_n={self.every_n!r} "
                           "(results are unchanged, memory and speed differ)")
