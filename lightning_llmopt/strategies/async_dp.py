"""``AsyncDataParallelStrategy``: BSP, local SGD / DiLoCo and bounded-staleness (SSP) data parallelism.

A thin adapter over :mod:`lightning_llmopt.parallel.async_dp`, built on
:class:`~lightning_llmopt.strategies.NDParallelStrategy` with ``zero_stage=0`` (replicated parameters and per-rank
optimizer state) for launching, precision, the mesh and the sharded checkpoints:

- ``"bsp"``: exactly ``NDParallelStrategy`` (gradients averaged every step); every option of it is accepted;
- ``"local_sgd"`` / ``"ssp"``: no gradient synchronisation; the strategy wraps each optimizer step
  (``optimizer_step``) with :class:`~lightning_llmopt.parallel.async_dp.LocalSGD` or
  :class:`~lightning_llmopt.parallel.async_dp.StaleSync`; gradient clipping uses each rank's own gradient norm; at the
  end of ``fit`` the replicas are made equal (an unfinished local-SGD period is averaged without an outer step; SSP
  applies every step in flight);
- checkpoints also hold, per rank, the local parameters, the inner optimizer state and the synchronisation state
  (anchor, outer momentum, step counters, steps in flight), so a resumed run continues the same trajectory.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import StrategyRegistry
from torch import Tensor
from typing_extensions import override

from lightning_llmopt.parallel.async_dp import AsyncDPConfig, LocalSGD, StaleSync
from lightning_llmopt.parallel.loss_scaler import DynamicLossScaler
from lightning_llmopt.strategies.nd_parallel import NDParallelStrategy
from lightning_llmopt.strategies.nd_precision import NDPrecision
from lightning_llmopt.strategies.zero_precision import ZeroPrecision

__all__ = ["AsyncDataParallelStrategy", "LocalClipPrecision"]

_OTHER_DEGREES = ("tensor_parallel", "context_parallel", "pipeline_parallel", "expert_parallel")


class LocalClipPrecision(NDPrecision):
    """:class:`NDPrecision` that clips by each rank's own gradient norm (no collective) when ``local_clip``."""

    local_clip: bool = False

    @override
    def clip_grad_by_norm(self, optimizer: Any, clip_val: int | float) -> None:
        if not self.local_clip:
            return super().clip_grad_by_norm(optimizer, clip_val)
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        torch.nn.utils.clip_grad_norm_(params, float(clip_val))
        return None


def check_async_combination(config: AsyncDPConfig, kwargs: dict[str, Any]) -> None:
    """Refuse (before any collective) what does not compose with ``local_sgd``/``ssp``: sharded parameters or
    optimizer state (ZeRO 1/2/3) and model parallelism (TP, CP, PP, EP)."""
    if config.mode == "bsp":
        return
    why = "each rank keeps its own parameters and optimizer state between synchronisations"
    stage = kwargs.get("zero_stage")
    if stage not in (None, 0):
        raise ValueError(
            f"data_parallel_sync={config.mode!r} does not compose with zero_stage ({stage}): {why}, which ZeRO "
            "shards across the ranks; use zero_stage=0"
        )
    for name in _OTHER_DEGREES:
        value = kwargs.get(name, 1)
        if value != 1:
            raise ValueError(
                f"data_parallel_sync={config.mode!r} does not compose with {name} ({value}): {why}, and the "
                "averaging works on replicated plain tensors; use data parallelism only"
            )
    if kwargs.get("offload_optimizer"):
        raise ValueError(f"data_parallel_sync={config.mode!r} does not compose with offload_optimizer=True")


class AsyncDataParallelStrategy(NDParallelStrategy):
    """Data parallelism that synchronises every step (BSP), every ``sync_every`` steps (local SGD, DiLoCo) or with
    bounded staleness (SSP). docs/async_data_parallel.md states what is read and applied in each mode.

    Arguments:
        data_parallel_sync: ``"bsp"``, ``"local_sgd"`` or ``"ssp"``.
        sync_every: ``local_sgd``: inner optimizer steps between parameter averages (``H``, default 1).
        staleness: ``ssp``: how many steps a rank may run ahead of the slowest (``s``, default 1).
        outer_optimizer: ``local_sgd``: ``"none"`` (plain averaging) or ``"nesterov"`` (DiLoCo outer step).
        outer_lr, outer_momentum: the outer Nesterov SGD (DiLoCo: 0.7, 0.9).
        trace_staleness: ``ssp``: record ``(own step, slowest rank's step)`` at every read in
            ``strategy.sync.reads`` (one store read per rank and step; for tests and diagnosis).
        **kwargs: :class:`NDParallelStrategy` options. With ``local_sgd``/``ssp`` only data parallelism with
            ``zero_stage`` 0 (or unset) composes; other degrees, ZeRO stages and ``offload_optimizer`` raise a
            ``ValueError`` naming the value, here in the constructor.
    """

    strategy_name = "async_dp"

    def __init__(
        self,
        data_parallel_sync: str = "local_sgd",
        sync_every: int | None = None,
        staleness: int | None = None,
        outer_optimizer: str = "none",
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        trace_staleness: bool = False,
        **kwargs: Any,
    ) -> None:
        self.async_config = AsyncDPConfig(
            data_parallel_sync, sync_every, staleness, outer_optimizer, outer_lr, outer_momentum
        )
        check_async_combination(self.async_config, kwargs)
        if self.async_config.mode != "bsp":
            kwargs["zero_stage"] = 0
        super().__init__(**kwargs)
        self.trace_staleness = trace_staleness
        self.sync: LocalSGD | StaleSync | None = None
        self._pending_sync_state: dict[str, Any] | None = None
        self._sigterm_flag: tuple[Any, str] | None = None

    @property
    def mode(self) -> str:
        return self.async_config.mode

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, kwargs, description in (
            ("local_sgd", {"data_parallel_sync": "local_sgd", "sync_every": 8}, "local SGD: average every 8 steps"),
            (
                "diloco",
                {"data_parallel_sync": "local_sgd", "sync_every": 500, "outer_optimizer": "nesterov"},
                "DiLoCo: outer Nesterov step every 500 inner steps",
            ),
            ("ssp", {"data_parallel_sync": "ssp", "staleness": 1}, "stale synchronous data parallelism, s=1"),
        ):
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=description, **kwargs)

    @override
    def _make_precision(self, precision: str) -> ZeroPrecision:
        if precision == "16-mixed" and self.async_config.mode != "bsp":
            raise ValueError(
                f"precision '16-mixed' does not compose with data_parallel_sync={self.async_config.mode!r}: its loss "
                "scaler agrees on skipped steps with an all-reduce every step; use 'bf16-mixed' or '32-true'"
            )
        device = self.root_device.type if self.parallel_devices else ("cuda" if torch.cuda.is_available() else "cpu")
        scaler = DynamicLossScaler(**self._scaler_kwargs) if precision == "16-mixed" else None  # type: ignore[arg-type]
        plugin = LocalClipPrecision(precision, device=device, scaler=scaler)
        plugin.local_clip = self.async_config.mode != "bsp"
        return plugin

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        if self.mode != "bsp" and len(self.optimizers) > 1:
            raise ValueError(f"data_parallel_sync={self.mode!r} supports one optimizer, got {len(self.optimizers)}")
        if self.mode != "bsp":
            self._unsynchronised_sigterm_check(trainer)

    def _unsynchronised_sigterm_check(self, trainer: pl.Trainer) -> None:
        """Lightning 2.6 broadcasts a SIGTERM flag from rank 0 before every training batch (the training epoch
        loop's ``_broadcast_sigterm_tensor``): a per-step synchronisation that would hold every rank to the slowest.
        Here a rank that received SIGTERM sets a key in the process group's store instead, and every rank checks
        that key before each batch (one store round trip, no waiting for other ranks); all ranks then stop."""
        loop = trainer.fit_loop.epoch_loop
        if not hasattr(loop, "_broadcast_sigterm_tensor") or not torch.distributed.is_initialized():
            return
        from lightning.pytorch.utilities.exceptions import SIGTERMException
        from torch.distributed import distributed_c10d

        store = distributed_c10d._get_default_store()
        key = "llmopt_async_dp_sigterm"
        if self.global_rank == 0:
            store.delete_key(key)  # a flag left by an earlier run in the same process group
        self.barrier("async_dp_sigterm_key")

        def check() -> None:
            if getattr(trainer, "received_sigterm", False):
                store.set(key, "1")
            if store.check([key]):
                raise SIGTERMException()

        loop._broadcast_sigterm_tensor = check  # type: ignore[method-assign]
        self._sigterm_flag = (store, key)

    @override
    def on_exception(self, exception: BaseException) -> None:
        """A rank that stops on SIGTERM (Lightning also raises it from its own local check) raises the flag, so the
        others stop at their next batch instead of waiting for it at the next synchronisation."""
        from lightning.pytorch.utilities.exceptions import SIGTERMException

        if isinstance(exception, SIGTERMException) and self._sigterm_flag is not None:
            store, key = self._sigterm_flag
            store.set(key, "1")
        super().on_exception(exception)

    # ------------------------------------------------------------------ per step
    def _params(self) -> list[Tensor]:
        assert self.lightning_module is not None
        return list(self.lightning_module.parameters())

    def _ensure_sync(self) -> LocalSGD | StaleSync:
        """Built at the first step (after initial weights and any checkpoint are in place)."""
        if self.sync is None:
            group = self._device_mesh["dp"].get_group() if self._device_mesh is not None else None
            c = self.async_config
            if c.mode == "local_sgd":
                assert c.sync_every is not None
                self.sync = LocalSGD(
                    self._params(), group, c.sync_every, c.outer_optimizer, c.outer_lr, c.outer_momentum
                )
            else:
                assert c.staleness is not None
                self.sync = StaleSync(self._params(), group, c.staleness, trace=self.trace_staleness)
            if self._pending_sync_state is not None:
                self.sync.load_state_dict(self._pending_sync_state)
                self._pending_sync_state = None
        return self.sync

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        if self.mode == "bsp":
            super().post_backward(closure_loss)  # gradients averaged (NDParallelStrategy)
        # local_sgd / ssp: each rank keeps its own gradient

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        if self.mode == "bsp":
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        sync = self._ensure_sync()
        if isinstance(sync, StaleSync):
            sync.before_step()  # the read: parameters as the staleness bound defines them
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        if isinstance(sync, StaleSync):
            sync.after_step()
        else:
            sync.step()
        return out

    @override
    def on_train_end(self) -> None:
        """Leave every rank with the same parameters."""
        if isinstance(self.sync, LocalSGD) and self.sync.pending:
            self.sync.sync(outer_step=False)
        elif isinstance(self.sync, StaleSync):
            self.sync.flush()
        super().on_train_end()

    # ------------------------------------------------------------------ checkpoints
    def _rank_key(self, rank: int | None = None) -> str:
        return f"async_dp_rank{self.global_rank if rank is None else rank}"

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """The shared layout plus, per rank, the local parameters, inner optimizer and synchronisation state (the
        shared ``model``/``optimizer`` entries hold one rank's copy; replicas differ between synchronisations)."""
        if self.mode != "bsp" and self.lightning_module is not None:
            sync_state = self.sync.state_dict() if self.sync is not None else self._pending_sync_state
            local = {
                "params": {k: p.detach().clone() for k, p in self.lightning_module.named_parameters()},
                "optimizer": self.optimizers[0].state_dict() if self.optimizers else None,
                "sync": sync_state,
                "mode": self.mode,
            }
            checkpoint = {**checkpoint, self._rank_key(): local}
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only)
        saved = sorted(k for k in checkpoint if k.startswith("async_dp_rank"))
        local = checkpoint.get(self._rank_key())
        for key in saved:
            del checkpoint[key]
        if self.mode == "bsp":
            return checkpoint
        if local is None or len(saved) != self.world_size or local["mode"] != self.mode:
            raise ValueError(
                f"data_parallel_sync={self.mode!r} resumes from a checkpoint of the same mode and world size: this "
                f"run has {self.world_size} ranks, the checkpoint holds per-rank state of {len(saved)} "
                f"(mode {local['mode'] if local else None!r})"
            )
        self._apply_local(local)
        return checkpoint

    @torch.no_grad()
    def _apply_local(self, local: dict[str, Any]) -> None:
        assert self.lightning_module is not None
        for name, p in self.lightning_module.named_parameters():
            p.copy_(local["params"][name])
        if local["optimizer"] is not None and self.optimizers:
            self.optimizers[0].load_state_dict(local["optimizer"])
        self.sync = None
        self._pending_sync_state = local["sync"]


AsyncDataParallelStrategy.register_strategies(StrategyRegistry)
