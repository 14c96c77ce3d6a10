"""Train the `debug-1m` model on the default corpus with the public API (no CLI), then greedy-sample from it.

    python examples/train_tiny.py --max_steps 300
"""

from __future__ import annotations

import argparse

import lightning as L
import torch

from lightning_llmopt import CausalLMModule, TrainingMonitor
from lightning_llmopt.data import TextDataModule
from lightning_llmopt.models import greedy_generate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max_steps", type=int, default=300)
    parser.add_argument("--data_path", default=None, help="text/JSONL file or folder; default: Python's stdlib")
    args = parser.parse_args()

    L.seed_everything(1234)
    data = TextDataModule(data_path=args.data_path, seq_len=256, batch_size=16, val_fraction=0.02, max_bytes=4_000_000)
    module = CausalLMModule("debug-1m", learning_rate=3e-3, warmup_steps=30)
    trainer = L.Trainer(accelerator="auto", devices=1, max_steps=args.max_steps, val_check_interval=100,
                        check_val_every_n_epoch=None, limit_val_batches=20, gradient_clip_val=1.0,
                        callbacks=[TrainingMonitor()], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False)
    trainer.fit(module, data)
    val_loss = trainer.validate(module, data, verbose=False)[0]["val/loss"]
    print(f"validation loss {val_loss:.4f} nats/token, "
          f"unigram baseline {data.unigram_entropy():.4f}")

    tok = data.tokenizer
    prompt = torch.tensor([tok.encode("def main(", add_special_tokens=True)], device=module.device)  # as transformers
    out = greedy_generate(module.model.eval(), prompt, max_new_tokens=60)
    print(repr(tok.decode(out[0].tolist())))


if __name__ == "__main__":
    main()
