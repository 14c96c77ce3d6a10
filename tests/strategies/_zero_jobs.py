"""Jobs for tests/strategies/test_zero_strategy.py: Lightning runs inside the shared gloo worker pool.

A pool worker already belongs to a process group, so the Trainer gets a cluster environment that reports the
group's ranks and says the processes were created externally: Lightning launches nothing and reuses the group.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from lightning_llmopt import CausalLMModule
from lightning_llmopt.data.sampler import ResumableDataLoader, ResumableShardedSampler
from lightning_llmopt.strategies import ZeroPrecision, ZeroStrategy
from lightning_llmopt.testing.lightning_env import PoolEnvironment

SEQ, GLOBAL_BATCH, VOCAB = 16, 4, 320


class Tokens(Dataset):
    """Fixed random token rows; row i is the same whatever the world size."""

    def __init__(self, rows: int) -> None:
        self.data = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.data[i, :-1], "labels": self.data[i, 1:]}


class Module(CausalLMModule):
    """``CausalLMModule("tiny")`` that starts from given weights and can inject a non-finite loss."""

    def __init__(self, init_path: str | None = None, inf_at_step: int | None = None, inf_rank: int = 0,
                 **kwargs: Any) -> None:
        # 3e-4, not 3e-3: see tests/strategies/_nd_jobs.py (fp32 noise in Adam's normalised step reaches ~1e-6)
        super().__init__("tiny", warmup_steps=2, learning_rate=3e-4, max_steps=100, **kwargs)
        self.init_path, self.inf_at_step, self.inf_rank = init_path, inf_at_step, inf_rank

    def on_fit_start(self) -> None:
        if self.init_path is not None and self.trainer.ckpt_path is None:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            full = torch.load(self.init_path, weights_only=True)
            set_model_state_dict(self, full, options=StateDictOptions(full_state_dict=True))

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.inf_at_step == self.trainer.global_step and self.trainer.global_rank == self.inf_rank:
            loss = loss * float("inf")
        return loss


class Recorder(L.Callback):
    """Per-step losses, parameters before/after steps, memory and the state right after a resume."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.memory: dict[str, int] = {}
        self.grad_memory = 0
        self.params_before: dict[str, torch.Tensor] = {}
        self.scales: list[float] = []
        self.skipped: list[float] = []
        self.start_state: dict[str, Any] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.ckpt_path is not None:
            self.start_state = {"params": full_params(pl_module), "optimizer": full_optimizer(trainer)}

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if isinstance(trainer.strategy, ZeroStrategy):
            self.grad_memory = trainer.strategy.memory_bytes()["gradients"]
        self.params_before = {k: v.clone() for k, v in local_params(pl_module).items()}

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"]))
        if isinstance(trainer.strategy, ZeroStrategy):
            self.memory = trainer.strategy.memory_bytes()
        m = trainer.callback_metrics
        if "zero/loss_scale" in m:
            self.scales.append(float(m["zero/loss_scale"]))
            self.skipped.append(float(m["zero/skipped_steps"]))


class SaveAt(L.Callback):
    """Save to ``root`` after global step ``step``; with ``capture``, also keep the full weights and optimizer state
    saved (collective: every rank runs it)."""

    def __init__(self, step: int, root: str, capture: bool = False) -> None:
        self.step, self.root, self.capture = step, root, capture
        self.saved: dict[str, Any] = {}

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.root)
            if self.capture:
                self.saved = {"params": full_params(pl_module), "optimizer": full_optimizer(trainer)}


class DieDuringSave(L.Callback):
    """At global step ``step``, rank ``rank`` exits (``os._exit``) inside the strategy's save, in ``dcp.save``."""

    def __init__(self, step: int, root: str, rank: int = 1) -> None:
        self.step, self.root, self.rank = step, root, rank

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step != self.step:
            return
        import os

        import torch.distributed.checkpoint as dcp

        real_save = dcp.save

        def dying_save(*a: Any, **k: Any) -> Any:
            if trainer.global_rank == self.rank:
                os._exit(17)  # killed while the checkpoint is being written
            return real_save(*a, **k)

        dcp.save = dying_save  # type: ignore[assignment]
        try:
            trainer.save_checkpoint(self.root)
        finally:
            dcp.save = real_save  # type: ignore[assignment]


def local_params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    from lightning_llmopt.strategies.zero_fsdp import local

    return {k: local(p.detach()) for k, p in module.named_parameters()}


def full_params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {k: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for k, p in module.named_parameters()}


def full_optimizer(trainer: L.Trainer) -> dict[str, dict[str, torch.Tensor]]:
    """``{fqn: {state key: full tensor}}`` of the optimizer (collective)."""
    from lightning_llmopt.parallel.zero import ZeroOptimizer

    opt = trainer.strategy.optimizers[0]
    if isinstance(opt, ZeroOptimizer):
        full = opt.full_state_dict()
        return {k: {s: v for s, v in e["state"].items()} for k, e in full.get("params", {}).items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    sd = get_optimizer_state_dict(trainer.lightning_module, opt, options=StateDictOptions(full_state_dict=True))
    return {k: {s: v.reshape(-1).clone() if v.dim() else v.clone() for s, v in e.items()}
            for k, e in sd["state"].items()}


def fit(stage: int = 2, steps: int = 10, world: int = 1, init_path: str | None = None, ckpt_path: str | None = None,
        callbacks: list[L.Callback] | None = None, precision: str = "32-true", accumulate: int = 1,
        clip: float | None = None, module_kwargs: dict[str, Any] | None = None, zero: bool = True,
        strategy_kwargs: dict[str, Any] | None = None, root: str | None = None,
        num_nodes: int = 1) -> tuple[Recorder, L.Trainer]:
    """Train ``Module`` for ``steps`` steps on the same global batches whatever the world size.

    ``world > 1`` runs on the pool's existing process group (``PoolEnvironment``). ``num_nodes > 1`` runs one process
    per node through Lightning's own cluster environment detection (torchrun / ``LightningEnvironment`` variables);
    the world size is then ``num_nodes``. ``zero=False`` is the reference: Lightning's default strategy with
    Lightning's own precision plugin.
    """
    L.seed_everything(0, verbose=False)
    random.seed(0)
    recorder = Recorder()
    plugins = [ZeroPrecision(precision, device="cpu")] if zero and precision != "32-true" else None
    environment = PoolEnvironment() if world > 1 and num_nodes == 1 else None
    strategy: Any = ZeroStrategy(stage=stage, cluster_environment=environment,
                                 **(strategy_kwargs or {})) if zero else "auto"
    trainer = L.Trainer(accelerator="cpu", devices=1 if num_nodes > 1 else world, num_nodes=num_nodes,
                        strategy=strategy, max_steps=steps, logger=False, precision=None if zero else precision,
                        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
                        callbacks=[recorder, *(callbacks or [])], plugins=plugins, accumulate_grad_batches=accumulate,
                        gradient_clip_val=clip, default_root_dir=root, num_sanity_val_steps=0,
                        use_distributed_sampler=False)
    rows = GLOBAL_BATCH * accumulate * steps
    data = Tokens(rows)  # one seeded permutation; rank r takes every world-th index: the same global batches
    if num_nodes > 1:  # the process group does not exist yet: the ranks Lightning's cluster environment will use
        env = trainer.strategy.cluster_environment  # type: ignore[attr-defined]
        world, rank = num_nodes, env.node_rank() + env.local_rank()
    else:
        rank = dist.get_rank() if world > 1 else 0
    sampler = ResumableShardedSampler(data, num_replicas=world, rank=rank, seed=0)
    loader = ResumableDataLoader(data, batch_size=GLOBAL_BATCH // world, sampler=sampler, drop_last=True)
    trainer.fit(Module(init_path=init_path, **(module_kwargs or {})), train_dataloaders=loader, ckpt_path=ckpt_path)
    return recorder, trainer


def summary(recorder: Recorder, trainer: L.Trainer) -> dict[str, Any]:
    """Rank-averaged losses, full parameters and memory (every rank must call it: gathers are collectives)."""
    losses = torch.tensor(recorder.losses)
    if dist.is_initialized() and trainer.world_size > 1:
        dist.all_reduce(losses)
        losses /= trainer.world_size
    return {"losses": losses.tolist(), "params": full_params(trainer.lightning_module), "memory": recorder.memory,
            "grad_memory": recorder.grad_memory, "scales": recorder.scales, "skipped": recorder.skipped,
            "start_state": recorder.start_state, "params_before": recorder.params_before,
            "params_after": local_params(trainer.lightning_module)}


def parity_job(init_path: str, configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Several trainings, one after another, on the pool's ranks."""
    results = []
    for config in configs:
        recorder, trainer = fit(world=dist.get_world_size(), init_path=init_path, **config)
        results.append(summary(recorder, trainer))
    return results


def resume_job(init_path: str, root: str, split: int, total: int) -> dict[str, Any]:
    """Straight run saving at ``split``; resume the same stage; resume into stage 3."""
    world = dist.get_world_size()
    straight = summary(*fit(stage=2, steps=total, world=world, init_path=init_path, callbacks=[SaveAt(split, root)]))
    resumed = summary(*fit(stage=2, steps=total, world=world, init_path=init_path, ckpt_path=root))
    stage3 = summary(*fit(stage=3, steps=total, world=world, init_path=init_path, ckpt_path=root))
    saved = sorted(p.name for p in Path(root).iterdir())
    return {"straight": straight, "resumed": resumed, "stage3": stage3, "saved": saved}


def reshard_two_ranks_job(init_path: str, single_root: str, root: str, split: int, total: int) -> dict[str, Any]:
    """1 process -> 2 ranks (zero2); a zero3 run on 2 ranks saving at ``split``; zero3 -> zero1 on 2 ranks."""
    world = dist.get_world_size()
    from_single = summary(*fit(stage=2, steps=total, world=world, init_path=init_path, ckpt_path=single_root))
    save = SaveAt(split, root, capture=True)
    zero3 = summary(*fit(stage=3, steps=total, world=world, init_path=init_path, callbacks=[save]))
    zero3["saved"] = save.saved
    zero1 = summary(*fit(stage=1, steps=total, world=world, init_path=init_path, ckpt_path=root))
    return {"from_single": from_single, "zero3": zero3, "zero1": zero1}


def resume_job_any(init_path: str, ckpt_path: str, stage: int, total: int) -> dict[str, Any]:
    return summary(*fit(stage=stage, steps=total, world=dist.get_world_size(), init_path=init_path,
                        ckpt_path=ckpt_path))


def kill_during_save_job(init_path: str, root: str, good: int, bad: int, total: int) -> None:
    """Saves at step ``good`` through the strategy; rank 1 dies inside the strategy's save at step ``bad``."""
    fit(stage=2, steps=total, world=dist.get_world_size(), init_path=init_path,
        callbacks=[SaveAt(good, root), DieDuringSave(bad, root)])
