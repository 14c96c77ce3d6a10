"""``TextDataModule``: documents -> token stream -> fixed-length chunks -> resumable, sharded batches.

The only module of ``lightning_llmopt.data`` that imports Lightning; the logic lives in ``corpus``, ``chunks`` and
``sampler``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_llmopt.data.chunks import ChunkDataset, make_chunks, split_chunk_indices, unigram_cross_entropy
from lightning_llmopt.data.corpus import default_corpus_files, read_documents
from lightning_llmopt.data.instruct import encode_documents, pack_masked, read_examples
from lightning_llmopt.data.packed import (
    PackedDataset,
    TokenizedDocuments,
    pack_documents,
    split_documents,
    tokenize_with_lengths,
)
from lightning_llmopt.data.packing import ALGORITHMS
from lightning_llmopt.data.quality import DocumentPreprocessor
from lightning_llmopt.data.sampler import ResumableDataLoader, ResumableShardedSampler
from lightning_llmopt.data.tokenizers import ByteTokenizer, HFTokenizer, load_tokenizer

# Settings that change which sample sits at which position; a resumed run that changes them is not exact.
_ORDER_KEYS = (
    "seed",
    "seq_len",
    "batch_size",
    "val_fraction",
    "max_bytes",
    "vocab_size",
    "packing",
    "packing_buffer",
    "format",
)
FORMATS = ("text", "chat")
SplitDataset = ChunkDataset | PackedDataset


class TextDataModule(LightningDataModule):
    """Causal-LM batches from text files, or from the Python standard library's source when no path is given.

    Each document is tokenized and followed by the tokenizer's eos id; the documents are concatenated into one stream
    and cut into chunks of ``seq_len + 1`` tokens. A seeded permutation of chunk indices splits them into train and
    validation. Batches are ``{"input_ids": (B, T), "labels": (B, T)}`` int64 tensors with ``labels`` shifted by one.

    With ``packing`` set, documents are instead split into train and validation by a seeded permutation of
    documents, and each split is packed into rows of ``seq_len`` tokens (:mod:`lightning_llmopt.data.packing`):
    batches then also carry ``positions`` and ``doc_ids`` ``(B, T)`` (positions restart at every document, labels
    never cross one, padding has label ``-100`` and its own doc id). Document boundaries are kept from tokenization,
    so :meth:`enable_packing` may switch modes after :meth:`setup`.

    With ``format="chat"``, ``data_path`` is a JSONL file (or a directory of them) of instruction examples,
    ``{"messages": [{"role", "content"}, ...]}`` or ``{"prompt", "completion"}``, each rendered with the tokenizer's
    chat template and encoded by :func:`~lightning_llmopt.data.instruct.encode_example`: one document per example,
    split by document as above, labels ``-100`` except on assistant tokens (the answer and its end of turn). With
    ``packing`` the examples are packed into rows as documents are (positions restart, no label crosses an example);
    with ``packing=None`` each example has rows of its own (padded). ``max_bytes`` and ``preprocess`` apply to text.

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
        packing: ``None`` (concatenated chunks; chat: one example per row), ``"ffd"`` or ``"best_fit"`` (packed
            rows; see above).
        packing_buffer: documents held by the streaming packer at once (larger packs tighter).
        preprocess: a :class:`~lightning_llmopt.data.quality.DocumentPreprocessor` (quality filters,
            deduplication) run on the documents before tokenization; its report is :attr:`preprocess_report`.
        format: ``"text"`` (documents) or ``"chat"`` (instruction/chat examples; see above).
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
        packing: str | None = None,
        packing_buffer: int = 1024,
        preprocess: DocumentPreprocessor | None = None,
        format: str = "text",
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
        _check_packing(packing, packing_buffer)
        if format not in FORMATS:
            raise ValueError(f"format ({format!r}) must be one of {FORMATS}")
        if format == "chat" and data_path is None:
            raise ValueError("format='chat' needs data_path: a JSONL file (or directory) of chat/instruction examples")
        if format == "chat" and preprocess is not None:
            raise ValueError("preprocess applies to format='text' documents, not to format='chat' examples")
        if data_path is not None and not Path(data_path).expanduser().exists():
            raise FileNotFoundError(f"data_path {data_path!r} does not exist")
        self.save_hyperparameters(ignore=["preprocess"])
        self.preprocess = preprocess
        self.data_path = data_path
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.max_bytes = max_bytes
        self.num_workers = num_workers
        self.seed = seed
        self.jsonl_key = jsonl_key
        self.packing = packing
        self.packing_buffer = packing_buffer
        self.format = format
        self._tokenizer = load_tokenizer(tokenizer)
        self._docs: TokenizedDocuments | None = None
        self._targets: TokenizedDocuments | None = None  # format="chat": 1 on assistant tokens, 0 elsewhere
        self._train: SplitDataset | None = None
        self._val: SplitDataset | None = None
        # Packing mode only: {"waste_before", "waste_after", "rows", "documents"} of the train split.
        self.padding_stats: dict[str, float] | None = None
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

    def _raw_documents(self) -> Iterator[str]:
        if self.data_path is not None:
            yield from read_documents(self.data_path, jsonl_key=self.jsonl_key)
            return
        for path in default_corpus_files(self.max_bytes):
            yield path.read_text(encoding="utf-8", errors="replace")

    def _documents(self) -> Iterator[str]:
        if self.preprocess is None:
            return self._raw_documents()
        return self.preprocess(self._raw_documents())

    @property
    def preprocess_report(self) -> dict[str, Any] | None:
        """What :attr:`preprocess` removed and why (after :meth:`setup`), or ``None`` without preprocessing."""
        return self.preprocess.report if self.preprocess is not None else None

    @override
    def setup(self, stage: str) -> None:
        """Tokenizes and splits the corpus once per process (kept in memory; nothing is written to disk)."""
        if self._train is not None:
            return
        if self.format == "chat":
            assert self.data_path is not None
            self._docs, self._targets = encode_documents(read_examples(self.data_path), self._tokenizer)
        else:
            self._docs = tokenize_with_lengths(self._documents(), self._tokenizer, self.max_bytes)
        self.num_documents = self._docs.lengths.numel()
        self.num_tokens = self._docs.tokens.numel()
        if self.preprocess is not None:
            rank_zero_info(f"TextDataModule preprocessing: {self.preprocess.report}")
        self._build_datasets()

    def enable_packing(self, algorithm: str = "ffd", buffer_size: int = 1024) -> None:
        """Switches to packed rows (``algorithm`` ``"ffd"`` or ``"best_fit"``), before or after :meth:`setup`;
        dataloaders built afterwards serve packed batches."""
        _check_packing(algorithm, buffer_size)
        changed = (algorithm, buffer_size) != (self.packing, self.packing_buffer)
        self.packing, self.packing_buffer = algorithm, buffer_size
        if changed and self._docs is not None:
            self._build_datasets()

    def _build_datasets(self) -> None:
        assert self._docs is not None
        source = self.data_path or "the default corpus"
        if self.packing is None and self._targets is None:
            self.padding_stats = None
            tokens = self._docs.tokens
            chunks = make_chunks(tokens, self.seq_len)  # (C, T + 1)
            if chunks.shape[0] < 2:
                raise ValueError(
                    f"{source!r} gives {tokens.numel()} tokens, {chunks.shape[0]} chunk(s) of seq_len + 1 = "
                    f"{self.seq_len + 1}: need at least 2 (more data, a smaller seq_len, or a larger max_bytes)"
                )
            train_idx, val_idx = split_chunk_indices(chunks.shape[0], self.val_fraction, self.seed)
            self._train, self._val = ChunkDataset(chunks[train_idx]), ChunkDataset(chunks[val_idx])
            return
        if self.num_documents < 2:
            raise ValueError(
                f"{source!r} gives {self.num_documents} document(s): "
                f"{'packing' if self._targets is None else 'format=chat'} splits train and validation by document "
                "and needs at least 2"
            )
        pad_id = self._tokenizer.eos_id if self._tokenizer.eos_id is not None else 0
        train_idx, val_idx = split_documents(self._docs, self.val_fraction, self.seed)
        train: PackedDataset
        val: PackedDataset
        if self._targets is not None:
            targets = self._targets
            train, val = (
                pack_masked(
                    self._docs.select(i), targets.select(i), self.seq_len, self.packing, self.packing_buffer, pad_id
                )
                for i in (train_idx, val_idx)
            )
        else:
            assert self.packing is not None
            train, val = (
                pack_documents(self._docs.select(idx), self.seq_len, self.packing, self.packing_buffer, pad_id)
                for idx in (train_idx, val_idx)
            )
        self._train, self._val = train, val
        waste = train.padding_waste()
        self.padding_stats = {
            "waste_before": waste.before,
            "waste_after": waste.after,
            "rows": float(waste.rows_after),
            "documents": float(train_idx.numel()),
        }

    def _datasets(self) -> tuple[SplitDataset, SplitDataset]:
        if self._train is None or self._val is None:
            self.setup("fit")
        assert self._train is not None and self._val is not None
        return self._train, self._val

    @property
    def train_dataset(self) -> SplitDataset:
        return self._datasets()[0]

    @property
    def val_dataset(self) -> SplitDataset:
        return self._datasets()[1]

    @override
    def train_dataloader(self) -> ResumableDataLoader:
        world_size, rank = data_parallel_position(self.trainer)
        dataset = self.train_dataset
        sampler = self.sampler_factory(dataset, num_replicas=world_size, rank=rank, seed=self.seed)
        if len(sampler) < self.batch_size:
            kind = "rows" if isinstance(dataset, PackedDataset) else "chunks"
            raise ValueError(
                f"train split has {len(dataset)} {kind}, {len(sampler)} per rank "
                f"over {world_size} data-parallel ranks: "
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
        labels: the baseline a trained model must beat. Packed: on the train and validation documents' tokens."""
        train, val = self._datasets()
        if isinstance(train, PackedDataset) and isinstance(val, PackedDataset):
            return unigram_cross_entropy(train.tokens, val.tokens, self.vocab_size)
        assert isinstance(train, ChunkDataset) and isinstance(val, ChunkDataset)
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
            "packing": self.packing,
            "packing_buffer": self.packing_buffer,
            "format": self.format,
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


def _check_packing(packing: str | None, buffer_size: int) -> None:
    if packing is not None and packing not in ALGORITHMS:
        raise ValueError(f"packing ({packing!r}) must be None or one of {ALGORITHMS}")
    if not isinstance(buffer_size, int) or buffer_size < 1:
        raise ValueError(f"packing_buffer ({buffer_size!r}) must be a positive integer")


def data_parallel_position(trainer: Any) -> tuple[int, int]:
    """``(replicas, rank)`` of this process among the ranks that read different data.

    The strategy's ``distributed_sampler_kwargs`` when it has them (tensor/context-parallel ranks of one group read
    the same rows), else the trainer's world size and global rank; ``(1, 0)`` without a trainer.
    """
    if trainer is None:
        return 1, 0
    kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
    if "num_replicas" in kwargs and "rank" in kwargs:
        return int(kwargs["num_replicas"]), int(kwargs["rank"])
    return trainer.world_size, trainer.global_rank
