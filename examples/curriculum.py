"""Curriculum learning on CPU in seconds: easy chunks first (root pacing) and a sequence-length warm-up.

    python examples/curriculum.py --max_steps 20
"""

from __future__ import annotations

import argparse

import lightning as L

from lightning_llmopt import CausalLMModule
from lightning_llmopt.callbacks.curriculum import Curriculum
from lightning_llmopt.data import TextDataModule
from lightning_llmopt.data.curriculum import root, score_dataset


class PrintSchedule(L.Callback):
    """Prints what the curriculum decided for a few steps (after it truncated the batch)."""

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        if trainer.global_step % 10 == 1:
            metrics = trainer.callback_metrics
            print(f"step {trainer.global_step - 1:3d}: competence {float(metrics['curriculum/competence']):.2f}, "
                  f"seq_len {batch['input_ids'].shape[1]}, loss {float(metrics['train/loss']):.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max_steps", type=int, default=20)
    args = parser.parse_args()

    L.seed_everything(0)
    data = TextDataModule(seq_len=128, batch_size=8, max_bytes=300_000)
    data.setup("fit")
    # What the callback will do in setup: rank the train chunks by type-token ratio (0 = easiest, 1 = hardest).
    ranks = score_dataset(data.train_dataset, "lexical_diversity")
    easiest = data.tokenizer.decode(data.train_dataset[int(ranks.argmin())]["input_ids"].tolist())
    hardest = data.tokenizer.decode(data.train_dataset[int(ranks.argmax())]["input_ids"].tolist())
    print(f"easiest chunk: {easiest[:60]!r}\nhardest chunk: {hardest[:60]!r}")
    pacing = root(c0=0.1, total_steps=args.max_steps)
    print("competence at steps 0, 10, 20:", [round(pacing(t), 3) for t in (0, 10, 20)])

    curriculum = Curriculum(scorer="lexical_diversity", pacing="root", c0=0.1, seq_len_warmup=(32, args.max_steps // 2))
    trainer = L.Trainer(accelerator="cpu", max_steps=args.max_steps, callbacks=[curriculum, PrintSchedule()],
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0)
    trainer.fit(CausalLMModule("debug-1m", learning_rate=3e-3, warmup_steps=5), data)
    print("callback state (saved in checkpoints):", curriculum.state_dict())


if __name__ == "__main__":
    main()
