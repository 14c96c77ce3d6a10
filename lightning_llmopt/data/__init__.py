"""Data: tokenizers, corpora, chunking and the resumable ``TextDataModule``.

Only ``datamodule`` imports Lightning; everything else is torch/numpy and usable without a ``Trainer``.
"""

from lightning_llmopt.data.corpus import default_corpus_files, read_documents
from lightning_llmopt.data.datamodule import TextDataModule
from lightning_llmopt.data.packing import StreamingPacker, best_fit, first_fit_decreasing, pack_rows, padding_waste
from lightning_llmopt.data.sampler import ResumableDataLoader, ResumableShardedSampler
from lightning_llmopt.data.tokenizers import ByteTokenizer, HFTokenizer, load_tokenizer

__all__ = [
    "ByteTokenizer",
    "HFTokenizer",
    "ResumableDataLoader",
    "ResumableShardedSampler",
    "StreamingPacker",
    "TextDataModule",
    "best_fit",
    "default_corpus_files",
    "first_fit_decreasing",
    "load_tokenizer",
    "pack_rows",
    "padding_waste",
    "read_documents",
]
