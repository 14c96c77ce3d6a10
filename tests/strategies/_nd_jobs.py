"""Jobs for tests/strategies/test_nd_parallel.py: Lightning runs of ``NDParallelStrategy`` inside the gloo pool.

A pool worker already belongs to a process group, so the Trainer gets a cluster environment that reports the
group's ranks and says the processes were created externally: Lightning launches nothing and reuses the group.
Every run sees the same global batches: rows are split over the data-parallel ranks only; tensor- and
context-parallel ranks of one data-parallel group read the same rows (the strategy shards the sequence).
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
from lightning_llmopt.parallel.mesh import ParallelDims
from lightning_llmopt.strategies import NDParallelStrategy
from lightning_llmopt.testing.lightning_env import PoolEnvironment

SEQ, GLOBAL_BATCH, VOCAB, STEPS = 16, 4, 320, 5
# 3e-4 (CausalLMModule's default peak rate). At 3e-3 AdamW's normalised step amplifies fp32 rounding in the few
# weights whose gradient is ~1e-8 (Adam's eps): there even fp32 against fp64 single-process training differs by
# ~4e-6 after 5 steps, so no fp32 parallel run could be compared to 1e-6.
LR = 3e-4


class Tokens(Dataset):
    """Fixed random rows; ``packed``: each row also holds 1-4 documents of random lengths (``doc_ids``)."""

    def __init__(self, rows: int, packed: bool = False, seq: int = SEQ) -> None:
        g = torch.Generator().manual_seed(0)
        self.data = torch.randint(0, VOCAB, (rows, seq + 1), generator=g)
        self.docs = None
        if packed:
            cuts = torch.rand(rows, seq, generator=g) < 0.2  # a new document starts where True
            cuts[:, 0] = False
            self.docs = cuts.long().cumsum(dim=1)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        item = {"input_ids": self.data[i, :-1], "labels": self.data[i, 1:]}
        if self.docs is not None:
            item["doc_ids"] = self.docs[i]
        return item


def load_initial_weights(module: L.LightningModule, path: str | None) -> None:
    """Every layout starts from the same full weights (a fresh run; a resumed run has its checkpoint).

    Only a pipeline stage may hold a subset of the file's entries: elsewhere an entry the module lacks (e.g. a
    4-block file read into the default 2-block module) is an error, not silently skipped."""
    if path is not None and module.trainer.ckpt_path is None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        full = torch.load(path, weights_only=True)
        own = set(module.state_dict())  # a pipeline stage holds a subset, under the full model's names
        extra = sorted(set(full) - own)
        if extra and getattr(getattr(module.trainer.strategy, "dims", None), "pp", 1) == 1:
            raise ValueError(f"{path} holds {len(extra)} entries the module lacks (e.g. {extra[:3]})")
        set_model_state_dict(
            module, {k: v for k, v in full.items() if k in own}, options=StateDictOptions(full_state_dict=True)
        )


class Module(CausalLMModule):
    """``CausalLMModule("tiny")`` starting from given full weights."""

    def __init__(self, init_path: str | None = None, **kwargs: Any) -> None:
        super().__init__("tiny", warmup_steps=2, learning_rate=LR, max_steps=100, **kwargs)
        self.init_path = init_path

    def on_fit_start(self) -> None:
        load_initial_weights(self, self.init_path)


class HFModule(L.LightningModule):
    """A transformers ``LlamaForCausalLM`` (tiny random config) built in ``configure_model``, trained with the
    vocab-parallel loss (plain ``F.cross_entropy`` when the logits are not sharded)."""

    def __init__(self, init_path: str | None = None) -> None:
        super().__init__()
        self.init_path = init_path
        self.model: Any = None

    def configure_model(self) -> None:
        import transformers

        if self.model is None:
            cfg = transformers.LlamaConfig(
                vocab_size=VOCAB,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=64,
                attn_implementation="eager",
            )
            self.model = transformers.LlamaForCausalLM(cfg)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        from lightning_llmopt.parallel.vocab_parallel import vocab_parallel_cross_entropy

        return vocab_parallel_cross_entropy(self.model(input_ids=batch["input_ids"]).logits, batch["labels"])

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=LR)

    def on_fit_start(self) -> None:
        load_initial_weights(self, self.init_path)


class Recorder(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.start_params: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.ckpt_path is not None:
            self.start_params = full_params(pl_module)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.losses.append(float(outputs["loss"]))


class SaveAt(L.Callback):
    """Save to ``root`` after global step ``step``, keeping the full weights saved (collective)."""

    def __init__(self, step: int, root: str) -> None:
        self.step, self.root = step, root
        self.saved: dict[str, torch.Tensor] = {}

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.root)
            self.saved = full_params(pl_module)
            if getattr(getattr(trainer.strategy, "dims", None), "pp", 1) > 1:
                self.saved = union_over_ranks(self.saved)


def full_params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {
        k: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for k, p in module.named_parameters()
    }


def fit(
    nd: dict[str, Any] | None = None,
    steps: int = STEPS,
    packed: bool = False,
    init_path: str | None = None,
    ckpt_path: str | None = None,
    callbacks: list[L.Callback] | None = None,
    root: str | None = None,
    clip: float | None = None,
    module_kwargs: dict[str, Any] | None = None,
    hf: bool = False,
    seq: int = SEQ,
    strategy_cls: Any = NDParallelStrategy,
    trainer_kwargs: dict[str, Any] | None = None,
) -> tuple[Recorder, L.Trainer]:
    """Train ``Module`` on the same global batches whatever the layout; ``nd=None`` is the single-process reference
    (Lightning's default strategy). ``strategy_cls(**nd)`` builds the strategy (e.g. ``ZeroStrategy``, whose
    ranks are all data-parallel); ``trainer_kwargs`` go to the ``Trainer`` (``precision``, ``plugins``)."""
    L.seed_everything(0, verbose=False)
    random.seed(0)
    recorder = Recorder()
    world = dist.get_world_size() if nd is not None else 1
    strategy: Any = strategy_cls(cluster_environment=PoolEnvironment(), **nd) if nd is not None else "auto"
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[recorder, *(callbacks or [])],
        default_root_dir=root,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
        gradient_clip_val=clip,
        **{"enable_checkpointing": False, **(trainer_kwargs or {})},  # a ModelCheckpoint needs it True
    )
    dp, rank = 1, 0
    if nd is not None:
        names = ("data_parallel", "tensor_parallel", "context_parallel", "pipeline_parallel")
        degrees = {k: v for k, v in nd.items() if k in names}
        dims = ParallelDims.resolve(world, **degrees)
        dp, rank = dims.dp, dims.coordinates(dist.get_rank())["dp"]
    data = Tokens(GLOBAL_BATCH * steps, packed=packed, seq=seq)
    sampler = ResumableShardedSampler(data, num_replicas=dp, rank=rank, seed=0)
    loader = ResumableDataLoader(data, batch_size=GLOBAL_BATCH // dp, sampler=sampler, drop_last=True)
    module = HFModule(init_path) if hf else Module(init_path=init_path, **(module_kwargs or {}))
    trainer.fit(module, train_dataloaders=loader, ckpt_path=ckpt_path)
    return recorder, trainer


def summary(recorder: Recorder, trainer: L.Trainer) -> dict[str, Any]:
    """Losses averaged over all ranks (every rank holds the mean over its tokens; TP ranks agree) and full
    parameters (collective)."""
    losses = torch.tensor(recorder.losses)
    if dist.is_initialized() and trainer.world_size > 1:
        dist.all_reduce(losses)
        losses /= trainer.world_size
    params, start = full_params(trainer.lightning_module), recorder.start_params
    if getattr(getattr(trainer.strategy, "dims", None), "pp", 1) > 1:  # each rank holds its stages: the union
        params, start = union_over_ranks(params), union_over_ranks(start)
    mine = int(getattr(trainer.lightning_module, "tokens_seen", 0))  # HFModule has no counter
    seen = [mine]
    if dist.is_initialized() and trainer.world_size > 1:
        seen = [0] * trainer.world_size
        dist.all_gather_object(seen, mine)
    return {"losses": losses.tolist(), "params": params, "start_params": start, "tokens_seen": seen}


def union_over_ranks(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, tensors)
    out: dict[str, torch.Tensor] = {}
    for part in gathered:
        out.update(part)
    return out


def parity_job(init_paths: dict[str, str], configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Several trainings, one after another, on the pool's ranks; each config holds ``fit`` arguments
    (``{"nd": {...}, "packed": bool, "hf": bool, "clip": float}``)."""
    out = []
    for config in configs:
        recorder, trainer = fit(init_path=init_paths["hf" if config.get("hf") else "llmopt"], **config)
        result = summary(recorder, trainer)
        result["memory"] = trainer.strategy.memory_bytes()  # type: ignore[attr-defined]
        out.append(result)
    return out


def reshard_job(
    init_path: str,
    root: str,
    save: dict[str, Any],
    load: dict[str, Any],
    split: int,
    total: int,
    module_kwargs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A run under ``save`` saving at ``split``; a run under ``load`` resuming from it (same pool)."""
    saver = SaveAt(split, root)
    straight = summary(*fit(save, steps=total, init_path=init_path, callbacks=[saver], module_kwargs=module_kwargs))
    resumed = summary(*fit(load, steps=total, init_path=init_path, ckpt_path=root, module_kwargs=module_kwargs))
    return {
        "straight": straight,
        "saved": saver.saved,
        "resumed": resumed,
        "folders": sorted(p.name for p in Path(root).iterdir()),
    }


def validate(
    nd: dict[str, Any] | None, init_path: str, module_kwargs: dict[str, Any] | None = None
) -> dict[str, float]:
    """``Trainer.validate`` of ``Module`` on 8 packed rows from the given weights: ``val/loss`` and ``val/ppl``
    (the vocab-parallel loss, the perplexity metric and its cross-rank sync)."""

    class Validated(Module):
        def on_validation_start(self) -> None:
            load_initial_weights(self, self.init_path)

    L.seed_everything(0, verbose=False)
    world = dist.get_world_size() if nd is not None else 1
    strategy: Any = NDParallelStrategy(cluster_environment=PoolEnvironment(), **nd) if nd is not None else "auto"
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    loader = torch.utils.data.DataLoader(Tokens(8, packed=True), batch_size=8)
    (metrics,) = trainer.validate(Validated(init_path=init_path, **(module_kwargs or {})), loader, verbose=False)
    return {k: float(v) for k, v in metrics.items()}


def fit_then_validate(nd: dict[str, Any] | None, init_path: str) -> dict[str, float]:
    """``Trainer.fit`` for 2 steps, then ``Trainer.validate`` on the same trainer (the strategy's setup runs twice)."""
    _, trainer = fit(nd, steps=2, init_path=init_path)
    loader = torch.utils.data.DataLoader(Tokens(8, packed=True), batch_size=8)
    (metrics,) = trainer.validate(trainer.lightning_module, loader, verbose=False)
    return {k: float(v) for k, v in metrics.items()}


def fit_validate_and_save(nd: dict[str, Any], init_path: str, out: str, module_kwargs: dict[str, Any]) -> float:
    """``fit`` (5 steps) then ``validate`` on the same trainer; the final weights (the union over the stages) are
    written to ``out`` by rank 0. Returns ``val/loss``."""
    _, trainer = fit(nd, init_path=init_path, module_kwargs=module_kwargs)
    loader = torch.utils.data.DataLoader(Tokens(8, packed=True), batch_size=8)
    (metrics,) = trainer.validate(trainer.lightning_module, loader, verbose=False)
    params = union_over_ranks(full_params(trainer.lightning_module))
    if dist.get_rank() == 0:
        torch.save(params, out)
    dist.barrier()
    return float(metrics["val/loss"])


def fit_then_validate_job(init_path: str, layouts: list[dict[str, Any]]) -> list[dict[str, float]]:
    return [fit_then_validate(nd, init_path) for nd in layouts]


def validate_job(init_path: str, layouts: list[dict[str, Any]]) -> list[dict[str, float]]:
    return [validate(nd, init_path) for nd in layouts]
