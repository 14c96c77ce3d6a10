"""Jobs for tests/strategies/test_same_seed.py: one training step from ``seed_everything(0)`` alone, no shared state.

Each run records the initial weights right after the strategy's setup (gathered to full tensors; a pipeline stage's
union over ranks) and the step-0 loss (the mean over ranks). The model, data and batches are those of
``_nd_jobs`` (``CausalLMModule("tiny")`` with overrides, or the transformers ``HFModule``); nothing is loaded.
"""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist

from lightning_llmopt.data.sampler import ResumableDataLoader, ResumableShardedSampler
from lightning_llmopt.parallel.mesh import ParallelDims
from lightning_llmopt.strategies import NDParallelStrategy, ZeroStrategy
from lightning_llmopt.testing.lightning_env import PoolEnvironment

_spec = importlib.util.spec_from_file_location("_nd_jobs", Path(__file__).with_name("_nd_jobs.py"))
assert _spec is not None and _spec.loader is not None
J = sys.modules.get("_nd_jobs") or importlib.util.module_from_spec(_spec)
if "_nd_jobs" not in sys.modules:
    sys.modules["_nd_jobs"] = J
    _spec.loader.exec_module(J)

MLA = {"mla": {"kv_lora_rank": 32, "qk_nope_head_dim": 24, "qk_rope_head_dim": 8, "v_head_dim": 16, "q_lora_rank": 24}}
# local/global windows and cross-layer K/V sharing (layers 1 and 3 read the K/V of layers 0 and 2)
PATTERN = {"n_layers": 4, "sliding_window": 5, "layer_types": ["local", "local", "global", "global"],
           "kv_sources": [0, 0, 2, 2]}
MODELS: dict[str, dict[str, Any]] = {
    "llama": {"n_layers": 4},
    "mla": MLA,
    "moe": {"moe": {"num_experts": 4, "top_k": 2, "num_shared_experts": 1}},
    "pattern": PATTERN,
    "hf": {},
}


class InitRecorder(L.Callback):
    def __init__(self) -> None:
        self.params: dict[str, torch.Tensor] = {}
        self.losses: list[float] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.params = J.full_params(pl_module)  # a collective for DTensor parameters: every rank records

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *args: Any) -> None:
        self.losses.append(float(outputs["loss"]))


def _strategy(layout: dict[str, Any] | None) -> tuple[Any, int, int]:
    """``(strategy, dp, dp rank)``: ``None`` is Lightning's default single-process strategy; ``{"zero": s}`` is
    ``ZeroStrategy("zero<s>")``; anything else is ``NDParallelStrategy(**layout)``."""
    if layout is None:
        return "auto", 1, 0
    if "zero" in layout:
        return ZeroStrategy(stage=layout["zero"], cluster_environment=PoolEnvironment()), *_world()
    names = ("data_parallel", "tensor_parallel", "context_parallel", "pipeline_parallel")
    dims = ParallelDims.resolve(dist.get_world_size(), **{k: v for k, v in layout.items() if k in names})
    return NDParallelStrategy(cluster_environment=PoolEnvironment(), **layout), dims.dp, dims.coordinates(
        dist.get_rank()
    )["dp"]


def _world() -> tuple[int, int]:
    return dist.get_world_size(), dist.get_rank()


def first_step(layout: dict[str, Any] | None, model: str) -> dict[str, Any]:
    """One optimizer step of ``model`` (a key of :data:`MODELS`) under ``layout`` from ``seed_everything(0)``:
    ``{"init": full initial weights, "loss": step-0 loss}``."""
    L.seed_everything(0, verbose=False)
    random.seed(0)
    strategy, dp, rank = _strategy(layout)
    world = 1 if layout is None else dist.get_world_size()
    recorder = InitRecorder()
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, max_steps=1, logger=False, enable_progress_bar=False,
        enable_checkpointing=False, enable_model_summary=False, callbacks=[recorder], num_sanity_val_steps=0,
        use_distributed_sampler=False,
    )
    data = J.Tokens(J.GLOBAL_BATCH)
    sampler = ResumableShardedSampler(data, num_replicas=dp, rank=rank, seed=0)
    loader = ResumableDataLoader(data, batch_size=J.GLOBAL_BATCH // dp, sampler=sampler, drop_last=True)
    hf = model == "hf"
    module = J.HFModule() if hf else J.Module(model_overrides=MODELS[model])
    trainer.fit(module, train_dataloaders=loader)
    loss, params = torch.tensor(recorder.losses), recorder.params
    if world > 1:
        dist.all_reduce(loss)
        loss /= world
        if getattr(getattr(trainer.strategy, "dims", None), "pp", 1) > 1:  # each rank holds its stages
            params = J.union_over_ranks(params)
    return {"init": params, "loss": float(loss[0])}


def first_steps(runs: list[tuple[dict[str, Any] | None, str]]) -> list[dict[str, Any]]:
    """:func:`first_step` of every ``(layout, model)``, one after another on the pool's ranks."""
    return [first_step(layout, model) for layout, model in runs]
