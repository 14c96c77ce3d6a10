"""``ZeroStrategy``: ZeRO stages 1, 2 (:mod:`lightning_llmopt.parallel.zero`) and 3 (FSDP2) as a Lightning strategy.

A thin adapter: it subclasses Lightning's public ``DDPStrategy`` for launchers (subprocess/torchrun/SLURM, or a
``spawn`` start method) and cluster environments, but never wraps the model in ``DistributedDataParallel``.

- Stages 1/2: parameters are broadcast from rank 0, the optimizers from ``configure_optimizers`` are wrapped with
  :func:`~lightning_llmopt.parallel.zero.apply_zero` and LR schedulers are re-pointed at the inner optimizer;
  Lightning's backward-sync blocking (gradient accumulation) maps to ``ZeroOptimizer.no_sync()``.
- Stage 3: the model is built on the meta device and sharded with FSDP2 (:mod:`lightning_llmopt.parallel.zero_fsdp`).
- Precision, loss scaling and clipping: :class:`.zero_precision.ZeroPrecision`.
- Checkpoints: sharded and atomic through :mod:`lightning_llmopt.parallel.checkpoint` on every rank, in the
  stage-independent layout of :mod:`.zero_checkpoint` (DCP glue: :mod:`.zero_dcp`); they reshard across world sizes
  and stages.
"""

from __future__ import annotations

import shutil
from collections.abc import Generator, Mapping
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_llmopt.parallel import zero_fsdp
from lightning_llmopt.parallel.loss_scaler import DynamicLossScaler
from lightning_llmopt.parallel.zero import ZeroOptimizer, apply_zero
from lightning_llmopt.strategies import zero_checkpoint as zc
from lightning_llmopt.strategies.zero_dcp import (
    load_dcp_state,
    model_state,
    optimizer_entry,
    optimizer_template,
    resolve_checkpoint,
)
from lightning_llmopt.strategies.zero_precision import ZeroPrecision

__all__ = ["ZeroStrategy"]

_REGISTERED = (
    ("zero1", {"stage": 1}, "ZeRO-1: optimizer state sharded"),
    ("zero2", {"stage": 2}, "ZeRO-2: optimizer state and gradients sharded"),
    ("zero3", {"stage": 3}, "ZeRO-3: FSDP2 fully_shard of every block and the root"),
    ("zero2_offload", {"stage": 2, "offload_optimizer": True}, "ZeRO-2 with optimizer state and step on the CPU"),
    ("zero3_offload", {"stage": 3, "offload_optimizer": True, "offload_parameters": True},
     "ZeRO-3 with parameters, gradients, optimizer state and step on the CPU"),
)


class ZeroStrategy(DDPStrategy):
    """ZeRO data parallelism (Rajbhandari et al., arXiv 1910.02054) for any LightningModule.

    Arguments:
        stage: 1 (optimizer state sharded), 2 (also gradients) or 3 (also parameters, through FSDP2).
        offload_optimizer: optimizer state and step on the CPU (stage 3: requires ``offload_parameters``).
        offload_parameters: stage 3 only: parameters and gradients on the CPU (FSDP2 ``CPUOffloadPolicy``).
        bucket_size_mb: stages 1/2: gradient bucket size.
        reduce_dtype: dtype gradients are reduced in (``None``: the gradient dtype).
        loss_scale_init, loss_scale_growth_interval: ``16-mixed`` dynamic loss scaling.
        max_consecutive_skips: ``16-mixed``: raise after this many skipped steps in a row.
        checkpoint_keep_last: keep only this many complete checkpoints per checkpoint root (``None``: all).
        reshard_after_forward: stage 3: free gathered parameters after forward (``False`` behaves like ZeRO-2).
        split_edges: stage 3: shard the token embedding and the final norm + output head as their own FSDP units
            (``False``: they stay in the root unit, gathered for the whole step).
        start_method: ``"popen"`` (script launcher, torchrun, SLURM) or ``"spawn"``/``"forkserver"``.
        **kwargs: passed to ``DDPStrategy`` (``accelerator``, ``cluster_environment``, ``process_group_backend``,
            ``timeout``, ...).
    """

    strategy_name = "zero"

    def __init__(self, stage: int = 2, offload_optimizer: bool = False, offload_parameters: bool = False,
                 bucket_size_mb: float = 25, reduce_dtype: torch.dtype | str | None = None,
                 loss_scale_init: float = 2.0**16, loss_scale_growth_interval: int = 2000,
                 max_consecutive_skips: int | None = 20, checkpoint_keep_last: int | None = None,
                 reshard_after_forward: bool = True, split_edges: bool = True, start_method: str = "popen",
                 **kwargs: Any) -> None:
        if stage not in (1, 2, 3):
            raise ValueError(f"stage ({stage}) must be 1, 2 or 3")
        if offload_parameters and stage != 3:
            raise ValueError(f"offload_parameters=True needs stage 3 (got stage {stage}); stages 1/2 keep parameters "
                             "on the device")
        if offload_optimizer and stage == 3 and not offload_parameters:
            raise ValueError("stage 3 offloads the optimizer state together with the parameters (FSDP2 "
                             "CPUOffloadPolicy): set offload_parameters=True too")
        if bucket_size_mb <= 0:
            raise ValueError(f"bucket_size_mb ({bucket_size_mb}) must be > 0")
        if checkpoint_keep_last is not None and checkpoint_keep_last < 1:
            raise ValueError(f"checkpoint_keep_last ({checkpoint_keep_last}) must be >= 1 or None")
        if isinstance(reduce_dtype, str):
            reduce_dtype = getattr(torch, reduce_dtype.removeprefix("torch."))
        super().__init__(start_method=start_method, **kwargs)  # type: ignore[arg-type]
        self.stage, self.offload_optimizer, self.offload_parameters = stage, offload_optimizer, offload_parameters
        self.bucket_size_mb = bucket_size_mb
        self.reduce_dtype: torch.dtype | None = reduce_dtype  # type: ignore[assignment]  # str converted above
        self.reshard_after_forward = reshard_after_forward
        self.split_edges = split_edges
        self.checkpoint_keep_last = checkpoint_keep_last
        self._scaler_kwargs = {"init_scale": loss_scale_init, "growth_interval": loss_scale_growth_interval,
                               "max_consecutive_skips": max_consecutive_skips}
        self._pending_rng: bytes | None = None

    # ------------------------------------------------------------------ registration and precision
    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, kwargs, description in _REGISTERED:
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=description, **kwargs)

    @property  # type: ignore[override]
    @override
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else self._make_precision("32-true")

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        if plugin is not None and not isinstance(plugin, ZeroPrecision):
            plugin = self._make_precision(str(getattr(plugin, "precision", "32-true")))
        self._precision_plugin = plugin

    def _make_precision(self, precision: str) -> ZeroPrecision:
        device = self.root_device.type if self.parallel_devices else ("cuda" if torch.cuda.is_available() else "cpu")
        scaler = DynamicLossScaler(**self._scaler_kwargs) if precision == "16-mixed" else None  # type: ignore[arg-type]
        return ZeroPrecision(precision, device=device, scaler=scaler)

    @property
    def zero_optimizers(self) -> list[ZeroOptimizer]:
        return [o for o in self.optimizers if isinstance(o, ZeroOptimizer)]  # type: ignore[misc]

    @property
    def loss_scaler(self) -> DynamicLossScaler | None:
        plugin = self.precision_plugin
        return plugin.scaler if isinstance(plugin, ZeroPrecision) else None

    # ------------------------------------------------------------------ setup
    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        if self.stage == 3:  # materialised shard by shard in setup(): no rank holds the full model
            with torch.device("meta"), self.precision_plugin.tensor_init_context():
                yield
        else:
            with super().tensor_init_context(empty_init):
                yield

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if self.stage == 3:
            self._shard_model()
        else:
            self.model_to_device()
            self._broadcast_module_states()
        if fitting:
            self.setup_optimizers(trainer)
            if self.stage < 3:
                self._wrap_optimizers()
        self.setup_precision_plugin()

    def _shard_model(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        assert self.model is not None
        mesh = init_device_mesh(self.root_device.type, (self.world_size,))
        param_dtype = torch.bfloat16 if getattr(self.precision_plugin, "precision", "") == "bf16-mixed" else None
        zero_fsdp.shard_module(self.model, mesh, offload_parameters=self.offload_parameters,
                               param_dtype=param_dtype, reduce_dtype=self.reduce_dtype,
                               reshard_after_forward=self.reshard_after_forward, split_edges=self.split_edges)
        device = torch.device("cpu") if self.offload_parameters else self.root_device
        zero_fsdp.materialize(self.model, device, buffer_device=self.root_device)

    @torch.no_grad()
    def _broadcast_module_states(self) -> None:
        """Every rank starts from rank 0's parameters and buffers (what DDP's constructor does)."""
        assert self.model is not None
        if not (dist.is_available() and dist.is_initialized()) or self.world_size == 1:
            return
        for t in [*self.model.parameters(), *self.model.buffers()]:
            dist.broadcast(t.data, src=0)

    def _wrap_optimizers(self) -> None:
        assert self.lightning_module is not None
        wrapped = []
        for opt in self.optimizers:
            if isinstance(opt, ZeroOptimizer):
                wrapped.append(opt)
                continue
            zero = apply_zero(self.lightning_module, opt, stage=self.stage, bucket_size_mb=self.bucket_size_mb,
                              master_dtype=torch.float32, reduce_dtype=self.reduce_dtype,
                              offload_optimizer=self.offload_optimizer)
            for config in self.lr_scheduler_configs:
                if config.scheduler.optimizer is opt:
                    _repoint_scheduler(config.scheduler, zero.optimizer)
            wrapped.append(zero)
        self.optimizers = wrapped  # type: ignore[assignment]

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        if self.stage < 3:
            self.model.to(self.root_device)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Gradient accumulation: no reduction until the last micro-batch's backward."""
        with ExitStack() as stack:
            for zero in self.zero_optimizers:
                stack.enter_context(zero.no_sync())
            if self.stage == 3 and self.model is not None:
                stack.enter_context(zero_fsdp.no_gradient_sync(self.model))
            yield

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self._pending_rng is not None:  # restored here, after the resumed run built its dataloader iterator
            zc.set_rng_state(self._pending_rng)
            self._pending_rng = None
        super().on_train_batch_start(batch, batch_idx)

    def memory_bytes(self) -> dict[str, int]:
        """Per-rank bytes of parameters, gradients, optimizer state and separate master weights (tensor sizes)."""
        assert self.model is not None
        if self.stage == 3:
            return zero_fsdp.memory_bytes(self.model, list(self.optimizers))
        totals: dict[str, int] = {}
        for zero in self.zero_optimizers:
            for k, v in zero.memory_bytes().items():
                totals[k] = totals.get(k, 0) + v
        return totals

    @override
    def teardown(self) -> None:
        for zero in self.zero_optimizers:
            zero.remove_hooks()
        optimizers = self.optimizers
        self._optimizers = [o for o in optimizers if not isinstance(o, ZeroOptimizer)]
        try:
            super().teardown()  # moves plain optimizers' state to the CPU
        finally:
            self._optimizers = optimizers  # kept: trainer.save_checkpoint() after fit() still works

    # ------------------------------------------------------------------ checkpoints
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # the sharded model state is written by save_checkpoint()

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return {}

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # loaded in place by load_checkpoint()

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass

    def _model_state(self) -> dict[str, Any]:
        assert self.lightning_module is not None
        return model_state(self.lightning_module, dcp=self.stage == 3)

    _pipeline_stage = False  # the module is one pipeline stage (NDParallelStrategy)

    def _optimizer_entry(self) -> dict[str, Any] | None:
        return optimizer_entry(self.lightning_module, self.optimizers)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Write ``filepath/step-<global_step>`` atomically from every rank (no full state on any rank)."""
        from lightning_llmopt.parallel.checkpoint import save_checkpoint

        if storage_options is not None:
            raise TypeError("ZeroStrategy.save_checkpoint does not take storage_options (it writes through DCP)")
        root = Path(self.broadcast(str(filepath)))
        step = int(checkpoint.get("global_step", 0))
        lightning = {k: zc.to_bytes(v) for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        state: dict[str, Any] = {"model": self._model_state(), "lightning": lightning,
                                 "rng": {f"rank{self.global_rank}": zc.rng_state()}}
        optimizer = self._optimizer_entry()
        if optimizer is not None:
            state["optimizer"] = optimizer
        if self.loss_scaler is not None:
            state["loss_scaler"] = self.loss_scaler.state_dict()
        extra: dict[str, Any] = {"stage": self.stage, "format": "llmopt-zero-strategy/1"}
        to_dict = getattr(getattr(self.lightning_module, "config", None), "to_dict", None)
        if callable(to_dict):  # lets `llmopt consolidate` rebuild the HF config
            extra["config"] = to_dict()
        save_checkpoint(state, root, step, keep_last=self.checkpoint_keep_last, extra=extra)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            path = Path(filepath)
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load model, optimizer, scaler and RNG in place (DCP reshards) and return Lightning's checkpoint dict.

        ``checkpoint_path`` is a ``step-N`` folder or a root holding them (the newest complete one is used). An
        incomplete or damaged checkpoint raises ``IncompleteCheckpointError`` on every rank before any read.
        """
        from lightning_llmopt.parallel.checkpoint import load_checkpoint

        folder = resolve_checkpoint(Path(self.broadcast(str(checkpoint_path))), self.is_global_zero)
        metadata = zc.read_metadata(folder)
        state: dict[str, Any] = {"model": self._model_state(),
                                 "lightning": {k: b"" for k in zc.saved_top_keys(metadata, "lightning")}}
        saved_ranks = zc.saved_top_keys(metadata, "rng")
        same_world = len(saved_ranks) == self.world_size
        if same_world:
            state["rng"] = {f"rank{self.global_rank}": b""}
        opt_template = optimizer_template(self.lightning_module, self.optimizers, metadata)
        if opt_template is not None:
            state["optimizer"] = opt_template
        scaler = self.loss_scaler
        if scaler is not None and zc.saved_top_keys(metadata, "loss_scaler"):
            state["loss_scaler"] = scaler.state_dict()
        load_checkpoint(state, folder)
        self._apply_loaded(state)
        self._pending_rng = state["rng"][f"rank{self.global_rank}"] if same_world else None
        checkpoint = {k: zc.from_bytes(v) for k, v in state["lightning"].items()}
        checkpoint["state_dict"] = {}
        return checkpoint

    def _apply_loaded(self, state: dict[str, Any]) -> None:
        assert self.lightning_module is not None
        module = self.lightning_module
        if self.stage == 3:
            load_dcp_state(module, self.optimizers, state)
        elif "optimizer" in state:
            opt = self.optimizers[0]
            assert isinstance(opt, ZeroOptimizer)
            zc.load_zero_optimizer(opt, state["optimizer"], module, pipeline_stage=self._pipeline_stage)
        if "loss_scaler" in state and self.loss_scaler is not None:
            self.loss_scaler.load_state_dict(state["loss_scaler"])


def _repoint_scheduler(scheduler: Any, optimizer: torch.optim.Optimizer) -> None:
    """Point an LR scheduler at ZeRO's inner optimizer, marking its ``step`` as torch's schedulers expect."""
    scheduler.optimizer = optimizer
    step = optimizer.step
    if getattr(step, "_wrapped_by_lr_sched", False):
        return

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        optimizer._opt_called = True  # type: ignore[attr-defined]
        return step(*args, **kwargs)

    wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = wrapper  # type: ignore[method-assign]


ZeroStrategy.register_strategies(StrategyRegistry)
