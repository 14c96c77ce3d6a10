"""Jobs for tests/models/test_hf_pretrained.py: ``CausalLMModule(pretrained=folder)`` trained by Lightning inside
the gloo pool (ZeRO-3 over 2 ranks, TP=2, PP=2) and in one process, on the same global batches."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from lightning_llmopt import CausalLMModule
from lightning_llmopt.data.sampler import ResumableDataLoader, ResumableShardedSampler
from lightning_llmopt.strategies import NDParallelStrategy, ZeroStrategy
from lightning_llmopt.testing.lightning_env import PoolEnvironment

SEQ, GLOBAL_BATCH, STEPS = 16, 4, 4
LR = 3e-4  # CausalLMModule's default peak rate (tests/strategies/_nd_jobs.py explains why not larger)


class Tokens(Dataset):
    def __init__(self, rows: int, vocab: int) -> None:
        self.data = torch.randint(0, vocab, (rows, SEQ + 1), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.data[i, :-1], "labels": self.data[i, 1:]}


class Losses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.first_batch: dict[str, torch.Tensor] = {}

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, i: int) -> None:
        if not self.first_batch:
            self.first_batch = {k: v.clone() for k, v in batch.items()}

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.losses.append(float(args[1]["loss"]))


def _strategy(layout: str | None) -> Any:
    if layout is None:
        return "auto"
    if layout == "zero3":
        return ZeroStrategy(stage=3, cluster_environment=PoolEnvironment())
    if layout == "tp2":
        return NDParallelStrategy(cluster_environment=PoolEnvironment(), tensor_parallel=2)
    if layout == "pp2":  # default schedule (1f1b) and ZeRO stage (3: built on meta, like ZeRO-3 and TP)
        return NDParallelStrategy(cluster_environment=PoolEnvironment(), pipeline_parallel=2, microbatches=2)
    if layout == "pp2_interleaved":  # V=2 stages per rank, default ZeRO-2: built on the CPU, not on meta
        return NDParallelStrategy(
            cluster_environment=PoolEnvironment(), pipeline_parallel=2, microbatches=2, schedule="interleaved_1f1b"
        )
    raise ValueError(layout)


def fit(folder: str, layout: str | None) -> dict[str, Any]:
    """Fine-tune the folder's model for ``STEPS`` steps; the mean loss per step over the ranks and the first loss
    (the pretrained weights' own loss)."""
    from torch.distributed.tensor import DTensor

    L.seed_everything(0, verbose=False)
    world = dist.get_world_size() if layout is not None else 1
    recorder = Losses()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=_strategy(layout),
        max_steps=STEPS,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=[recorder],
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
    )
    module = CausalLMModule(pretrained=folder, warmup_steps=1, learning_rate=LR, max_steps=100)
    dp = world if layout == "zero3" else 1
    rank = dist.get_rank() if layout == "zero3" else 0
    data = Tokens(GLOBAL_BATCH * STEPS, module.config.vocab_size)
    sampler = ResumableShardedSampler(data, num_replicas=dp, rank=rank, seed=0)
    loader = ResumableDataLoader(data, batch_size=GLOBAL_BATCH // dp, sampler=sampler, drop_last=True)
    trainer.fit(module, train_dataloaders=loader)
    losses = torch.tensor(recorder.losses)
    if layout is not None:
        dist.all_reduce(losses)
        losses /= world
    params = {
        k: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for k, p in trainer.lightning_module.named_parameters()
    }
    if layout is not None and layout.startswith("pp2"):  # each rank holds its stages' parameters: the union
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, params)
        params = {k: v for part in gathered for k, v in part.items()}
    module = trainer.lightning_module
    read = getattr(module, "pretrained_elements_read", None)  # set when the weights were read into the shards
    return {"losses": losses.tolist(), "params": params, "first_batch": recorder.first_batch, "read": read}


def parity_job(folders: list[str], layouts: list[str]) -> list[dict[str, Any]]:
    return [fit(folder, layout) for folder in folders for layout in layouts]


def error_of(folder: str, layout: str) -> str:
    """The error ``fit`` raises on this rank (``"no error"`` if none)."""
    try:
        fit(folder, layout)
    except Exception as exc:  # noqa: BLE001 - the message is the result
        return f"{type(exc).__name__}: {exc}"
    return "no error"
