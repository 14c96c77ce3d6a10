"""Train the reference decoder with pipeline parallelism (optionally x data parallelism and ZeRO) in Lightning.

    python examples/pipeline.py --devices 2 --accelerator cpu --pipeline-parallel 2 --schedule 1f1b --microbatches 4
    python examples/pipeline.py --devices 4 --accelerator cpu --pipeline-parallel 2 --schedule zbv --microbatches 4
    python examples/pipeline.py --devices 4 --accelerator cpu --pipeline-parallel 2 --schedule pipedream_2bw \\
        --microbatches 4     # PipeDream-2BW: no flush, gradients applied one step late (docs/pipeline.md)
    torchrun --nproc-per-node=8 examples/pipeline.py --devices 8 --model 1b --pipeline-parallel 4 \\
        --schedule interleaved_1f1b --virtual-stages 2 --microbatches 16 --precision bf16-mixed

``training_step`` is CausalLMModule's, unchanged: the strategy splits the model into stages, each batch into
micro-batches, runs the schedule and logs the mean loss on every rank. Data parallelism takes the remaining ranks.
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
    parser.add_argument("--layers", type=int, default=4, help="override the preset's block count (0: keep)")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--accelerator", default="auto")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--pipeline-parallel", type=int, default=2)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--virtual-stages", type=int, default=None)
    parser.add_argument("--split", default="layers", choices=("layers", "cost"))
    parser.add_argument("--balance-ends", action="store_true", help="Llama-3 balancing of the first/last stage")
    parser.add_argument("--zero-stage", type=int, default=0, choices=(0, 1, 2, 3))
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=4, help="rows per data-parallel rank")
    parser.add_argument("--max-steps", type=int, default=10)
    args = parser.parse_args()

    L.seed_everything(0)
    strategy = NDParallelStrategy(
        pipeline_parallel=args.pipeline_parallel,
        schedule=args.schedule,
        microbatches=args.microbatches,
        virtual_stages=args.virtual_stages,
        pipeline_split=args.split,
        pipeline_balance_ends=args.balance_ends,
        zero_stage=args.zero_stage,
    )
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=strategy,
        precision=args.precision,
        max_steps=args.max_steps,
        logger=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        gradient_clip_val=1.0,
    )
    overrides = {"max_seq_len": max(args.seq_len, 256), **({"n_layers": args.layers} if args.layers else {})}
    module = CausalLMModule(args.model, model_overrides=overrides, warmup_steps=2)
    rows = args.batch_size * args.max_steps * args.devices
    loader = DataLoader(RandomTokens(module.config.vocab_size, args.seq_len, rows), batch_size=args.batch_size)
    trainer.fit(module, loader)
    if trainer.global_rank == 0:
        print(f"mesh: {strategy.device_mesh}; final loss {float(trainer.callback_metrics['train/loss']):.4f}")


if __name__ == "__main__":
    main()
