"""Train the reference decoder with data x tensor x context parallelism and ZeRO on one device mesh.

    python examples/nd_parallel.py --devices 2 --accelerator cpu --tensor-parallel 2
    python examples/nd_parallel.py --devices 4 --accelerator cpu --tensor-parallel 2 --context-parallel 2
    python examples/nd_parallel.py --devices 2 --accelerator cpu --context-parallel 2 --mode ulysses --zero-stage 0
    torchrun --nproc-per-node=8 examples/nd_parallel.py --devices 8 --model 1b --tensor-parallel 2 \\
        --context-parallel 2 --seq-len 8192 --precision bf16-mixed

Data parallelism takes the remaining ranks (``data_parallel="auto"``). The data loader is split over the
data-parallel ranks only (Lightning's distributed sampler asks the strategy), so the tensor- and context-parallel
ranks of one group read the same rows; the strategy splits each row's sequence for context parallelism.
"""

from __future__ import annotations

import argparse

import lightning as L
from torch.utils.data import DataLoader

from lightning_llmopt import CausalLMModule
from lightning_llmopt.strategies import NDParallelStrategy
from lightning_llmopt.testing.data import RandomTokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--accelerator", default="auto")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--tensor-parallel", type=int, default=1)
    parser.add_argument("--context-parallel", type=int, default=1)
    parser.add_argument("--mode", default="ring", choices=("ring", "ulysses"), help="context-parallel exchange")
    parser.add_argument("--zero-stage", type=int, default=3, choices=(0, 1, 2, 3))
    parser.add_argument("--no-sequence-parallel", action="store_true")
    parser.add_argument("--activation-checkpointing", default="none")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=2, help="rows per data-parallel group")
    parser.add_argument("--max-steps", type=int, default=10)
    parser.add_argument("--checkpoint-dir", default=None, help="save a (reshardable) checkpoint there at the end")
    args = parser.parse_args()

    L.seed_everything(0)
    strategy = NDParallelStrategy(
        tensor_parallel=args.tensor_parallel,
        context_parallel=args.context_parallel,
        context_parallel_mode=args.mode,
        zero_stage=args.zero_stage,
        sequence_parallel=not args.no_sequence_parallel,
        activation_checkpointing=args.activation_checkpointing,
    )
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy=strategy,
        precision=args.precision,
        max_steps=args.max_steps,
        logger=False,
        enable_checkpointing=False,
        limit_val_batches=0,
    )
    module = CausalLMModule(args.model, model_overrides={"max_seq_len": max(args.seq_len, 256)}, warmup_steps=2)
    rows = args.batch_size * args.max_steps * args.devices * args.num_nodes
    loader = DataLoader(RandomTokens(module.config.vocab_size, args.seq_len, rows), batch_size=args.batch_size)
    trainer.fit(module, loader)
    if trainer.global_rank == 0:
        print(f"mesh: {strategy.device_mesh}")
    if args.checkpoint_dir:
        trainer.save_checkpoint(args.checkpoint_dir)  # every rank writes its shards: checkpoint_dir/step-N


if __name__ == "__main__":
    main()
