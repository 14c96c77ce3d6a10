"""Synthetic token data for tests and benchmarks (no corpus, no tokenizer)."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset


class RandomTokens(Dataset):
    """Row ``i``: ``seq_len + 1`` uniform random ids from a generator seeded with ``seed + i``.

    Items are ``{"input_ids": (T,), "labels": (T,)}`` int64 with ``labels`` the next tokens, the batch format of
    :class:`~lightning_llmopt.CausalLMModule`. Rows are independent of the order they are read in.

    Arguments:
        vocab_size: ids are drawn from ``[0, vocab_size)``.
        seq_len: tokens per row ``T``.
        length: number of rows.
        seed: base seed.
    """

    def __init__(self, vocab_size: int, seq_len: int, length: int, seed: int = 0) -> None:
        for name, value in (("vocab_size", vocab_size), ("seq_len", seq_len), ("length", length)):
            if value <= 0:
                raise ValueError(f"{name} ({value}) must be positive")
        self.vocab_size, self.seq_len, self.length, self.seed = vocab_size, seq_len, length, seed

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed + i)
        ids = torch.randint(0, self.vocab_size, (self.seq_len + 1,), generator=g)
        return {"input_ids": ids[:-1], "labels": ids[1:]}  # (T,), (T,)
