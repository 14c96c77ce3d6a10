"""Train a Mixture-of-Experts Llama on the default corpus and watch the expert load.

    python examples/moe.py --max-steps 30                          # CPU, 1 process
    python examples/moe.py --balance aux_free --capacity-factor 1.25
    python examples/moe.py --devices 2 --expert-parallel 2         # experts split over 2 processes (gloo on CPU)
    python examples/moe.py --devices 4 --expert-parallel 2 --tensor-parallel 2 --zero-stage 3

With ``--devices`` > 1 the model is trained with :class:`~lightning_llmopt.strategies.NDParallelStrategy`: expert
parallelism borrows data-parallel ranks, and under tensor parallelism each rank routes its slice of the sequence
(dropless routing only).
"""

from __future__ import annotations

import argparse

import lightning as L

from lightning_llmopt import CausalLMModule, LlamaConfig, TrainingMonitor
from lightning_llmopt.data import TextDataModule


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--balance", default="aux_loss", choices=("aux_loss", "aux_free", "none"))
    parser.add_argument("--capacity-factor", type=float, default=None, help="default: dropless")
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--expert-parallel", type=int, default=1)
    parser.add_argument("--tensor-parallel", type=int, default=1)
    parser.add_argument("--zero-stage", type=int, default=0, choices=(0, 3))
    args = parser.parse_args()

    moe = {
        "num_experts": args.experts,
        "top_k": args.top_k,
        "balance": args.balance,
        "capacity_factor": args.capacity_factor,
        "z_loss_coef": 1e-3,
    }
    config = LlamaConfig.from_preset("tiny", moe=moe)
    module = CausalLMModule(config, max_steps=args.max_steps, warmup_steps=5)
    monitor = TrainingMonitor(log_every_n_steps=10)
    strategy: object = "auto"
    if args.devices > 1:
        from lightning_llmopt.strategies import NDParallelStrategy

        strategy = NDParallelStrategy(
            expert_parallel=args.expert_parallel, tensor_parallel=args.tensor_parallel, zero_stage=args.zero_stage
        )
    trainer = L.Trainer(
        max_steps=args.max_steps,
        callbacks=[monitor],
        logger=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        accelerator="cpu" if args.devices > 1 else "auto",
        devices=args.devices,
        strategy=strategy,
    )
    trainer.fit(module, datamodule=TextDataModule(seq_len=128, batch_size=8))
    m = monitor.last_metrics
    if trainer.global_rank != 0:
        return
    print(
        f"load CV {m['moe/load_cv']:.3f}, dropped {m['moe/dropped_fraction']:.3f}, "
        f"loss {float(trainer.callback_metrics['train/loss']):.3f}"
    )


if __name__ == "__main__":
    main()
