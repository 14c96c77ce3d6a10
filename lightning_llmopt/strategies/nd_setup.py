"""Model preparation of :class:`~lightning_llmopt.strategies.NDParallelStrategy` in ``setup``.

- :func:`user_parallelized`: whether the user's ``configure_model`` already parallelised the model (then the
  strategy's plans are skipped);
- :func:`pipeline_split`: the stage split of the one decoder in a LightningModule (no collective);
- :func:`parallelize_model`: TP -> CP -> activation checkpointing -> compile -> ZeRO-3 over the mesh, then the local
  shards allocated and initialised;
- :func:`pipeline_runner`: the schedule's stages of this pipeline rank, built last.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_llmopt.parallel.mesh import ParallelDims
from lightning_llmopt.parallel.parallelize import NDConfig, Parallelized, find_models, materialize, parallelize
from lightning_llmopt.parallel.pipeline import PipelineConfig, PipelineRunner, stage_modules, validate_pipeline
from lightning_llmopt.parallel.pipeline_2bw import PIPEDREAM_2BW, PipeDream2BWRunner
from lightning_llmopt.parallel.pipeline_tp import TPStageBoundary
from lightning_llmopt.strategies.nd_pipeline import model_path

__all__ = ["parallelize_model", "pipeline_runner", "pipeline_split", "user_parallelized"]


def user_parallelized(module: nn.Module) -> bool:
    """Whether ``module`` holds DTensor parameters or FSDP2 modules."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in module.parameters()) or any(
        isinstance(m, FSDPModule) for m in module.modules()
    )


def pipeline_split(module: nn.Module, config: PipelineConfig) -> tuple[nn.Module, Any, str]:
    """Validate (no collective) the one decoder in ``module``: ``(decoder, its StageSplit, its path in module)``."""
    models = find_models(module)
    if len(models) != 1:
        raise ValueError(
            f"pipeline_parallel ({config.pp}) needs exactly one decoder in {type(module).__name__}, found {len(models)}"
        )
    model = models[0]
    split = validate_pipeline(model, config)
    return model, split, model_path(module, model)


def parallelize_model(
    module: nn.Module,
    mesh: Any,
    dims: ParallelDims,
    config: NDConfig,
    precision: str,
    reduce_dtype: torch.dtype | None,
    root_device: torch.device,
) -> Parallelized:
    """Apply the strategy's plans to ``module`` (sets ``config``'s dtypes) and materialise its local shards."""
    device = torch.device("cpu") if config.offload_parameters else root_device
    if not any(t.is_meta for t in module.parameters()):
        module.to(root_device)
    config.param_dtype = torch.bfloat16 if precision == "bf16-mixed" else None
    config.reduce_dtype = reduce_dtype
    parallel = parallelize(module, mesh, dims, config)
    materialize(module, device, mesh, dims, parallel.fsdp, root_device)
    metrics_to(module, root_device)
    return parallel


def metrics_to(module: nn.Module, device: torch.device) -> None:
    """Move ``module``'s torchmetrics states (the validation perplexity) to ``device``, where the loss is computed:
    they are not meta tensors, so the materialisation above leaves them on the CPU, and with the model on meta the
    strategy does not move the whole module."""
    from torchmetrics import Metric

    for sub in module.modules():
        if isinstance(sub, Metric):
            sub.to(device)


def pipeline_runner(
    model: nn.Module,
    split: Any,
    mesh: Any,
    dims: ParallelDims,
    config: NDConfig,
    pipeline_config: PipelineConfig,
    pp_rank: int,
    root_device: torch.device,
) -> PipelineRunner:
    """The stages of this rank's (pruned, parallelised) ``model`` under the schedule, over the ``"pp"`` group."""
    boundary = TPStageBoundary(mesh["tp"], config.sequence_parallel) if dims.tp > 1 else None
    if pipeline_config.schedule == PIPEDREAM_2BW:  # our own executor (double-buffered weights, no flush)
        runner: Any = PipeDream2BWRunner(
            stage_modules(model, split, pp_rank), split, pipeline_config, mesh["pp"].get_group(), root_device
        )
        return runner
    return PipelineRunner(
        stage_modules(model, split, pp_rank), split, pipeline_config, mesh["pp"].get_group(), root_device, boundary
    )
