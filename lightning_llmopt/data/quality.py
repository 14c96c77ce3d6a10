"""Heuristic document quality filters and the preprocessing step that runs them with deduplication.

:class:`QualityFilter` checks, in order (the first failing check names the reason):

- ``too_short`` / ``too_long``: characters outside ``[min_chars, max_chars]`` or fewer than ``min_words`` words;
- ``low_char_diversity``: fewer than ``min_distinct_chars`` distinct characters (``"aaaa..."``; a count, not a
  ratio, which would reject every long natural document);
- ``low_letter_ratio``: letters / non-space characters below ``min_letter_ratio`` (tables of numbers, binary);
- ``repeated_lines``: the fraction of lines that repeat an earlier line above ``max_duplicate_line_fraction``;
- ``repeated_ngrams``: the fraction of words inside repeated word ``ngram``-grams above ``max_repeated_ngram_fraction``
  (Gopher-style repetition, Rae et al. 2021).

:class:`DocumentPreprocessor` streams documents through the filters and a
:class:`~lightning_llmopt.data.dedup.MinHashDeduplicator` and keeps a report of what it removed and why.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from lightning_llmopt.data.dedup import MinHashDeduplicator

__all__ = ["DocumentPreprocessor", "QualityFilter"]


@dataclass
class QualityFilter:
    """Heuristic thresholds (see the module docstring); ``None`` disables a check."""

    min_chars: int | None = 32
    max_chars: int | None = None
    min_words: int | None = 5
    min_distinct_chars: int | None = 10
    min_letter_ratio: float | None = 0.25
    max_duplicate_line_fraction: float | None = 0.5
    ngram: int = 3
    max_repeated_ngram_fraction: float | None = 0.6

    def __post_init__(self) -> None:
        for name in ("min_letter_ratio", "max_duplicate_line_fraction",
                     "max_repeated_ngram_fraction"):
            value = getattr(self, name)
            if value is not None and not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} ({value}) must be in [0, 1] or None")
        if self.ngram < 1:
            raise ValueError(f"ngram ({self.ngram}) must be >= 1")

    def reason(self, text: str) -> str | None:
        """Why ``text`` is rejected, or ``None`` if it passes every check."""
        n = len(text)
        if self.min_chars is not None and n < self.min_chars:
            return "too_short"
        if self.max_chars is not None and n > self.max_chars:
            return "too_long"
        words = text.split()
        if self.min_words is not None and len(words) < self.min_words:
            return "too_short"
        if self.min_distinct_chars is not None and len(set(text)) < self.min_distinct_chars:
            return "low_char_diversity"
        visible = sum(1 for c in text if not c.isspace())
        if self.min_letter_ratio is not None and visible and sum(c.isalpha() for c in text) / visible < \
                self.min_letter_ratio:
            return "low_letter_ratio"
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        if self.max_duplicate_line_fraction is not None and len(lines) > 1:
            repeats = len(lines) - len(set(lines))
            if repeats / len(lines) > self.max_duplicate_line_fraction:
                return "repeated_lines"
        if self.max_repeated_ngram_fraction is not None and len(words) >= 2 * self.ngram:
            grams = [tuple(words[i : i + self.ngram]) for i in range(len(words) - self.ngram + 1)]
            counts = Counter(grams)
            covered: set[int] = set()
            for i, g in enumerate(grams):
                if counts[g] > 1:
                    covered.update(range(i, i + self.ngram))
            if len(covered) / len(words) > self.max_repeated_ngram_fraction:
                return "repeated_ngrams"
        return None


class DocumentPreprocessor:
    """Quality filters then deduplication, streaming; :attr:`report` counts what was removed and why.

    Arguments:
        filters: a :class:`QualityFilter` (``None``: no quality filtering).
        dedup: a :class:`~lightning_llmopt.data.dedup.MinHashDeduplicator` (``None``: no deduplication).
    """

    def __init__(self, filters: QualityFilter | None = None, dedup: MinHashDeduplicator | None = None) -> None:
        self.filters, self.dedup = filters, dedup
        self.removed: Counter[str] = Counter()
        self.seen = 0
        self.kept = 0

    def __call__(self, documents: Iterable[str]) -> Iterator[str]:
        for text in documents:
            self.seen += 1
            why = self.filters.reason(text) if self.filters is not None else None
            if why is None and self.dedup is not None:
                before = (self.dedup.stats.exact_duplicates, self.dedup.stats.near_duplicates)
                if self.dedup.is_duplicate(text):
                    exact = self.dedup.stats.exact_duplicates > before[0]
                    why = "exact_duplicate" if exact else "near_duplicate"
            if why is not None:
                self.removed[why] += 1
                continue
            self.kept += 1
            yield text

    @property
    def report(self) -> dict[str, Any]:
        return {"seen": self.seen, "kept": self.kept, "removed": dict(sorted(self.removed.items()))}
