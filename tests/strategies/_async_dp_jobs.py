"""Jobs and the single-process oracle for tests/strategies/test_async_dp.py.

``fit`` trains ``Module`` (``CausalLMModule("tiny")`` with a constant-rate inner optimizer) under
``AsyncDataParallelStrategy`` inside the gloo pool; every rank reads its own shard of the same global batches.
``simulate`` is the rule written out in one process with K model replicas, written from the papers' update rules
and not from the strategy's code: replica ``r`` reads the rows rank ``r`` reads and steps its own optimizer; local
SGD averages every H steps (DiLoCo: outer Nesterov on ``anchor - mean``, by hand rather than torch's SGD); SSP
replaces each replica's own change of step ``t - s - 1`` by the mean change before step ``t``.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist

from lightning_llmopt import CausalLMModule
from lightning_llmopt.data.sampler import ResumableDataLoader, ResumableShardedSampler
from lightning_llmopt.strategies import AsyncDataParallelStrategy
from lightning_llmopt.testing.lightning_env import PoolEnvironment
from lightning_llmopt.testing.stragglers import Straggler

if "_nd_jobs" not in sys.modules:
    _spec = importlib.util.spec_from_file_location("_nd_jobs", Path(__file__).with_name("_nd_jobs.py"))
    assert _spec is not None and _spec.loader is not None
    sys.modules["_nd_jobs"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules["_nd_jobs"])
J: Any = sys.modules["_nd_jobs"]

GLOBAL_BATCH = 4


class Module(CausalLMModule):
    """``tiny`` with a constant learning rate: ``"sgd"`` (momentum 0.9, lr 0.05) or ``"adamw"`` (lr 1e-3)."""

    def __init__(self, init_path: str | None = None, opt: str = "adamw") -> None:
        super().__init__("tiny")
        self.init_path, self.opt = init_path, opt

    def configure_optimizers(self) -> Any:
        assert self.model is not None
        if self.opt == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        return torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.01)

    def on_fit_start(self) -> None:
        J.load_initial_weights(self, self.init_path)


def loader(steps: int, world: int, rank: int) -> ResumableDataLoader:
    data = J.Tokens(GLOBAL_BATCH * steps)
    sampler = ResumableShardedSampler(data, num_replicas=world, rank=rank, seed=0)
    return ResumableDataLoader(data, batch_size=GLOBAL_BATCH // world, sampler=sampler, drop_last=True)


def fit(
    strategy: dict[str, Any],
    steps: int,
    init_path: str,
    opt: str = "adamw",
    ckpt_path: str | None = None,
    callbacks: list[L.Callback] | None = None,
    clip: float | None = None,
    data_steps: int | None = None,
) -> tuple[Any, L.Trainer]:
    L.seed_everything(0, verbose=False)
    recorder = J.Recorder()
    world = dist.get_world_size()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=AsyncDataParallelStrategy(cluster_environment=PoolEnvironment(), **strategy),
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=[recorder, *(callbacks or [])],
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
        gradient_clip_val=clip,
    )
    module = Module(init_path, opt)
    trainer.fit(module, train_dataloaders=loader(data_steps or steps, world, dist.get_rank()), ckpt_path=ckpt_path)
    return recorder, trainer


def per_rank(recorder: Any, trainer: L.Trainer) -> dict[str, Any]:
    """This rank's losses and parameters (plain tensors: data parallelism only)."""
    params = {k: p.detach().clone() for k, p in trainer.lightning_module.named_parameters()}
    return {"losses": list(recorder.losses), "params": params}


def runs_job(init_path: str, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Several fits one after another; each run: ``{"strategy": {...}, "steps": n, "opt": ..., "clip": ...}``."""
    out = []
    for run in runs:
        result = per_rank(*fit(run["strategy"], run["steps"], init_path, run.get("opt", "adamw"), clip=run.get("clip")))
        out.append(result)
    return out


def traced_ssp_job(init_path: str, staleness: int, steps: int, slow: list[int], max_delay: float) -> dict[str, Any]:
    """SSP under injected delays on ``slow`` ranks, with every read's (own step, slowest step) recorded."""
    straggler = Straggler(slow, max_delay, seed=staleness)
    strategy = {"data_parallel_sync": "ssp", "staleness": staleness, "trace_staleness": True}
    recorder, trainer = fit(strategy, steps, init_path, callbacks=[straggler])
    result = per_rank(recorder, trainer)
    result["reads"] = list(trainer.strategy.sync.reads)  # type: ignore[attr-defined]
    return result


def resume_job(init_path: str, root: str, strategy: dict[str, Any], split: int, total: int) -> dict[str, Any]:
    """An uninterrupted run, a run saving after step ``split`` (stopped there), and a resume of it to ``total``."""
    whole = per_rank(*fit(strategy, total, init_path))
    saver = J.SaveAt(split, root)
    fit(strategy, split, init_path, callbacks=[saver], data_steps=total)
    resumed = per_rank(*fit(strategy, total, init_path, ckpt_path=root))
    return {"whole": whole, "resumed": resumed}


# ---------------------------------------------------------------------------------------------- the oracle
def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@torch.no_grad()
def _set(model: torch.nn.Module, flat: torch.Tensor) -> None:
    offset = 0
    for p in model.parameters():
        p.copy_(flat[offset : offset + p.numel()].view_as(p))
        offset += p.numel()


def simulate(
    init_path: str,
    world: int,
    steps: int,
    mode: str,
    opt: str = "adamw",
    sync_every: int = 1,
    staleness: int = 0,
    outer: tuple[float, float] | None = None,
) -> list[dict[str, Any]]:
    """K replicas in one process; returns per replica ``{"losses", "params"}`` as :func:`per_rank` does."""
    L.seed_everything(0, verbose=False)
    replicas = []
    for _ in range(world):
        module = Module(init_path, opt)
        module.configure_model()
        module.load_state_dict(torch.load(init_path, weights_only=True))
        replicas.append((module, module.configure_optimizers()))
    iters = [iter(loader(steps, world, r)) for r in range(world)]
    losses: list[list[float]] = [[] for _ in range(world)]
    anchor = _flat(replicas[0][0]).clone()
    momentum = torch.zeros_like(anchor)
    changes: list[list[torch.Tensor]] = []  # per step, per replica (SSP)
    for t in range(steps):
        if mode == "ssp" and t - staleness - 1 >= 0:
            _ssp_apply(replicas, changes[t - staleness - 1], world)
        step_changes = []
        for r, (module, optimizer) in enumerate(replicas):
            before = _flat(module).clone()
            loss = module.train_loss(next(iters[r]))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses[r].append(float(loss.detach()))
            step_changes.append(_flat(module) - before)
        changes.append(step_changes)
        if mode == "local_sgd" and (t + 1) % sync_every == 0:
            anchor = _local_sgd_sync(replicas, anchor, momentum, outer)
    if mode == "local_sgd" and steps % sync_every:
        avg = sum(_flat(m) for m, _ in replicas) / world  # the unfinished period: a plain average
        for m, _ in replicas:
            _set(m, avg)
    if mode == "ssp":
        for t in range(max(steps - staleness - 1, 0), steps):
            _ssp_apply(replicas, changes[t], world)
    return [
        {"losses": losses[r], "params": {k: p.detach().clone() for k, p in m.named_parameters()}}
        for r, (m, _) in enumerate(replicas)
    ]


def _local_sgd_sync(
    replicas: list[Any], anchor: torch.Tensor, momentum: torch.Tensor, outer: tuple[float, float] | None
) -> torch.Tensor:
    avg = sum(_flat(m) for m, _ in replicas) / len(replicas)
    if outer is not None:  # DiLoCo: Nesterov momentum SGD on the pseudo-gradient anchor - avg
        lr, mu = outer
        delta = anchor - avg
        momentum.mul_(mu).add_(delta)
        avg = anchor - lr * (delta + mu * momentum)
    for m, _ in replicas:
        _set(m, avg)
    return avg.clone()


def _ssp_apply(replicas: list[Any], step_changes: list[torch.Tensor], world: int) -> None:
    mean = sum(step_changes) / world
    for (m, _), own in zip(replicas, step_changes, strict=True):
        _set(m, _flat(m) + (mean - own))


class _SigtermAt(L.Callback):
    """Marks SIGTERM as received on ``rank`` after global step ``step`` (what Lightning's signal handler does)."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            trainer._signal_connector.received_sigterm = True


class _SleepOn(L.Callback):
    def __init__(self, rank: int, seconds: float) -> None:
        self.rank, self.seconds = rank, seconds

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_rank == self.rank:
            time.sleep(self.seconds)


def sigterm_job(init_path: str) -> dict[str, Any]:
    """Local SGD with no synchronisation in the run: rank 1 receives SIGTERM after step 1; every rank must stop. Rank
    0 sleeps 0.5 s before each batch so that it cannot finish the run (and wait in the final average) first."""
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    strategy = {"data_parallel_sync": "local_sgd", "sync_every": 100}
    try:
        fit(strategy, 8, init_path, callbacks=[_SigtermAt(1, 1), _SleepOn(0, 0.5)])
    except SIGTERMException:
        return {"stopped": True}
    return {"stopped": False}


def wrong_resume_job(init_path: str, root: str) -> str:
    """Save under DiLoCo, resume under SSP: the error names both."""
    strategy = {"data_parallel_sync": "local_sgd", "sync_every": 3, "outer_optimizer": "nesterov"}
    fit(strategy, 2, init_path, callbacks=[J.SaveAt(2, root)], data_steps=4)
    try:
        fit({"data_parallel_sync": "ssp", "staleness": 1}, 4, init_path, ckpt_path=root)
    except ValueError as err:
        return str(err)
    return "no error"
