"""Local SGD, DiLoCo and bounded-staleness (SSP) data parallelism through Lightning, with an optional straggler.

    python examples/local_sgd.py --devices 2 --accelerator cpu                       # local SGD, H=4
    python examples/local_sgd.py --devices 2 --accelerator cpu --sync diloco --sync-every 8
    python examples/local_sgd.py --devices 2 --accelerator cpu --sync ssp --staleness 2 --straggler-ms 50
    torchrun --nproc-per-node=8 examples/local_sgd.py --devices 8 --sync diloco --sync-every 500 --precision bf16-mixed

At the end every rank holds the same parameters (an unfinished local-SGD period is averaged, SSP applies every step
in flight); the script prints each rank's last loss and checks that the replicas agree.
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
import torch.distributed as dist

from lightning_llmopt import CausalLMModule
from lightning_llmopt.data import TextDataModule
from lightning_llmopt.strategies import AsyncDataParallelStrategy
from lightning_llmopt.testing.stragglers import Straggler


def _strategy(args: argparse.Namespace) -> AsyncDataParallelStrategy:
    if args.sync == "bsp":
        return AsyncDataParallelStrategy("bsp", zero_stage=0)
    if args.sync == "ssp":
        return AsyncDataParallelStrategy("ssp", staleness=args.staleness)
    outer = "nesterov" if args.sync == "diloco" else "none"
    return AsyncDataParallelStrategy("local_sgd", sync_every=args.sync_every, outer_optimizer=outer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sync", default="local_sgd", choices=("bsp", "local_sgd", "diloco", "ssp"))
    parser.add_argument("--sync-every", type=int, default=4, help="local_sgd/diloco: inner steps between averages")
    parser.add_argument("--staleness", type=int, default=1, help="ssp: steps a rank may run ahead of the slowest")
    parser.add_argument("--straggler-ms", type=float, default=0.0, help="rank 1 sleeps up to this before each step")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--data", default=None, help="folder of .txt/.jsonl documents (default: Python's stdlib)")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--accelerator", default="auto")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--max-steps", type=int, default=20)
    args = parser.parse_args()

    L.seed_everything(0)
    callbacks = [Straggler([1], args.straggler_ms / 1e3)] if args.straggler_ms > 0 else []
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=_strategy(args),
        precision=args.precision,
        max_steps=args.max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        limit_val_batches=0,
        callbacks=callbacks,
    )
    module = CausalLMModule(args.model, warmup_steps=5)
    trainer.fit(module, TextDataModule(data_path=args.data, seq_len=128, batch_size=4))
    loss = float(trainer.callback_metrics["train/loss"])
    flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    spread = flat.clone()
    if dist.is_initialized():
        lowest = flat.clone()
        dist.all_reduce(spread, op=dist.ReduceOp.MAX)
        dist.all_reduce(lowest, op=dist.ReduceOp.MIN)
        spread -= lowest
    else:
        spread.zero_()
    print(
        f"rank {trainer.global_rank}: {args.sync}, last loss {loss:.4f}, "
        f"max parameter difference between replicas {float(spread.abs().max()):.1e}"
    )


if __name__ == "__main__":
    main()
