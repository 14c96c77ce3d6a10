"""Tokenized documents with their boundaries, split by document and packed into rows: the data behind the packing mode
of :class:`~lightning_llmopt.data.datamodule.TextDataModule`.

Framework-free (torch only).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.utils.data import Dataset

from lightning_llmopt.data.chunks import split_chunk_indices, tokenize_documents
from lightning_llmopt.data.packing import PaddingWaste, Piece, StreamingPacker, build_row, padding_waste
from lightning_llmopt.data.tokenizers import Tokenizer


@dataclass
class TokenizedDocuments:
    """Documents back to back in one stream, with their lengths.

    Arguments:
        tokens: ``(N,)`` int64, each document followed by the tokenizer's eos id (when it has one).
        lengths: ``(D,)`` int64 token count of each document (eos included); sums to ``N``.
    """

    tokens: Tensor
    lengths: Tensor

    def __post_init__(self) -> None:
        if int(self.lengths.sum()) != self.tokens.numel():
            total = int(self.lengths.sum())
            raise ValueError(f"document lengths sum to {total}, not to the {self.tokens.numel()} tokens")

    @property
    def offsets(self) -> Tensor:
        """``(D,)`` start of each document in :attr:`tokens`."""
        return torch.cumsum(self.lengths, 0) - self.lengths

    def select(self, indices: Tensor) -> TokenizedDocuments:
        """The documents at ``indices`` (in that order), as a new stream."""
        offsets, lengths = self.offsets.tolist(), self.lengths.tolist()
        parts = [self.tokens[offsets[i] : offsets[i] + lengths[i]] for i in indices.tolist()]
        tokens = torch.cat(parts) if parts else self.tokens[:0]
        return TokenizedDocuments(tokens, self.lengths[indices])


def tokenize_with_lengths(
    documents: Iterable[str], tokenizer: Tokenizer, max_bytes: int | None = None
) -> TokenizedDocuments:
    """:func:`~lightning_llmopt.data.chunks.tokenize_documents`, keeping each document's length.

    The stream is the same (documents are tokenized one by one through it, with the same ``max_bytes`` rule).
    """
    pieces: list[Tensor] = []
    total_bytes = 0
    for text in documents:
        if max_bytes is not None and total_bytes >= max_bytes:
            break
        total_bytes += len(text.encode("utf-8"))
        pieces.append(tokenize_documents([text], tokenizer)[0])
    lengths = torch.tensor([p.numel() for p in pieces], dtype=torch.int64)
    tokens = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)
    return TokenizedDocuments(tokens, lengths)


def split_documents(docs: TokenizedDocuments, val_fraction: float, seed: int) -> tuple[Tensor, Tensor]:
    """Deterministic train/validation split of document indices (a seeded permutation; both sorted)."""
    return split_chunk_indices(docs.lengths.numel(), val_fraction, seed)


class PackedDataset(Dataset):
    """Map-style dataset of packed rows, built lazily from the token stream (only the row layout is stored).

    Item ``i`` is ``{"input_ids", "labels", "positions", "doc_ids"}``, each ``(T,)`` int64 (see
    :func:`~lightning_llmopt.data.packing.build_row`).

    Arguments:
        docs: the documents of this split.
        rows: the packing, a list of :class:`~lightning_llmopt.data.packing.Piece` per row (``doc`` indexes ``docs``).
        seq_len: row length ``T``.
        pad_id: token id of padding inputs.
    """

    def __init__(self, docs: TokenizedDocuments, rows: list[list[Piece]], seq_len: int, pad_id: int = 0) -> None:
        self.docs = docs
        self.rows = rows
        self.seq_len = seq_len
        self.pad_id = pad_id
        self._offsets: list[int] = docs.offsets.tolist()

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return build_row(self.docs.tokens, self._offsets, self.rows[index], self.seq_len, self.pad_id)

    @property
    def tokens(self) -> Tensor:
        """``(N,)`` every token of this split's documents."""
        return self.docs.tokens

    def padding_waste(self) -> PaddingWaste:
        """Padding before (one document per row) and after packing."""
        return padding_waste(self.docs.lengths.tolist(), self.seq_len, len(self.rows))


def pack_documents(
    docs: TokenizedDocuments, seq_len: int, algorithm: str, buffer_size: int, pad_id: int = 0
) -> PackedDataset:
    """Packs ``docs`` in stream order with a :class:`~lightning_llmopt.data.packing.StreamingPacker`."""
    packer = StreamingPacker(seq_len, buffer_size, algorithm)
    rows = list(packer.pack_lengths(docs.lengths.tolist()))
    return PackedDataset(docs, rows, seq_len, pad_id)
