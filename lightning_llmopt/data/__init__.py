"""Data: tokenizers, corpora, chunking and the resumable ``TextDataModule``.

Only ``datamodule`` imports Lightning; everything else is torch/numpy and usable without a ``Trainer``.
``TextDataModule`` is imported on first access, so ``lightning_llmopt.data.tokenizers`` (``llmopt generate``,
``serve``) does not import Lightning.
"""

from typing import TYPE_CHECKING

from lightning_llmopt._lazy import lazy_exports
from lightning_llmopt.data.corpus import default_corpus_files, read_documents
from lightning_llmopt.data.curriculum import (
    CurriculumSampler,
    CurriculumSamplerFactory,
    linear,
    root,
    score_dataset,
    seq_len_schedule,
    staged,
)
from lightning_llmopt.data.dedup import MinHashDeduplicator
from lightning_llmopt.data.instruct import InstructionDataset
from lightning_llmopt.data.mixture import fixed_mixture, lp_mixture, take_tokens
from lightning_llmopt.data.packing import StreamingPacker, best_fit, first_fit_decreasing, pack_rows, padding_waste
from lightning_llmopt.data.quality import DocumentPreprocessor, QualityFilter
from lightning_llmopt.data.sampler import ResumableDataLoader, ResumableShardedSampler
from lightning_llmopt.data.tokenizers import ByteTokenizer, HFTokenizer, load_tokenizer

if TYPE_CHECKING:
    from lightning_llmopt.data.datamodule import TextDataModule

__all__ = [
    "ByteTokenizer",
    "CurriculumSampler",
    "CurriculumSamplerFactory",
    "DocumentPreprocessor",
    "HFTokenizer",
    "InstructionDataset",
    "MinHashDeduplicator",
    "QualityFilter",
    "ResumableDataLoader",
    "ResumableShardedSampler",
    "StreamingPacker",
    "TextDataModule",
    "best_fit",
    "default_corpus_files",
    "first_fit_decreasing",
    "fixed_mixture",
    "linear",
    "load_tokenizer",
    "lp_mixture",
    "pack_rows",
    "padding_waste",
    "root",
    "score_dataset",
    "seq_len_schedule",
    "staged",
    "take_tokens",
    "read_documents",
]

__getattr__, __dir__ = lazy_exports(__name__, {"TextDataModule": "datamodule"}, globals())
