"""One torchrun launch of tests/strategies/test_multigpu_parity.py: every layout of one world size, trained in turn.

Started as ``python -m torch.distributed.run --nproc-per-node=N _multigpu_job.py --layouts JSON --out FILE``. Each
layout is a fresh ``lightning.Trainer`` + ``CausalLMModule`` built from ``seed_everything(0)`` alone (nothing is
loaded: the same seed gives the same weights under every layout), trained for ``--steps`` optimizer steps on the
same global batches (:class:`Affine`: learnable, so a missing or doubled gradient shows in the loss curve), with the
fused kernels the module picks by default on the device. Rank 0 writes ``{name: {"losses": [...], "kernels": [...]}``
or ``{name: {"error": ...}}``; a layout that fails does not stop the ones after it.

``--device cpu`` runs the same code on gloo (a check of the script itself; CI runs the CPU parity tests instead).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import traceback
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from lightning_llmopt import CausalLMModule
from lightning_llmopt.data.sampler import ResumableDataLoader, ResumableShardedSampler
from lightning_llmopt.parallel.mesh import ParallelDims

# head_dim 64, GQA 8:4 (TP up to 4), 4 layers (PP up to 4); dims that every fused kernel takes.
MODEL: dict[str, Any] = {"dim": 512, "n_layers": 4, "n_heads": 8, "n_kv_heads": 4, "ffn_hidden_dim": 1536,
                         "vocab_size": 256, "max_seq_len": 256}
MOE = {"moe": {"num_experts": 4, "top_k": 2, "num_shared_experts": 1}}
SEQ = 256
GLOBAL_BATCH = 8
LR = 1e-3  # 2e-3 spiked (bf16 and fp32 one-GPU curves 0.39 apart at step 11 on an H200); 1e-3 falls smoothly


class Affine(Dataset):
    """Rows of ``x[i+1] = (5 x[i] + 17) mod V`` from a random start, one token in ten replaced at random: a model
    learns the map within a few steps, so the loss falls from ln V toward the noise's entropy."""

    def __init__(self, rows: int, seq: int = SEQ, vocab: int = MODEL["vocab_size"]) -> None:
        g = torch.Generator().manual_seed(1234)
        x = torch.empty(rows, seq + 1, dtype=torch.long)
        x[:, 0] = torch.randint(0, vocab, (rows,), generator=g)
        for i in range(seq):
            x[:, i + 1] = (5 * x[:, i] + 17) % vocab
        noise = torch.rand(rows, seq + 1, generator=g) < 0.1
        x[noise] = torch.randint(0, vocab, (int(noise.sum()),), generator=g)
        self.data = x

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.data[i, :-1], "labels": self.data[i, 1:]}


class LossRecorder(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *args: Any) -> None:
        self.losses.append(float(outputs["loss"]))


def _strategy(layout: dict[str, Any], world: int, rank: int) -> tuple[Any, int, int]:
    """``(strategy, dp, dp rank)``: ``{"single": True}`` is Lightning's default one-device strategy, ``{"ddp": True}``
    Lightning's DDP, ``{"zero": s}`` ``ZeroStrategy(stage=s)``, ``{"async": mode}`` ``AsyncDataParallelStrategy``;
    anything else is ``NDParallelStrategy(**layout)``."""
    from lightning_llmopt.strategies import AsyncDataParallelStrategy, NDParallelStrategy, ZeroStrategy

    if layout.get("single"):
        return "auto", 1, 0
    if layout.get("ddp"):
        return "ddp", world, rank
    if "zero" in layout:
        return ZeroStrategy(stage=layout["zero"]), world, rank
    if "async" in layout:
        return AsyncDataParallelStrategy(data_parallel_sync=layout["async"]), world, rank
    names = ("data_parallel", "tensor_parallel", "context_parallel", "pipeline_parallel")
    dims = ParallelDims.resolve(world, **{k: v for k, v in layout.items() if k in names})
    return NDParallelStrategy(**layout), dims.dp, dims.coordinates(rank)["dp"]


def train(layout: dict[str, Any], model: str, steps: int, precision: str, accelerator: str) -> dict[str, Any]:
    """``steps`` optimizer steps of the model under ``layout``: the loss of every step (mean over ranks) and the
    fused kernels the module ran."""
    world = int(os.environ.get("WORLD_SIZE", "1")) if not layout.get("single") else 1
    rank = int(os.environ.get("RANK", "0"))
    L.seed_everything(0, verbose=False)
    random.seed(0)
    strategy, dp, dp_rank = _strategy(layout, world, rank)
    recorder = LossRecorder()
    trainer = L.Trainer(
        accelerator=accelerator, devices=world, strategy=strategy, precision=precision, max_steps=steps,
        logger=False, enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
        callbacks=[recorder], num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False,
    )
    data = Affine(steps * GLOBAL_BATCH)
    sampler = ResumableShardedSampler(data, num_replicas=dp, rank=dp_rank, seed=0)
    loader = ResumableDataLoader(data, batch_size=GLOBAL_BATCH // dp, sampler=sampler, drop_last=True)
    overrides = {**MODEL, **(MOE if model == "moe" else {})}
    module = CausalLMModule("tiny", model_overrides=overrides, learning_rate=LR, warmup_steps=2, max_steps=steps)
    trainer.fit(module, train_dataloaders=loader)
    loss = torch.tensor(recorder.losses, dtype=torch.float64)
    if world > 1:
        loss = loss.to(trainer.strategy.root_device)
        dist.all_reduce(loss)
        loss = (loss / world).cpu()
    return {"losses": loss.tolist(), "kernels": list(module.config.fused_kernels or [])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", required=True, help='JSON list of [name, layout, model] (model "llama"|"moe")')
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--device", default="gpu", choices=("gpu", "cpu"))
    args = parser.parse_args()
    for pattern in (".*does not have many workers.*", ".*barebones.*", ".*FSDP.*", ".*DTensor random.*"):
        warnings.filterwarnings("ignore", message=pattern)
    torch.set_float32_matmul_precision("highest")  # fp32 references stay fp32 (no TF32)
    rank = int(os.environ.get("RANK", "0"))
    results: dict[str, Any] = {}
    for name, layout, model in json.loads(args.layouts):
        try:
            results[name] = train(layout, model, args.steps, args.precision, args.device)
        except Exception as err:  # noqa: BLE001 - recorded per layout; the test names it
            traceback.print_exc()
            results[name] = {"error": f"{type(err).__name__}: {str(err).strip()[:800]}"}
        print(f"[rank {rank}] {name}: {results[name]}", flush=True)
        if rank == 0:  # after every layout: a launch killed by its time limit still leaves what ran
            args.out.write_text(json.dumps(results))
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
