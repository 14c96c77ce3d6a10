"""Activation checkpointing and micro-batch search on the tiny preset, on CPU in seconds.

    python examples/activation_checkpointing.py

1. Applies each policy to a bare ``Llama`` and prints the activation bytes kept for backward by one forward.
2. Trains ``CausalLMModule("tiny")`` for a few steps with ``ActivationCheckpointing("selective")`` and a
   ``MicroBatchSizeFinder`` that splits a global batch of 16 into micro-batches (on CPU nothing runs out of memory,
   so the largest micro-batch, capped at the global batch, is chosen).
"""

from __future__ import annotations

import copy
import functools

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_llmopt import CausalLMModule
from lightning_llmopt.callbacks.activation_checkpointing import ActivationCheckpointing
from lightning_llmopt.callbacks.batch_size_finder import MicroBatchSizeFinder
from lightning_llmopt.models import Llama, LlamaConfig
from lightning_llmopt.parallel.activation_checkpointing import activation_memory, apply_activation_checkpointing


class RandomTokens(Dataset):
    def __init__(self, n: int = 128, seq_len: int = 64, vocab: int = 320) -> None:
        self.rows = torch.randint(0, vocab, (n, seq_len + 1), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i, :-1], "labels": self.rows[i, 1:]}


class Data(L.LightningDataModule):
    def __init__(self, batch_size: int = 4) -> None:
        super().__init__()
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(RandomTokens(), batch_size=self.batch_size)


def main() -> None:
    model = Llama(LlamaConfig.from_preset("tiny", n_layers=4))
    tokens = torch.randint(0, 320, (4, 64))  # (B, T)
    for policy in ("none", "full", "every_n", "sqrt", "selective"):
        m = copy.deepcopy(model)
        names = apply_activation_checkpointing(m, policy)
        saved = activation_memory(m, functools.partial(m, tokens))
        print(f"{policy:>10}: {len(names)} blocks checkpointed, {saved / 2**20:.2f} MiB kept for backward")

    ac = ActivationCheckpointing("selective")
    finder = MicroBatchSizeFinder(global_batch_size=16, max_val=8)
    data = Data()
    trainer = L.Trainer(accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[ac, finder])
    trainer.fit(CausalLMModule("tiny", warmup_steps=1), datamodule=data)
    print(f"micro-batch {data.batch_size} x accumulate {trainer.accumulate_grad_batches} = 16; AC metrics:",
          {k: round(float(v), 3) for k, v in trainer.callback_metrics.items() if k.startswith("ac/")})


if __name__ == "__main__":
    main()
