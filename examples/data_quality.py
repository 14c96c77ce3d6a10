"""Deduplicate and filter a corpus before training, and split a token budget across sources.

    python examples/data_quality.py            # the default corpus (Python standard library sources)
    python examples/data_quality.py corpus/    # a folder of .txt/.jsonl documents
"""

from __future__ import annotations

import sys

from lightning_llmopt.data import (
    DocumentPreprocessor,
    MinHashDeduplicator,
    QualityFilter,
    TextDataModule,
    fixed_mixture,
    lp_mixture,
)


def main() -> None:
    path = sys.argv[1] if len(sys.argv) > 1 else None
    prep = DocumentPreprocessor(QualityFilter(), MinHashDeduplicator(threshold=0.8))
    data = TextDataModule(data_path=path, seq_len=256, batch_size=8, max_bytes=2_000_000, preprocess=prep)
    data.setup("fit")
    print("preprocessing:", data.preprocess_report)
    print(f"{data.num_documents} documents, {data.num_tokens} tokens after preprocessing")

    available = {"code": 5_000_000, "web": 20_000_000, "books": 2_000_000}
    print("fixed 2:1:1 ->", fixed_mixture(available, {"code": 2, "web": 1, "books": 1}, 10_000_000))
    utility = {"code": 1.0, "web": 0.4, "books": 0.8}
    print("LP ->", lp_mixture(available, utility, 10_000_000, min_share={"web": 0.2}, max_epochs=1.0))


if __name__ == "__main__":
    main()
