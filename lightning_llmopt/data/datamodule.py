"""``TextDataModule``: documents -> token stream -> fixed-length chunks -> resumable, sharded batches.

The only module of ``lightning_llmopt.data`` that imports Lightning; the logic lives in ``corpus``, ``chunks`` and
``sampler``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_llmopt.data.chunks import (
    ChunkDataset,
    make_chunks,
    split_chunk_indices,
    tokenize_documents,
    unigram_cross_entropy,
)
from lightning_llmopt.data.corpus import default_corpus_files, read_documents
from lightning_llmopt.data.sampler import ResumableDataLoader, ResumableShardedSampler
from lightning_llmopt.data.tokenizers import ByteTokenizer, HFTokenizer, load_tokenizer

# Settings that change which sample sits at which position; a resumed run that changes them is not exact.
_ORDER_KEYS = ("seed", "seq_len", "batch_size", "val_fraction", "max_bytes", "vocab_size")


class TextDataModule(LightningDataModule):
    """Causal-LM batches from text files, or from the Python standard library's source when no path is given.

    Each document is tokenized and followed by the tokenizer's eos id; the documents are concatenated into one stream
    and cut into chunks of ``seq_len + 1`` tokens. A seeded permutation of chunk indices splits them into train and
    validation. Batches are ``{"input_ids": (B, T), "labels": (B, T)}`` int64 tensors with ``labels`` shifted by one.

    The train loader shuffles with an order that depends only on ``(seed, epoch)``, shards it over
    ``trainer.world_size`` ranks, and records how far training got, so resuming from a mid-epoch checkpoint continues
    with exactly the next batch.

    Arguments:
        data_path: a ``.txt``/``.md``/``.py``/``.jsonl`` file or a directory of them; ``None``: the standard library.
        tokenizer: ``None``/``"byte"`` or a path to a ``tokenizer.json`` (or a folder holding one).
        seq_len: tokens per training sequence ``T``.
        batch_size: sequences per batch per rank ``B``.
        val_fraction: fraction of chunks held out for validation, in ``(0, 1)``.
        max_bytes: stop reading documents once this many bytes of text are read (``None``: read everything).
        num_workers: DataLoader worker processes.
        seed: seeds the split and the per-epoch shuffles.
        jsonl_key: field of each ``.jsonl`` record that holds the text.
    """

    def __init__(
        self,
        data_path: str | None = None,
        tokenizer: str | None = None,
        seq_len: int = 256,
        batch_size: int = 16,
        val_fraction: float = 0.05,
        max_bytes: int | None = 8_000_000,
        num_workers: int = 0,
        seed: int = 1234,
        jsonl_key: str = "text",
    ) -> None:
        super().__init__()
        for name, value in (("seq_len", seq_len), ("batch_size", batch_size)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} ({value!r}) must be a positive integer")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction ({val_fraction!r}) must be in (0, 1)")
        if max_bytes is not None and max_bytes <= 0:
            raise ValueError(f"max_bytes ({max_bytes!r}) must be positive or None")
        if num_workers < 0:
            raise ValueError(f"num_workers ({num_workers!r}) must be >= 0")
        if data_path is not None and not Path(data_path).expanduser().exists():
            raise FileNotFoundError(f"data_path {data_path!r} does not exist")
        self.save_hyperparameters()
        self.data_path = data_path
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.max_bytes = max_bytes
        self.num_workers = num_workers
        self.seed = seed
        self.jsonl_key = jsonl_key
        self._tokenizer = load_tokenizer(tokenizer)
        self._train: ChunkDataset | None = None
        self._val: ChunkDataset | None = None
        self.num_documents = 0
        self.num_tokens = 0
        # Callbacks (e.g. Curriculum) replace the train order by setting a factory with the signature of
        # ResumableShardedSampler: (dataset, num_replicas=..., rank=..., seed=...) -> ResumableShardedSampler.
        self.sampler_factory: Callable[..., ResumableShardedSampler] = ResumableShardedSampler

    @property
    def tokenizer(self) -> ByteTokenizer | HFTokenizer:
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.vocab_size

    def _documents(self) -> Iterator[str]:
        if self.data_path is not None:
            yield from read_documents(self.data_path, jsonl_key=self.jsonl_key)
            return
        for path in default_corpus_files(self.max_bytes):
            yield path.read_text(encoding="utf-8", errors="replace")

    @override
    def setup(self, stage: str) -> None:
        """Tokenizes and splits the corpus once per process (kept in memory; nothing is written to disk)."""
        if self._train is not None:
            return
        tokens, self.num_documents = tokenize_documents(self._documents(), self._tokenizer, self.max_bytes)
        self.num_tokens = tokens.numel()
        chunks = make_chunks(tokens, self.seq_len)  # (C, T + 1)
        if chunks.shape[0] < 2:
            source = self.data_path or "the default corpus"
            raise ValueError(
                f"{source!r} gives {tokens.numel()} tokens, {chunks.shape[0]} chunk(s) of seq_len + 1 = "
                f"{self.seq_len + 1}: need at least 2 (more data, a smaller seq_len, or a larger max_bytes)"
            )
        train_idx, val_idx = split_chunk_indices(chunks.shape[0], self.val_fraction, self.seed)
        self._train = ChunkDataset(chunks[train_idx])
        self._val = ChunkDataset(chunks[val_idx])

    def _datasets(self) -> tuple[ChunkDataset, ChunkDataset]:
        if self._train is None or self._val is None:
            self.setup("fit")
        assert self._train is not None and self._val is not None
        return self._train, self._val

    @property
    def train_dataset(self) -> ChunkDataset:
        return self._datasets()[0]

    @property
    def val_dataset(self) -> ChunkDataset:
        return self._datasets()[1]

    @override
    def train_dataloader(self) -> ResumableDataLoader:
        trainer = self.trainer
        rank = trainer.global_rank if trainer is not None else 0
        world_size = trainer.world_size if trainer is not None else 1
        dataset = self.train_dataset
        sampler = self.sampler_factory(dataset, num_replicas=world_size, rank=rank, seed=self.seed)
        if len(sampler) < self.batch_size:
            raise ValueError(
                f"train split has {len(dataset)} chunks, {len(sampler)} per rank over world_size={world_size}: "
                f"fewer than batch_size ({self.batch_size}); use more data or a smaller batch_size/seq_len"
            )
        return ResumableDataLoader(
            dataset,
            batch_size=self.batch_size,
            sampler=sampler,
            drop_last=True,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    @override
    def val_dataloader(self) -> DataLoader:
        # Sequential; under a distributed strategy Lightning inserts its own (unshuffled) DistributedSampler.
        return DataLoader(self.val_dataset, batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers)

    def unigram_entropy(self) -> float:
        """Cross-entropy (nats/token) on the validation labels of an add-one-smoothed unigram model fit on the train
        labels: the baseline a trained model must beat."""
        train, val = self._datasets()
        return unigram_cross_entropy(train.chunks[:, 1:], val.chunks[:, 1:], self.vocab_size)

    @override
    def state_dict(self) -> dict[str, Any]:
        """The settings that decide the sample order; the position itself is saved by the train dataloader."""
        return {
            "seed": self.seed,
            "seq_len": self.seq_len,
            "batch_size": self.batch_size,
            "val_fraction": self.val_fraction,
            "max_bytes": self.max_bytes,
            "vocab_size": self.vocab_size,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Warns when the resumed run changed a setting that alters the sample order (resume is then not exact)."""
        current = self.state_dict()
        changed = [
            f"{k}: {state_dict[k]!r} -> {current[k]!r}"
            for k in _ORDER_KEYS
            if state_dict.get(k, current[k]) != current[k]
        ]
        if changed:
            rank_zero_warn(
                f"TextDataModule settings differ from the checkpoint ({'; '.join(changed)}); "
                "training resumes but will not see the same batches as an uninterrupted run"
            )
