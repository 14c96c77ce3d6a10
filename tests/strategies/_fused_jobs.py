"""Jobs for tests/strategies/test_nd_fused.py: the fused kernels (``fused_kernels=["all"]``) under every strategy,
trained inside the gloo pool, against one process without them.

Built on ``_nd_jobs.py`` (the same data, module, learning rate and initial weights); adds a callback that keeps the
full gradient of every step (collective under sharding: every rank calls it).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist

_spec = importlib.util.spec_from_file_location("_nd_jobs", Path(__file__).with_name("_nd_jobs.py"))
assert _spec is not None and _spec.loader is not None
if "_nd_jobs" not in sys.modules:
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["_nd_jobs"] = _module
    _spec.loader.exec_module(_module)
J: Any = sys.modules["_nd_jobs"]


class GradRecorder(L.Callback):
    """The full gradient of every parameter before each optimizer step (flattened in name order, fp64)."""

    def __init__(self) -> None:
        self.grads: list[dict[str, torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        from torch.distributed.tensor import DTensor

        grads = {}
        for name, p in pl_module.named_parameters():
            g = p.grad
            if g is None:
                continue
            if isinstance(g, DTensor):
                g = g.redistribute(g.device_mesh, [_replicate()] * g.device_mesh.ndim).to_local()
            grads[name] = g.detach().double().clone()
        if grads:  # none under ZeRO-1/2 pipelines: the engine keeps them in its flat shards
            self.grads.append(grads)


class FusedHFModule(J.HFModule):
    """``_nd_jobs.HFModule`` whose step passes the labels (already shifted: ``shift_labels``), so a model patched by
    ``optimize_model`` takes its fused linear + cross-entropy; unpatched, transformers' own loss is the same mean."""

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        labels = batch["labels"]
        return self.model(input_ids=batch["input_ids"], labels=labels, shift_labels=labels).loss


def _replicate() -> Any:
    from torch.distributed.tensor import Replicate

    return Replicate()


def fit_zero(zero: dict[str, Any], init_path: str, callbacks: list[L.Callback], module_kwargs: Any) -> Any:
    """``_nd_jobs.fit`` with a :class:`ZeroStrategy` (``zero``: its arguments; ``stage=3`` is ``"zero3"``,
    ``offload_parameters``/``offload_optimizer`` ``"zero3_offload"``): data split over every rank."""
    import random

    from lightning_llmopt.data.sampler import ResumableDataLoader, ResumableShardedSampler
    from lightning_llmopt.strategies import ZeroStrategy
    from lightning_llmopt.testing.lightning_env import PoolEnvironment

    L.seed_everything(0, verbose=False)
    random.seed(0)
    recorder = J.Recorder()
    world, rank = dist.get_world_size(), dist.get_rank()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=ZeroStrategy(cluster_environment=PoolEnvironment(), **zero),
        max_steps=J.STEPS,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=[recorder, *callbacks],
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
    )
    data = J.Tokens(J.GLOBAL_BATCH * J.STEPS)
    sampler = ResumableShardedSampler(data, num_replicas=world, rank=rank, seed=0)
    loader = ResumableDataLoader(data, batch_size=J.GLOBAL_BATCH // world, sampler=sampler, drop_last=True)
    trainer.fit(J.Module(init_path=init_path, **(module_kwargs or {})), train_dataloaders=loader)
    return recorder, trainer


def run(config: dict[str, Any], init_path: str, backend: str | None = None) -> dict[str, Any]:
    """One training (``config`` holds ``_nd_jobs.fit`` arguments, or ``{"strategy": ...}`` for a ZeroStrategy);
    returns losses, parameters and per-step gradients (unions over pipeline ranks)."""
    old = os.environ.get("LLMOPT_FUSED_BACKEND")
    if backend is not None:
        os.environ["LLMOPT_FUSED_BACKEND"] = backend
    try:
        grads = GradRecorder()
        config = dict(config)
        overrides = dict(config.pop("overrides", {}))  # model_overrides of both sides (e.g. n_layers)
        if config.pop("fused", True):
            overrides["fused_kernels"] = ["all"]
        config["module_kwargs"] = {"model_overrides": overrides, **config.pop("module", {})}  # e.g. float8
        if "zero" in config:
            recorder, trainer = fit_zero(config["zero"], init_path, [grads], config["module_kwargs"])
        elif config.get("hf"):
            config.pop("module_kwargs")
            plain, J.HFModule = J.HFModule, FusedHFModule  # the same fit, with the module above
            try:
                recorder, trainer = J.fit(init_path=init_path, callbacks=[grads], **config)
            finally:
                J.HFModule = plain
        else:
            recorder, trainer = J.fit(init_path=init_path, callbacks=[grads], **config)
        out = J.summary(recorder, trainer)
        out["fused"] = dict(getattr(trainer.lightning_module.model, "llmopt_fused", {}))  # what was swapped in
        out["float8_all_gather"] = bool(getattr(trainer.lightning_module, "_float8_all_gather", False))
        steps = grads.grads
        if getattr(getattr(trainer.strategy, "dims", None), "pp", 1) > 1:
            steps = [J.union_over_ranks(g) for g in steps]
        out["grads"] = steps
        return out
    finally:
        if backend is not None:
            if old is None:
                del os.environ["LLMOPT_FUSED_BACKEND"]
            else:
                os.environ["LLMOPT_FUSED_BACKEND"] = old


def parity_job(
    init_paths: dict[str, str], configs: list[dict[str, Any]], backend: str | None = None
) -> list[dict[str, Any]]:
    out = []
    for config in configs:
        config = dict(config)
        init = config.pop("init", "hf" if config.get("hf") else "llmopt")
        result = run(config, init_paths[init], backend)
        result.pop("start_params", None)
        out.append(result)
    dist.barrier()
    return out


def validate_job(
    init_path: str, nd: dict[str, Any] | None, overrides: dict[str, Any], fused: bool = True
) -> dict[str, float]:
    """``_nd_jobs.validate`` (``Trainer.validate`` on packed rows) of the model with ``overrides`` (and the fused
    kernels)."""
    plain = J.Module
    kernels = {"fused_kernels": ["all"]} if fused else {}

    class FusedModule(plain):  # type: ignore[misc, valid-type]
        def __init__(self, init_path: str | None = None) -> None:
            super().__init__(init_path=init_path, model_overrides={**overrides, **kernels})

    J.Module = FusedModule
    try:
        return J.validate(nd, init_path)
    finally:
        J.Module = plain


def unknown_layout_job() -> str:
    """A fused RMSNorm whose weight a user made a replicated DTensor, called with a plain tensor before the kernel
    step said whether that is a sequence shard: the error names the missing step (no collective runs first)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    from lightning_llmopt.layers.norms import FusedRMSNorm

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    norm = FusedRMSNorm(8)
    norm.weight = torch.nn.Parameter(distribute_tensor(torch.ones(8), mesh, [Replicate()]))
    try:
        norm(torch.randn(2, 3, 8))
    except ValueError as exc:
        return str(exc)
    return "no error"


def save_init(directory: Path, overrides: dict[str, Any]) -> str:
    """Seeded ``CausalLMModule("tiny", model_overrides=overrides)`` weights saved in ``directory``; their path."""
    L.seed_everything(0, verbose=False)
    from lightning_llmopt import CausalLMModule

    module = CausalLMModule("tiny", model_overrides=overrides)
    module.configure_model()
    path = directory / "init.pt"
    torch.save({k: v.clone() for k, v in module.state_dict().items()}, path)
    return str(path)


def rel_error(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """``||a - b|| / ||b||`` over all entries (same names), in float64."""
    assert sorted(a) == sorted(b)
    x, y = (torch.cat([t[k].reshape(-1).double() for k in sorted(t)]) for t in (a, b))
    return float((x - y).norm() / y.norm())
