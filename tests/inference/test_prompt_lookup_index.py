"""Prompt lookup's incremental n-gram index proposes what the stateless whole-sequence search proposes."""

from __future__ import annotations

import random

import pytest

from lightning_llmopt.inference.drafters import PromptLookupDrafter


@pytest.mark.parametrize(("vocab", "ngram_max", "ngram_min"), [(3, 3, 1), (5, 4, 2), (50, 3, 1), (4, 1, 1)])
def test_indexed_lookup_equals_the_search_as_sequences_grow(vocab: int, ngram_max: int, ngram_min: int) -> None:
    drafter = PromptLookupDrafter(ngram_max, ngram_min)
    rng = random.Random(vocab * 100 + ngram_max * 10 + ngram_min)
    seqs = {sid: [rng.randrange(vocab) for _ in range(rng.randrange(0, 5))] for sid in range(12)}
    for _ in range(50):
        for sid, tokens in seqs.items():
            k = rng.randrange(0, 6)
            assert drafter.lookup_indexed(sid, tokens, k) == drafter.lookup(tokens, k)
            tokens.extend(rng.randrange(vocab) for _ in range(rng.randrange(1, 4)))


def test_index_rebuilds_when_the_indexed_prefix_changed_and_is_released() -> None:
    """An id looked up with a shorter sequence than it indexed, or whose last indexed token changed, gets a fresh
    index, not stale matches (the engine never reuses ids; committed tokens only grow)."""
    drafter = PromptLookupDrafter(3, 1)
    first = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    assert drafter.lookup_indexed(7, first, 3) == drafter.lookup(first, 3) == [3, 4, 1]
    other = [9, 8, 9, 8, 9]
    assert drafter.lookup_indexed(7, other, 2) == drafter.lookup(other, 2) == [8, 9]
    shorter = [1, 2, 1]
    assert drafter.lookup_indexed(7, shorter, 2) == drafter.lookup(shorter, 2) == [2, 1]
    drafter.release({3})
    assert 7 not in drafter.index
