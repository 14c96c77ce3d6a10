"""Sequence packing on CPU in seconds: pack documents into rows, check the padding saved, train a few steps.

python examples/packing.py
"""

from __future__ import annotations

import lightning as L
import torch

from lightning_llmopt import CausalLMModule
from lightning_llmopt.callbacks.sequence_packing import SequencePacking
from lightning_llmopt.data import TextDataModule
from lightning_llmopt.data.packing import StreamingPacker, first_fit_decreasing, pack_rows, padding_waste


def main() -> None:
    # 1. The algorithm on its own: six documents into rows of 16 tokens.
    docs = [torch.arange(n) + 10 * i for i, n in enumerate([3, 12, 5, 9, 20, 7])]
    lengths = [d.numel() for d in docs]
    rows = first_fit_decreasing(lengths, 16)
    batch = pack_rows(docs, rows, seq_len=16)
    waste = padding_waste(lengths, 16, rows)
    print(f"rows {rows}: padding {waste.before:.0%} one document per row -> {waste.after:.0%} packed")
    print("doc_ids of row 1:", batch["doc_ids"][1].tolist())
    print("labels of row 1: ", batch["labels"][1].tolist())
    streamed = list(StreamingPacker(16, buffer_size=4)(docs))
    print(f"streaming packer (buffer 4): {len(streamed)} rows")

    # 2. In training: the callback switches the datamodule to packed rows and logs the waste.
    L.seed_everything(0)
    dm = TextDataModule(seq_len=128, batch_size=4, max_bytes=200_000)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=5,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=2,
        callbacks=[SequencePacking("ffd", buffer_size=256)],
    )
    trainer.fit(CausalLMModule("tiny", warmup_steps=1), datamodule=dm)
    stats = dm.padding_stats or {}
    print(
        f"standard-library corpus: padding {stats['waste_before']:.1%} -> {stats['waste_after']:.1%}, "
        f"train loss {float(trainer.callback_metrics['train/loss']):.3f}"
    )


if __name__ == "__main__":
    main()
