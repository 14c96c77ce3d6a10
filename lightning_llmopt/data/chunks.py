"""Token streams cut into fixed-length chunks, their train/validation split, and the unigram baseline.

Framework-free (torch and numpy only): :class:`~lightning_llmopt.data.datamodule.TextDataModule` wires these into
Lightning.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
import torch
from torch.utils.data import Dataset

from lightning_llmopt.data.tokenizers import ByteTokenizer, HFTokenizer, Tokenizer

_HF_BATCH_DOCS = 256  # documents per encode_batch call: bounds peak memory of the Python id lists


def _with_eos(ids: np.ndarray, eos_id: int | None) -> list[np.ndarray]:
    return [ids] if eos_id is None else [ids, np.array([eos_id], dtype=np.int64)]


def tokenize_documents(
    documents: Iterable[str], tokenizer: Tokenizer, max_bytes: int | None = None
) -> tuple[torch.Tensor, int]:
    """Tokenizes documents into one stream, each document followed by ``tokenizer.eos_id`` (when it has one).

    Arguments:
        documents: texts, consumed in order.
        tokenizer: any :class:`~lightning_llmopt.data.tokenizers.Tokenizer`; the byte tokenizer takes a vectorised
            path (``np.frombuffer``), the HF tokenizer its batched Rust encoder.
        max_bytes: stop reading documents once their UTF-8 size reaches this many bytes (``None``: read all).

    Returns:
        ``(tokens, num_documents)``: ``tokens`` is an int64 tensor of shape ``(N,)``.
    """
    eos_id = tokenizer.eos_id
    pieces: list[np.ndarray] = []
    pending: list[str] = []
    num_docs = 0
    total_bytes = 0

    def flush() -> None:
        if not pending:
            return
        if isinstance(tokenizer, HFTokenizer):
            for ids in tokenizer.encode_batch(pending):
                pieces.extend(_with_eos(np.asarray(ids, dtype=np.int64), eos_id))
        else:
            for text in pending:
                pieces.extend(_with_eos(np.asarray(tokenizer.encode(text), dtype=np.int64), eos_id))
        pending.clear()

    for text in documents:
        if max_bytes is not None and total_bytes >= max_bytes:
            break
        raw = text.encode("utf-8")
        total_bytes += len(raw)
        num_docs += 1
        if isinstance(tokenizer, ByteTokenizer):
            pieces.extend(_with_eos(np.frombuffer(raw, dtype=np.uint8).astype(np.int64), eos_id))
        else:
            pending.append(text)
            if len(pending) >= _HF_BATCH_DOCS:
                flush()
    flush()
    stream = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
    return torch.from_numpy(stream), num_docs


def make_chunks(tokens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Cuts a token stream into non-overlapping chunks of ``seq_len + 1`` tokens; the tail that does not fill a
    chunk is dropped.

    Arguments:
        tokens: shape ``(N,)``.
        seq_len: model context length ``T``; a chunk carries ``T`` inputs and, shifted by one, ``T`` labels.

    Returns:
        A view of shape ``(N // (T + 1), T + 1)``.
    """
    if seq_len <= 0:
        raise ValueError(f"seq_len ({seq_len}) must be positive")
    width = seq_len + 1
    num_chunks = tokens.numel() // width
    return tokens[: num_chunks * width].view(num_chunks, width)  # (C, T + 1)


def split_chunk_indices(num_chunks: int, val_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic train/validation split of chunk indices by a seeded permutation.

    ``round(num_chunks * val_fraction)`` chunks (at least one) go to validation; both index sets come back sorted so
    that the train order is decided by the sampler alone.

    Returns:
        ``(train_indices, val_indices)``: disjoint int64 tensors covering ``range(num_chunks)``.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction ({val_fraction}) must be in (0, 1)")
    num_val = max(1, round(num_chunks * val_fraction))
    if num_chunks - num_val < 1:
        raise ValueError(
            f"only {num_chunks} chunks: too few to split with val_fraction={val_fraction}; "
            "provide more data or lower seq_len"
        )
    generator = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_chunks, generator=generator)
    return perm[num_val:].sort().values, perm[:num_val].sort().values


class ChunkDataset(Dataset):
    """Map-style dataset over chunks: item ``i`` is ``{"input_ids": chunk[:-1], "labels": chunk[1:]}``.

    Arguments:
        chunks: shape ``(C, T + 1)``, integer token ids.
    """

    def __init__(self, chunks: torch.Tensor) -> None:
        if chunks.dim() != 2 or chunks.shape[1] < 2:
            raise ValueError(f"chunks must have shape (C, T + 1) with T >= 1, got {tuple(chunks.shape)}")
        self.chunks = chunks

    def __len__(self) -> int:
        return self.chunks.shape[0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        chunk = self.chunks[index].long()  # (T + 1,)
        return {"input_ids": chunk[:-1], "labels": chunk[1:]}  # (T,), (T,)


def unigram_cross_entropy(train_labels: torch.Tensor, val_labels: torch.Tensor, vocab_size: int) -> float:
    """Cross-entropy in nats/token of an add-one-smoothed unigram model fit on ``train_labels``, on ``val_labels``.

    ``p(v) = (count(v) + 1) / (N + V)``; returns ``-mean(log p(val_labels))``. A trained language model must beat it.

    Arguments:
        train_labels, val_labels: integer tensors of any shape with ids in ``[0, vocab_size)``.
    """
    if val_labels.numel() == 0:
        raise ValueError("val_labels is empty: the unigram cross-entropy needs at least one validation token")
    counts = torch.bincount(train_labels.reshape(-1).long(), minlength=vocab_size).double()
    if counts.numel() > vocab_size:
        raise ValueError(f"train labels hold id {counts.numel() - 1} >= vocab_size ({vocab_size})")
    log_probs = (counts + 1.0).log() - math.log(train_labels.numel() + vocab_size)  # (V,)
    return float(-log_probs[val_labels.reshape(-1).long()].mean())
