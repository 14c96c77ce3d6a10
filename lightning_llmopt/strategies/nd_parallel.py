"""``NDParallelStrategy``: data (ZeRO), tensor (+ sequence), context and pipeline parallelism on one ``DeviceMesh``.

A thin adapter over :mod:`lightning_llmopt.parallel` (``mesh``, ``parallelize``, ``context_parallel``,
``data_parallel``), built on :class:`~lightning_llmopt.strategies.ZeroStrategy` for launching, precision, ZeRO-1/2
and the sharded atomic checkpoints:

- ``setup_environment``: resolve and validate the degrees (:class:`~lightning_llmopt.parallel.mesh.ParallelDims`,
  before any collective), join the process group, build the mesh and expose it as ``LightningModule.device_mesh``;
- ``configure_model`` runs on the meta device when tensor parallelism or ZeRO-3 is used;
- ``setup``: unless the user's ``configure_model`` already parallelised the model (DTensor parameters or FSDP2
  modules), apply TP -> CP -> activation checkpointing -> compile -> ZeRO-3 (:func:`~lightning_llmopt.parallel.
  parallelize.parallelize`), then allocate and initialise the local shards; with pipeline parallelism the model is
  first pruned to this rank's stages and the schedule's stages are built last (``strategies/nd_pipeline.py``; the
  model preparation steps are functions in ``strategies/nd_setup.py``);
- each batch is sharded on the sequence for context parallelism (``batch_to_device``); the sampler splits data over
  the ``dp`` ranks only; after backward, gradients are synchronised (:func:`~lightning_llmopt.parallel.parallelize.
  sync_gradients`); clipping uses the global norm over all shards.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor, nn
from typing_extensions import override

from lightning_llmopt.parallel.context_parallel import shard_batch
from lightning_llmopt.parallel.loss_scaler import DynamicLossScaler
from lightning_llmopt.parallel.mesh import ParallelDims, positive_int
from lightning_llmopt.parallel.parallelize import NDConfig, Parallelized, sync_gradients
from lightning_llmopt.parallel.pipeline import PipelineConfig, PipelineRunner, prune_to_stages
from lightning_llmopt.parallel.pipeline_2bw import PIPEDREAM_2BW, check_2bw_combination, check_2bw_trainer
from lightning_llmopt.strategies.nd_pipeline import PipelineSteps, check_pipeline_combination, default_zero_stage
from lightning_llmopt.strategies.nd_precision import NDPrecision
from lightning_llmopt.strategies.nd_setup import parallelize_model, pipeline_runner, pipeline_split
from lightning_llmopt.strategies.nd_setup import user_parallelized as _user_parallelized
from lightning_llmopt.strategies.zero import ZeroStrategy
from lightning_llmopt.strategies.zero_dcp import load_dcp_state, merge_stage_param_groups, model_state
from lightning_llmopt.strategies.zero_precision import ZeroPrecision

__all__ = ["NDParallelStrategy", "NDPrecision"]


class NDParallelStrategy(PipelineSteps, ZeroStrategy):
    """Data, tensor, sequence, context and pipeline parallelism with ZeRO, composed on one named ``DeviceMesh``.

    Arguments:
        data_parallel: data-parallel degree, or ``"auto"``: the world size over the other degrees.
        tensor_parallel: tensor-parallel degree (Megatron-style attention/MLP, vocab-parallel embedding and loss).
            With ``pipeline_parallel`` each stage is tensor-parallel over its ``"tp"`` group (sequence-sharded
            activations cross the stages under sequence parallelism; the vocab-parallel loss runs on the last stage).
        context_parallel: context-parallel degree (the sequence of each row is split over these ranks).
        pipeline_parallel: pipeline stages over the ``"pp"`` mesh dimension (docs/pipeline.md); composes with data
            parallelism, ZeRO (stage 3 with one stage per rank) and tensor (+ sequence) parallelism, not yet with
            context or expert parallelism nor ``compile`` (``NotImplementedError`` naming the degree).
        schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"``, ``"zero_bubble"``, ``"zbv"``, ``"dualpipev"`` or
            ``"pipedream_2bw"`` (no flush, two weight versions, one-step-stale gradients; zero_stage 0, no TP).
        microbatches: micro-batches per step (``None``: ``pipeline_parallel``, twice that for zbv/dualpipev); the
            rows per data-parallel rank must be divisible by it.
        virtual_stages: stages per pipeline rank (``None``: 1 for gpipe/1f1b, 2 for the others).
        pipeline_split: ``"layers"`` (block count) or ``"cost"`` (FLOPs + parameters).
        pipeline_balance_ends: Llama-3 balancing: the embedding and the head + loss count toward the first and last
            stages, which then hold fewer blocks.
        expert_parallel: experts of MoE layers sharded over this many data-parallel ranks (all-to-all dispatch;
            needs ``LlamaConfig(moe=...)`` and ``zero_stage`` 0 or 3; composes with tensor parallelism, where each
            tensor-parallel rank routes its slice of the sequence; not with CP or PP so far).
        zero_stage: 0 (gradients all-reduced over ``dp*cp``, optimizer state replicated), 1/2 (our ZeRO engine;
            not with tensor parallelism), 3 (FSDP2 over ``dp*cp``, 2-D with tensor parallelism). ``None`` (default):
            3, except with a pipeline schedule of several stages per rank (interleaved, zero bubble, zbv, dualpipev),
            which FSDP2 does not wrap: 2 there, or 0 with tensor parallelism (:func:`default_zero_stage`).
        sequence_parallel: with TP, shard norms and residuals on the sequence.
        loss_parallel: with TP, compute the loss from vocabulary-sharded logits (``CausalLMModule`` does it through
            :func:`~lightning_llmopt.parallel.vocab_parallel.vocab_parallel_cross_entropy`; other modules call it).
        context_parallel_mode: ``"ring"`` (load-balanced ring attention) or ``"ulysses"`` (all-to-all).
        activation_checkpointing: ``"none"``, ``"full"``, ``"every_n"``, ``"sqrt"`` or ``"selective"``.
        compile: ``torch.compile`` each transformer block.
        ring_impl: ring-attention block kernels: ``"auto"``, ``"flash"`` or ``"reference"``.
        offload_parameters, reshard_after_forward: FSDP2 options (stage 3).
        fused_kernels: fused kernels swapped into every decoder after TP and CP (``"all"`` or names of
            :data:`~lightning_llmopt.models.config.FUSED_KERNELS`; transformers Llama/Mistral/Qwen too); ``None``:
            those the model's config names (``LlamaConfig.fused_kernels``). They run on each rank's shards.
        **kwargs: :class:`ZeroStrategy` options (``bucket_size_mb``, ``reduce_dtype``, ``checkpoint_keep_last``,
            ``offload_optimizer``, ``start_method``, ``cluster_environment``, ``process_group_backend``, ...).

    ``LightningModule.device_mesh`` holds the mesh (dimensions ``pp, dp, cp, tp``, flattened ``dp_cp``) in
    ``configure_model``; a ``configure_model`` that parallelises the model itself (DTensor or FSDP2 parameters)
    overrides the strategy's plans.
    """

    strategy_name = "nd_parallel"

    def __init__(
        self,
        data_parallel: int | str = "auto",
        tensor_parallel: int = 1,
        context_parallel: int = 1,
        pipeline_parallel: int = 1,
        expert_parallel: int = 1,
        zero_stage: int | None = None,
        sequence_parallel: bool = True,
        loss_parallel: bool = True,
        context_parallel_mode: str = "ring",
        activation_checkpointing: str = "none",
        compile: bool = False,
        ring_impl: str = "auto",
        offload_parameters: bool = False,
        reshard_after_forward: bool = True,
        schedule: str = "1f1b",
        microbatches: int | None = None,
        virtual_stages: int | None = None,
        pipeline_split: str = "layers",
        pipeline_balance_ends: bool = False,
        fused_kernels: list[str] | str | None = None,
        **kwargs: Any,
    ) -> None:
        if data_parallel != "auto":
            positive_int("data_parallel", data_parallel)
        for name, value in (
            ("tensor_parallel", tensor_parallel),
            ("context_parallel", context_parallel),
            ("pipeline_parallel", pipeline_parallel),
            ("expert_parallel", expert_parallel),
        ):
            positive_int(name, value)
        self.pipeline_config = PipelineConfig(
            pp=pipeline_parallel,
            schedule=schedule,
            microbatches=microbatches,
            virtual_stages=virtual_stages,
            split=pipeline_split,
            balance_ends=pipeline_balance_ends,
        )
        if zero_stage is None:
            zero_stage = default_zero_stage(
                pipeline_parallel, self.pipeline_config.virtual_stages or 1, tensor_parallel
            )
            zero_stage = 0 if schedule == PIPEDREAM_2BW and pipeline_parallel > 1 else zero_stage
        if pipeline_parallel > 1 and schedule == PIPEDREAM_2BW:
            check_2bw_combination(pipeline_parallel, tensor_parallel, zero_stage, activation_checkpointing)
        if pipeline_parallel > 1:
            check_pipeline_combination(
                pipeline_parallel,
                tensor_parallel,
                context_parallel,
                expert_parallel,
                zero_stage,
                self.pipeline_config.virtual_stages or 1,
                compile,
            )
        self._degrees: dict[str, Any] = {
            "data_parallel": data_parallel,
            "tensor_parallel": tensor_parallel,
            "context_parallel": context_parallel,
            "pipeline_parallel": pipeline_parallel,
            "expert_parallel": expert_parallel,
        }
        self.nd_config = NDConfig(
            sequence_parallel=sequence_parallel,
            loss_parallel=loss_parallel,
            context_parallel_mode=context_parallel_mode,
            ring_impl=ring_impl,
            activation_checkpointing=activation_checkpointing,
            compile=compile,
            zero_stage=zero_stage,
            reshard_after_forward=reshard_after_forward,
            offload_parameters=offload_parameters,
            fused_kernels=fused_kernels,  # type: ignore[arg-type]  # a name list or "all"; NDConfig checks it
        )
        super().__init__(
            stage=zero_stage if zero_stage else 3,
            offload_parameters=offload_parameters,
            reshard_after_forward=reshard_after_forward,
            **kwargs,
        )
        self.stage = zero_stage
        self.dims: ParallelDims | None = None
        self._device_mesh: Any = None
        self._parallel: Parallelized | None = None
        self._sync_blocked = False
        self._pipeline: PipelineRunner | None = None
        self._pipeline_owner: Any = None  # the LightningModule whose model the pipeline was built from
        self._pipeline_model = ""  # the model's path in the LightningModule
        self._pipelined_step = False

    # ------------------------------------------------------------------ registration, precision, mesh
    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        if "nd_parallel" not in strategy_registry:
            strategy_registry.register(
                "nd_parallel",
                cls,
                description="data x tensor x context parallelism with "
                "ZeRO on one DeviceMesh (tensor_parallel, context_parallel, zero_stage, ...)",
            )

    @override
    def _make_precision(self, precision: str) -> ZeroPrecision:
        device = self.root_device.type if self.parallel_devices else ("cuda" if torch.cuda.is_available() else "cpu")
        scaler = DynamicLossScaler(**self._scaler_kwargs) if precision == "16-mixed" else None  # type: ignore[arg-type]
        return NDPrecision(precision, device=device, scaler=scaler)

    @property  # type: ignore[override]
    @override
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else self._make_precision("32-true")

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        if plugin is not None and not isinstance(plugin, NDPrecision):
            scaler = plugin.scaler if isinstance(plugin, ZeroPrecision) else None
            precision = str(getattr(plugin, "precision", "32-true"))
            plugin = self._make_precision(precision)
            if scaler is not None:
                plugin.scaler = scaler  # type: ignore[attr-defined]
        self._precision_plugin = plugin

    @property
    def device_mesh(self) -> Any:
        """The named mesh (after ``setup_environment``)."""
        return self._device_mesh

    @override
    def setup_environment(self) -> None:
        self.set_world_ranks()  # what Lightning does first in setup_distributed; idempotent
        self.dims = ParallelDims.resolve(self.world_size, **self._degrees)  # before any collective
        self.dims.check_nodes(self.num_nodes, self.world_size // self.num_nodes)  # TP/CP inside a node
        super().setup_environment()
        self._device_mesh = self.dims.build_mesh(self.root_device.type)
        if self.lightning_module is not None:
            self.lightning_module._device_mesh = self._device_mesh

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Data is split over the data-parallel ranks; tensor/context-parallel ranks of a dp group share batches."""
        assert self.dims is not None
        return {"num_replicas": self.dims.dp, "rank": self.dims.coordinates(self.global_rank)["dp"]}

    # ------------------------------------------------------------------ setup
    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        if self._degrees["tensor_parallel"] > 1 or self.stage == 3:
            with torch.device("meta"), self.precision_plugin.tensor_init_context():
                yield
        else:
            with super(ZeroStrategy, self).tensor_init_context(empty_init):
                yield

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None and self.dims is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None
        pipelined = None
        if self.dims.pp > 1 and self.pipeline_config.schedule == PIPEDREAM_2BW:
            check_2bw_trainer(trainer)
        if self.dims.pp > 1 and not (self._pipeline is not None and self._pipeline_owner is module):
            # (a later fit/validate/test of the same trainer reuses the stages an earlier one split and parallelised)
            if _user_parallelized(module):
                raise ValueError(
                    f"pipeline_parallel ({self.dims.pp}) needs an unparallelised model from "
                    "configure_model; the strategy splits it into stages"
                )
            pipelined = self._split_pipeline(module)
        if not _user_parallelized(module):
            precision = str(getattr(self.precision_plugin, "precision", ""))
            self._parallel = parallelize_model(
                module, self._device_mesh, self.dims, self.nd_config, precision, self.reduce_dtype, self.root_device
            )
        if pipelined is not None:
            rank = self.dims.coordinates(self.global_rank)["pp"]  # this rank's pipeline coordinate
            self._pipeline = pipeline_runner(
                *pipelined, self._device_mesh, self.dims, self.nd_config, self.pipeline_config, rank, self.root_device
            )
            self._pipeline_owner = module
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            if self.stage in (1, 2):
                self._wrap_optimizers()
        self.setup_precision_plugin()
        if isinstance(self.precision_plugin, NDPrecision):
            self.precision_plugin.pipeline_parallel = self.dims.pp

    def _split_pipeline(self, module: nn.Module) -> tuple[nn.Module, Any]:
        """Validate (no collective) and keep only this rank's stages of the one decoder in ``module``."""
        assert self.dims is not None
        model, split, self._pipeline_model = pipeline_split(module, self.pipeline_config)
        prune_to_stages(model, split, self.dims.coordinates(self.global_rank)["pp"])
        return model, split

    @override
    def _wrap_optimizers(self) -> None:
        """ZeRO-1/2 over the data-parallel ranks of this stage (``dp*cp``), not the whole world."""
        assert self.dims is not None
        if self.dims.pp == 1:
            return super()._wrap_optimizers()
        from lightning_llmopt.parallel.zero import apply_zero
        from lightning_llmopt.strategies.zero import _repoint_scheduler

        assert self.lightning_module is not None
        wrapped = []
        for opt in self.optimizers:
            zero = apply_zero(
                self.lightning_module,
                opt,
                stage=self.stage,
                bucket_size_mb=self.bucket_size_mb,
                master_dtype=torch.float32,
                reduce_dtype=self.reduce_dtype,
                offload_optimizer=self.offload_optimizer,
                process_group=self._device_mesh["dp_cp"].get_group(),
            )
            for config in self.lr_scheduler_configs:
                if config.scheduler.optimizer is opt:
                    _repoint_scheduler(config.scheduler, zero.optimizer)
            wrapped.append(zero)
        self.optimizers = wrapped  # type: ignore[assignment]
        return None

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        if not any(t.is_meta for t in self.model.parameters()) and self._parallel is None:
            self.model.to(self.root_device)

    @override
    def teardown(self) -> None:
        module = self.lightning_module
        if module is None or not any(t.is_meta for t in module.parameters()):
            return super().teardown()
        # setup failed before the model left the meta device (e.g. a validation error): there is nothing to move
        # to the CPU, and trying would replace the original error with "Cannot copy out of meta tensor"
        self._lightning_module = None
        try:
            super().teardown()
        finally:
            self._lightning_module = module
        return None

    # ------------------------------------------------------------------ per step
    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        batch = super().batch_to_device(batch, device, dataloader_idx)
        return self.shard_batch(batch)

    def shard_batch(self, batch: Any) -> Any:
        """This rank's part of a dict batch under context parallelism (and the sequence check of SP)."""
        assert self.dims is not None
        sp = self.dims.tp > 1 and self.nd_config.sequence_parallel
        if self._parallel is None or (self.dims.cp == 1 and not sp):
            return batch
        if not isinstance(batch, dict) or not isinstance(batch.get("input_ids"), Tensor):
            raise TypeError(
                "context/sequence parallelism needs dict batches with an 'input_ids' (B, T) tensor, got "
                f"{type(batch).__name__}"
            )
        cp = self._parallel.context_parallel
        if cp is None:  # sequence parallelism alone: the model shards inside; check the length here
            T = batch["input_ids"].shape[1]
            if T % self.dims.tp:
                raise ValueError(
                    f"sequence length ({T}) must be divisible by tensor_parallel ({self.dims.tp}) with "
                    "sequence parallelism"
                )
            return batch
        return shard_batch(batch, cp.spec, multiple_of=self.dims.tp if sp else 1)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        self._sync_blocked = True
        try:
            with super().block_backward_sync():
                yield
        finally:
            self._sync_blocked = False

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        super().post_backward(closure_loss)
        if self._parallel is not None and not self._sync_blocked and self.lightning_module is not None:
            assert self.dims is not None
            sync_gradients(self.lightning_module, self._device_mesh, self.dims, self.nd_config, self._parallel.fsdp)

    @override
    def memory_bytes(self) -> dict[str, int]:
        from lightning_llmopt.parallel import zero_fsdp

        if self.stage in (1, 2):
            return super().memory_bytes()
        assert self.model is not None
        return zero_fsdp.memory_bytes(self.model, list(self.optimizers))

    # ------------------------------------------------------------------ checkpoints (layout-free DCP state)
    @override
    def _model_state(self) -> dict[str, Any]:
        assert self.lightning_module is not None
        return model_state(self.lightning_module, dcp=self.stage not in (1, 2))

    @override
    def _optimizer_entry(self) -> dict[str, Any] | None:
        """Under pipeline parallelism each stage's param groups name only its own parameters, and DCP keeps one
        rank's copy of the (replicated-looking) ``param_groups`` entry: save the union over the stages instead."""
        entry = super()._optimizer_entry()
        if entry is None or self.dims is None or self.dims.pp == 1:
            return entry
        return merge_stage_param_groups(entry, self._device_mesh["pp"].get_group())

    @property
    def _pipeline_stage(self) -> bool:  # type: ignore[override]
        return self.dims is not None and self.dims.pp > 1

    @override
    def _apply_loaded(self, state: dict[str, Any]) -> None:
        if self.stage in (1, 2):
            return super()._apply_loaded(state)
        assert self.lightning_module is not None
        load_dcp_state(self.lightning_module, self.optimizers, state)
        if "loss_scaler" in state and self.loss_scaler is not None:
            self.loss_scaler.load_state_dict(state["loss_scaler"])
        return None


NDParallelStrategy.register_strategies(StrategyRegistry)
