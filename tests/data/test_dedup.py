"""Deduplication against planted duplicates whose true Jaccard similarity we compute exactly."""

from __future__ import annotations

import random

import pytest

from lightning_llmopt.data.dedup import MinHashDeduplicator, exact_key, lsh_layout, shingles

THRESHOLD = 0.7


def _jaccard(a: str, b: str) -> float:
    x, y = shingles(a), shingles(b)
    return len(x & y) / len(x | y)


def _edit(words: list[str], rng: random.Random, fraction: float, vocab: list[str]) -> list[str]:
    out = list(words)
    for _ in range(max(1, int(fraction * len(out)))):
        i = rng.randrange(len(out))
        op = rng.random()
        if op < 0.6:
            out[i] = rng.choice(vocab)
        elif op < 0.8:
            out.insert(i, rng.choice(vocab))
        elif len(out) > 10:
            del out[i]
    return out


def _corpus(seed: int = 0) -> tuple[list[str], list[bool]]:
    """400 distinct documents, 200 planted near copies (true Jaccard >= 0.75), 100 partial overlaps (< 0.55)."""
    rng = random.Random(seed)
    vocab = [f"w{i}" for i in range(5000)]
    base = [[rng.choice(vocab) for _ in range(rng.randint(80, 300))] for _ in range(400)]
    docs = [" ".join(b) for b in base]
    is_dup = [False] * len(docs)
    planted = 0
    while planted < 200:
        src = base[rng.randrange(len(base))]
        copy = " ".join(_edit(src, rng, rng.uniform(0.0, 0.03), vocab))
        if _jaccard(copy, " ".join(src)) >= 0.75:
            docs.append(copy)
            is_dup.append(True)
            planted += 1
    partial = 0
    while partial < 100:  # hard negatives: half of a document followed by new text
        src = base[rng.randrange(len(base))]
        text = " ".join(src[: len(src) // 2] + [rng.choice(vocab) for _ in range(len(src) // 2 + 20)])
        if _jaccard(text, " ".join(src)) < 0.55:  # random 5-word shingles of other documents never overlap
            docs.append(text)
            is_dup.append(False)
            partial += 1
    order = list(range(400)) + rng.sample(range(400, len(docs)), len(docs) - 400)  # originals come first
    return [docs[i] for i in order], [is_dup[i] for i in order]


def test_minhash_finds_planted_near_duplicates() -> None:
    docs, truth = _corpus()
    dedup = MinHashDeduplicator(threshold=THRESHOLD, num_perm=128, shingle_size=5)
    flagged = [dedup.is_duplicate(d) for d in docs]
    positives = sum(truth)
    negatives = len(truth) - positives
    recall = sum(f and t for f, t in zip(flagged, truth, strict=True)) / positives
    false_positive_rate = sum(f and not t for f, t in zip(flagged, truth, strict=True)) / negatives
    assert recall >= 0.95, recall
    assert false_positive_rate <= 0.01, false_positive_rate
    assert dedup.stats.kept == len(docs) - sum(flagged)


def test_exact_duplicates_and_layout() -> None:
    dedup = MinHashDeduplicator(near=False)
    kept = list(dedup.filter(["a b c", "x y z", "a b c", "a b c "]))
    assert kept == ["a b c", "x y z", "a b c "]  # only byte-identical copies are exact duplicates
    assert dedup.stats.exact_duplicates == 1 and dedup.stats.removed_examples == [(2, 0)]
    assert exact_key("a") != exact_key("b")
    bands, rows = lsh_layout(0.8, 128)
    assert bands * rows <= 128 and (1 / bands) ** (1 / rows) < 0.8  # the S-curve rises before the threshold
    with pytest.raises(ValueError, match="threshold"):
        lsh_layout(1.5, 128)
    with pytest.raises(ValueError, match="unit"):
        MinHashDeduplicator(unit="line")


def test_mulmod_matches_python_integers() -> None:
    import torch

    from lightning_llmopt.data.dedup import _MERSENNE, _mulmod

    g = torch.Generator().manual_seed(0)
    a = torch.randint(1, _MERSENNE, (200,), generator=g, dtype=torch.int64)
    x = torch.randint(0, 1 << 32, (200,), generator=g, dtype=torch.int64)
    want = [(int(ai) * int(xi)) % _MERSENNE for ai, xi in zip(a.tolist(), x.tolist(), strict=True)]
    assert _mulmod(a, x).tolist() == want


def test_signature_agreement_estimates_jaccard() -> None:
    dedup = MinHashDeduplicator(num_perm=256)
    a = " ".join(f"w{i}" for i in range(300))
    b = " ".join(f"w{i}" if i % 10 else f"v{i}" for i in range(300))  # every 10th word replaced
    agree = float((dedup.signature(a) == dedup.signature(b)).float().mean())
    assert abs(agree - _jaccard(a, b)) < 0.1, (agree, _jaccard(a, b))


def test_quality_filters_name_the_reason() -> None:
    from lightning_llmopt.data.quality import QualityFilter

    f = QualityFilter()
    good = "The quick brown fox jumps over the lazy dog while the cat watches from the window."
    assert f.reason(good) is None
    assert f.reason("too short") == "too_short"
    assert f.reason("a" * 400 + " b c d e") == "low_char_diversity"
    assert f.reason("12 34 56 78 90 11 22 33 44 55 66 77 88 99 00 12 34 56") == "low_letter_ratio"
    assert f.reason("\n".join(["same line here"] * 6 + ["another different line"])) == "repeated_lines"
    assert f.reason(" ".join(["buy cheap pills now"] * 10)) == "repeated_ngrams"
    with pytest.raises(ValueError, match="min_letter_ratio"):
        QualityFilter(min_letter_ratio=2.0)


def test_datamodule_preprocessing_reports_what_it_removed(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from lightning_llmopt.data import TextDataModule
    from lightning_llmopt.data.quality import DocumentPreprocessor, QualityFilter

    docs, truth = _corpus(seed=1)
    lines = [*docs[:450], "x", docs[3]]  # 50 planted-or-partial docs, one too short, one exact copy
    (tmp_path / "corpus.jsonl").write_text("\n".join(__import__("json").dumps({"text": t}) for t in lines))
    prep = DocumentPreprocessor(QualityFilter(min_letter_ratio=None), MinHashDeduplicator(threshold=THRESHOLD))
    dm = TextDataModule(data_path=str(tmp_path / "corpus.jsonl"), seq_len=64, batch_size=4, preprocess=prep)
    dm.setup("fit")
    report = dm.preprocess_report
    assert report is not None and report["seen"] == len(lines)
    assert report["removed"]["too_short"] == 1 and report["removed"]["exact_duplicate"] == 1, report
    assert report["removed"]["near_duplicate"] == sum(truth[:450])
    assert report["kept"] == dm.num_documents == len(lines) - sum(report["removed"].values())
