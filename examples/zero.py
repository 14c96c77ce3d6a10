"""Train the reference decoder with ZeroStrategy (stages 1-3) through Lightning.

    python examples/zero.py --stage 2 --devices 2 --accelerator cpu --max-steps 20
    torchrun --nproc-per-node=8 examples/zero.py --stage 3 --devices 8 --precision bf16-mixed
"""

from __future__ import annotations

import argparse

import lightning as L

import lightning_llmopt  # noqa: F401  (registers the zero* strategies)
from lightning_llmopt import CausalLMModule
from lightning_llmopt.data import TextDataModule
from lightning_llmopt.strategies import ZeroStrategy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--stage", type=int, default=2, choices=(1, 2, 3))
    parser.add_argument("--offload", action="store_true", help="offload the optimizer (and, stage 3, parameters)")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--data", default=None, 
                        help="folder of .txt/.jsonl documents (default: the Python standard library sources)")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--accelerator", default="auto")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--checkpoint-dir", default="checkpoints/zero")
    parser.add_argument("--resume", action="store_true", help="resume from the newest checkpoint in --checkpoint-dir")
    args = parser.parse_args()

    L.seed_everything(0)
    strategy = ZeroStrategy(stage=args.stage, offload_optimizer=args.offload,
                            offload_parameters=args.offload and args.stage == 3, checkpoint_keep_last=2)
    trainer = L.Trainer(accelerator=args.accelerator, devices=args.devices, num_nodes=args.num_nodes,
                        strategy=strategy, precision=args.precision, max_steps=args.max_steps, logger=False,
                        enable_checkpointing=False, limit_val_batches=0)
    data = TextDataModule(data_path=args.data, seq_len=128, batch_size=4)
    trainer.fit(CausalLMModule(args.model, warmup_steps=5), data,
                ckpt_path=args.checkpoint_dir if args.resume else None)
    trainer.save_checkpoint(args.checkpoint_dir)  # every rank writes its shards: checkpoint_dir/step-N


if __name__ == "__main__":
    main()
